"""Run one fuzz target under atheris (libFuzzer): `python -m fuzz.run TARGET [libFuzzer
options] [CORPUS_DIR...]`, e.g. `python -m fuzz.run bulk -max_total_time=60 /tmp/w
fuzz/corpus/bulk`. New inputs go to the first corpus directory; a finding is
written as crash-<sha1> (an input that wedges the daemon: timeout-<sha1>; see
-artifact_prefix) with its traceback, and exits non-zero.
mtcfs's modules are instrumented for coverage; the daemon under test is fuzz.host's."""

from __future__ import annotations

import logging
import sys

import atheris

with atheris.instrument_imports(include=["mtcfs"]):
    from fuzz.host import Host
    from fuzz.targets import ENCRYPTED, NAMES, Targets

HANG = 60  # seconds an input may take before libFuzzer reports it (timeout-<sha1>): wedged


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in NAMES:
        print(f"usage: python -m fuzz.run {{{','.join(NAMES)}}} [libFuzzer options] "
              "[corpus dirs]", file=sys.stderr)
        sys.exit(2)
    name = sys.argv.pop(1)
    # The daemon's warnings about refused input would drown libFuzzer's report.
    logging.basicConfig(level=logging.CRITICAL)
    host = Host(encrypt=name in ENCRYPTED).start()
    target = Targets(host).by_name[name]
    if not any(a.startswith("-timeout=") for a in sys.argv):
        sys.argv.insert(1, f"-timeout={HANG}")
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
