"""The peer protocols' fuzz targets (fuzz/), each run for a few seconds against an
in-process daemon with the checked-in seed corpus: every seed and what the fuzzer
makes of it in that time must leave the daemon alive, answering and its index a
tree (`make fuzz` runs them for longer). The corpus is what fuzz/seeds.py makes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fuzz import seeds  # noqa: E402
from fuzz.targets import NAMES  # noqa: E402

SECONDS = 3  # per target, after the daemon started (about 2 s more, instrumenting)


@pytest.mark.parametrize("target", NAMES)
def test_target_finds_nothing(tmp_path: Path, target: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    corpus = ROOT / "fuzz" / "corpus" / target
    r = subprocess.run(
        [sys.executable, "-m", "fuzz.run", target, f"-max_total_time={SECONDS}",
         f"-artifact_prefix={tmp_path}/", "-print_final_stats=1", str(work), str(corpus)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    crashes = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(
        ("crash-", "timeout-", "oom-")))
    assert r.returncode == 0 and not crashes, f"{target}: {crashes}\n{out[-6000:]}"
    runs = re.search(r"Done (\d+) runs", out)
    assert runs is not None, out[-3000:]
    # Every seed ran (libFuzzer runs each once at start), and the fuzzer went beyond.
    assert int(runs.group(1)) > len(list(corpus.iterdir())), out[-3000:]


def test_seed_corpus_is_current(tmp_path: Path) -> None:
    seeds.write(str(tmp_path))
    for target in NAMES:
        made = {p.name: p.read_bytes() for p in (tmp_path / target).iterdir()}
        held = {p.name: p.read_bytes()
                for p in (ROOT / "fuzz" / "corpus" / target).iterdir()}
        assert made == held, f"fuzz/corpus/{target} is stale: run python -m fuzz.seeds"
