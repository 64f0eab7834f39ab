"""A bytes progress bar (rate, ETA) driven by polling the daemon."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from mtcfs.sizes import format_size


class BinarySpeedColumn(ProgressColumn):
    """The transfer rate in binary units, as every size mtcfs prints (rich's own
    TransferSpeedColumn has decimal units only)."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if speed is None:
            return Text("?", style="progress.data.speed")
        return Text(f"{format_size(speed)}/s", style="progress.data.speed")


def poll_with_progress(label: str, poll: Callable[[], dict[str, Any]],
                       interval: float = 0.2) -> dict[str, Any]:
    """Call poll() until it reports finished; show bytes, rate and ETA on stderr.

    poll() returns {"bytes_total", "bytes_done", "finished", "note"?}."""
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               BinarySpeedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[note]}"))
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task(label, total=None, note="")
        while True:
            st = poll()
            bar.update(task, total=max(st["bytes_total"], 1), completed=st["bytes_done"],
                       note=st.get("note") or "")
            if st["finished"]:
                bar.update(task, completed=max(st["bytes_total"], 1))
                return st
            time.sleep(interval)
