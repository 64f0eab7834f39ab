"""Whether the RAM tier's tmpfs backs files with transparent huge pages.

Huge pages make writing into the tmpfs, and reading from it, about twice as cheap
(docs/benchmarks.md) — except on a VM whose hypervisor takes freed memory back:
there the first touch of a huge page waits for the host to hand back 2 MiB at once,
and filling 2 GiB took 5.0 s against 1.05 s with small pages. `auto` measures it at
mount: the same bytes written into a small-page tmpfs and into a huge-page one,
first touch each, and keeps huge pages unless they are the slower.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from typing import Any

from mtcfs.mountinfo import entry_at

log = logging.getLogger(__name__)

SETTINGS = ("auto", "always", "never")
HUGE = "within_size"  # huge pages only where the file covers them whole
PROBE_BYTES = 64 << 20
# Huge pages are kept unless their first touch costs this much more than small pages'.
SLOWER = 1.25
_CHUNK = 1 << 20


class HugePages:
    """The `--huge-pages` choice for the RAM tier's tmpfs: `mount_option()` says the
    tmpfs `huge=` value to mount with (probing first for `auto`); `status()` says
    what was chosen and why."""

    def __init__(self, setting: str = "auto") -> None:
        if setting not in SETTINGS:
            raise ValueError(f"huge pages: {setting!r} is not one of {', '.join(SETTINGS)}")
        self.setting = setting
        self.in_use = False
        self.probe: dict[str, Any] | None = None
        self._chosen: str | None = None

    def mount_option(self, scratch: str) -> str:
        """The tmpfs `huge=` value: within_size or never. `scratch` is a directory the
        probe may mount its small tmpfs on (left as it was found)."""
        if self._chosen is None:
            if self.setting == "never":
                self._chosen = "never"
            elif self.setting == "always":
                self._chosen = HUGE
            else:
                self._chosen = self._probe(scratch)
        return self._chosen

    def mounted(self, option: str) -> None:
        """The tmpfs is mounted with huge=`option` (`never` where the kernel refused)."""
        self.in_use = option != "never"

    def status(self) -> dict[str, Any]:
        return {"setting": self.setting, "in_use": self.in_use, "probe": self.probe}

    def describe(self) -> str:
        """The choice and why, for the daemon's "mounted" log line."""
        said = f"{'on' if self.in_use else 'off'} (--huge-pages {self.setting}"
        p = self.probe or {}
        if "error" in p:
            said += f"; the probe failed: {p['error']}"
        elif "huge_ms_per_mib" in p:
            said += (f"; first touch {p['huge_ms_per_mib']:.2f} ms/MiB with huge pages, "
                     f"{p['small_ms_per_mib']:.2f} with small ones")
        return said + ")"

    def _probe(self, scratch: str) -> str:
        try:
            small = _first_touch(scratch, "never")
            huge = _first_touch(scratch, "always")
        except OSError as e:  # no huge pages for tmpfs in this kernel, or no tmpfs here
            self.probe = {"error": str(e)}
            # Said in the daemon's "mounted" line (describe()): a mount that fails
            # later says one line, its cause.
            log.debug("huge pages: off for the RAM tier, the probe failed (%s)", e)
            return "never"
        mib = PROBE_BYTES / (1 << 20)
        self.probe = {"bytes": PROBE_BYTES, "small_ms_per_mib": round(small * 1e3 / mib, 3),
                      "huge_ms_per_mib": round(huge * 1e3 / mib, 3)}
        use = huge <= small * SLOWER
        self.probe["chosen"] = HUGE if use else "never"
        log.debug("huge pages: %s for the RAM tier (first touch of %d MiB: %.2f ms/MiB with "
                 "huge pages, %.2f ms/MiB with small ones; --huge-pages always|never "
                 "overrides)", "on" if use else "off", mib, self.probe["huge_ms_per_mib"],
                 self.probe["small_ms_per_mib"])
        return HUGE if use else "never"


def _first_touch(scratch: str, huge: str) -> float:
    """Seconds to write PROBE_BYTES into a fresh file on a tmpfs mounted with huge=`huge`
    at `scratch` (memory touched for the first time by this tmpfs)."""
    os.makedirs(scratch, mode=0o700, exist_ok=True)
    if entry_at(scratch) is not None:  # left by a daemon killed while probing
        subprocess.run(["umount", "-l", scratch], capture_output=True)
    opts = f"size={PROBE_BYTES + (4 << 20)},mode=0700,huge={huge}"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "mtcfs-probe", scratch],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise OSError(f"mount tmpfs huge={huge}: {r.stderr.strip()}")
    try:
        buf = b"\x5a" * _CHUNK
        fd = os.open(os.path.join(scratch, "probe"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, PROBE_BYTES)  # sized first: within_size and always alike
            t0 = time.perf_counter()
            for off in range(0, PROBE_BYTES, _CHUNK):
                os.pwrite(fd, buf, off)
            return time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", scratch], capture_output=True)
        with contextlib.suppress(OSError):
            os.rmdir(scratch)
