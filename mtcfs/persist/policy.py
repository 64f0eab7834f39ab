"""The persist policy (--persist): what is uploaded to the durable tier, and when."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Mode(enum.Enum):
    ON_CLOSE = "on-close"
    STEP = "step"
    INTERVAL = "interval"
    MANUAL = "manual"


@dataclass(frozen=True)
class PersistPolicy:
    mode: Mode = Mode.STEP
    interval: float = 0.0

    @classmethod
    def parse(cls, text: str) -> PersistPolicy:
        """`on-close`, `step`, `interval:SECONDS` or `manual`; ValueError otherwise."""
        if text.startswith("interval:"):
            try:
                seconds = float(text.split(":", 1)[1])
            except ValueError:
                seconds = -1
            if seconds <= 0:
                raise ValueError(f"invalid persist policy {text!r}: interval needs seconds > 0")
            return cls(Mode.INTERVAL, seconds)
        for mode in Mode:
            if text == mode.value and mode is not Mode.INTERVAL:
                return cls(mode)
        raise ValueError(
            f"invalid persist policy {text!r}: use on-close, step, interval:SECONDS or manual"
        )

    def __str__(self) -> str:
        return f"interval:{self.interval:g}" if self.mode is Mode.INTERVAL else self.mode.value
