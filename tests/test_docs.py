"""The docs say only what the code does: every option (`--foo`), metric name
(`mtcfs_...`) and `mtcfs status --json` field that README.md and docs/*.md mention
exists. Options are checked against the click commands' parameters (and the
repository's own tools: bench/, scripts/, the chaos harness); metrics against a
scrape of a real mount's metrics port; status fields against a real mount's
`mtcfs status --json`. Names that are not ours (kubectl, docker, buildah, py-spy,
rclone, getfattr flags; Python identifiers in the benchmark notes) are listed
below, each with where it comes from, so the lists cannot drift unnoticed."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import click
from prometheus_client.parser import text_string_to_metric_families

from mtcfs.cli.main import cli

from support.mounts import free_port, mtcfs, wait_until

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MiB = 1 << 20

# Options of other programs that the docs quote.
NOT_OURS_OPTIONS = {
    "--all": "kubectl delete --all",
    "--field-selector": "kubectl get --field-selector",
    "--build-arg": "docker/buildah build --build-arg",
    "--no-cache": "docker/buildah build --no-cache (and scripts/build_image.sh)",
    "--secret": "docker build --secret",
    "--shm-size": "docker run --shm-size",
    "--device": "buildah from --device",
    "--isolation": "buildah bud --isolation",
    "--layers": "buildah bud --layers",
    "--pull": "buildah bud --pull=never",
    "--variant": "debootstrap --variant=minbase",
    "--only-values": "getfattr --only-values",
    "--native": "py-spy record --native",
    "--threads": "py-spy record --threads",
    "--idle": "py-spy record --idle",
    "--dump": "rclone --dump headers",
    "--vfs-cache-mode": "rclone mount --vfs-cache-mode",
    "--vfs-write-back": "rclone mount --vfs-write-back",
    "--cache-dir": "rclone mount --cache-dir",
    "--bind": "mount --bind",
    "--csi-address": "the CSI sidecars (node-driver-registrar, livenessprobe)",
    "--kubelet-registration-path": "node-driver-registrar",
}
# Backticked snake_case or dotted names in paragraphs about `status --json` that are
# not status fields.
NOT_STATUS_FIELDS = {
    "support.gcs_server", "api_endpoint", "persist_progress", "keep_cache",
    "upload_from_filename", "chunk_size", "download_to_filename",  # benchmarks.md: code
    "step_4",  # a directory name
    "user.mtcfs.state",  # an extended attribute
}

OPTION = re.compile(r"(?<![\w/-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?:-\*)?")
METRIC = re.compile(r"\b(?:mtcfs|process)_[a-z0-9_]*[a-z0-9]")
FIELD = re.compile(r"`([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)`")


def mentions(pattern: re.Pattern[str]) -> dict[str, set[str]]:
    """{name: the doc files that mention it}."""
    out: dict[str, set[str]] = {}
    for doc in DOCS:
        for m in pattern.finditer(doc.read_text()):
            out.setdefault(m.group(0), set()).add(doc.name)
    return out


def cli_options() -> set[str]:
    found = {"--help"}

    def walk(cmd: click.Command) -> None:
        for p in cmd.params:
            found.update(o for o in (*p.opts, *p.secondary_opts) if o.startswith("--"))
        if isinstance(cmd, click.Group):
            for sub in cmd.commands.values():
                walk(sub)

    walk(cli)
    return found


def tool_options() -> set[str]:
    """Options our other tools define: argparse in bench/ and the chaos harness, the
    option cases of scripts/*.sh."""
    found: set[str] = set()
    for f in [*ROOT.glob("bench/*.py"), ROOT / "tests/support/chaos.py"]:
        found.update(re.findall(r"add_argument\(\s*[\"'](--[a-z0-9-]+)", f.read_text()))
    for f in ROOT.glob("scripts/*.sh"):
        found.update(re.findall(r"^\s*(--[a-z0-9-]+)(?:\|[^)]*)?\)", f.read_text(), re.M))
    return found


def test_every_option_in_the_docs_exists():
    ours = cli_options() | tool_options()
    unknown = {}
    for opt, docs in mentions(OPTION).items():
        if opt.endswith("-*"):  # `--tls-*`: some option of that prefix
            ok = any(o.startswith(opt[:-1]) for o in ours)
        else:
            ok = opt in ours or opt in NOT_OURS_OPTIONS
        if not ok:
            unknown[opt] = sorted(docs)
    assert not unknown, f"options the docs mention that no command has: {unknown}"
    # The allowlist holds only names the docs still use and that are not ours.
    assert not set(NOT_OURS_OPTIONS) & cli_options()
    assert set(mentions(OPTION)) >= set(NOT_OURS_OPTIONS)


def test_every_option_of_every_command_is_in_the_docs():
    """The other way round: an option a command has and no doc mentions is an option
    nobody can find (`--help` aside)."""
    documented = set(mentions(OPTION))
    prefixes = [o[:-1] for o in documented if o.endswith("-*")]
    missing: dict[str, list[str]] = {}

    def walk(cmd: click.Command, name: str) -> None:
        for p in cmd.params:
            for o in (*p.opts, *p.secondary_opts):
                if o.startswith("--") and o not in documented and o != "--help" \
                        and not any(o.startswith(x) for x in prefixes):
                    missing.setdefault(name, []).append(o)
        if isinstance(cmd, click.Group):
            for sub_name, sub in cmd.commands.items():
                walk(sub, f"{name} {sub_name}")

    walk(cli, "mtcfs")
    assert not missing, f"options no doc mentions: {missing}"


def scrape(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    names = set(re.findall(r"^# TYPE (\S+)", text, re.M))
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
    return names


def key_paths(tree: object) -> set[str]:
    """Every chain of keys `a.b.c` that starts at any object of the JSON tree."""
    out: set[str] = set()

    def chains(o: object) -> set[str]:
        found: set[str] = set()
        if isinstance(o, dict):
            for k, v in o.items():
                found.add(k)
                found.update(f"{k}.{c}" for c in chains(v))
        elif isinstance(o, list):
            for v in o:
                found.update(chains(v))
        return found

    def walk(o: object) -> None:
        out.update(chains(o))
        for v in (o.values() if isinstance(o, dict) else o if isinstance(o, list) else ()):
            walk(v)

    walk(tree)
    return out


def status_field_mentions() -> dict[str, set[str]]:
    """Backticked snake_case or dotted names in paragraphs that speak of
    `mtcfs status --json`."""
    out: dict[str, set[str]] = {}
    for doc in DOCS:
        for para in re.split(r"\n\s*\n", doc.read_text()):
            if "status --json" not in para:
                continue
            for m in FIELD.finditer(para):
                name = m.group(1)
                if ("_" in name or "." in name) and not name.startswith("mtcfs"):
                    out.setdefault(name, set()).add(doc.name)
    return out


def test_every_metric_and_status_field_in_the_docs_exists(make_cluster, tmp_path):
    """Two hosts with a bucket, K=1, retention, a committed step safe in both tiers:
    every series the docs name is there (a series that only appears under some
    condition is listed by its family's # TYPE line, which is always there)."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    port = free_port()
    c = make_cluster(2, replicas=1, start=False,
                     extra=("--bucket", f"file://{bucket}", "--persist", "step",
                            "--keep-steps", "1"))
    c.define("a", extra=("--metrics-port", str(port), "--metrics-address", "127.0.0.1"))
    c.start("a", "b")
    a = c["a"]
    step = a.path / "step_1"
    step.mkdir()
    (step / "shard").write_bytes(b"x" * MiB)
    (step / ".metadata").write_bytes(b"meta")
    wait_until(lambda: (a.status().get("newest_safe_step") or {}).get("step") == 1,
               timeout=30, what="step_1 safe")
    url = f"http://127.0.0.1:{port}/metrics"
    names = wait_until(lambda: "mtcfs_newest_safe_step" in (n := scrape(url)) and n,
                       timeout=10, what="a snapshot with the newest safe step")
    # `mtcfs controller` serves its own (docs/gke.md): checked against its collectors.
    from mtcfs.k8s import health
    ctl = {n for m in (health.PASSES, health.PASS_SECONDS, health.LEADER)
           for f in m.describe() for n in (f.name, f"{f.name}_total")}
    missing = {m: sorted(d) for m, d in mentions(METRIC).items()
               if m not in names and m not in ctl}
    assert not missing, f"metrics the docs mention that a mount does not serve: {missing}"
    # ... and every metric a mount serves is in the docs' table.
    documented = set(mentions(METRIC))
    families = {n for n in names if n.startswith("mtcfs_")
                and not n.endswith(("_created", "_bucket", "_count", "_sum"))}
    undocumented = sorted(n for n in families
                          if n not in documented and f"{n}_total" not in documented)
    assert not undocumented, f"metrics served but not in docs/operations.md: {undocumented}"

    r = mtcfs("status", str(a.path), "--json")
    assert r.returncode == 0, r.stderr
    paths = key_paths(json.loads(r.stdout))
    missing = {f: sorted(d) for f, d in status_field_mentions().items()
               if f not in paths and f not in NOT_STATUS_FIELDS}
    assert not missing, f"status fields the docs mention that status --json lacks: {missing}"
    assert set(status_field_mentions()) >= NOT_STATUS_FIELDS


def test_the_benchmark_groups_in_the_docs_are_the_ones_there_are():
    """docs/benchmarks.md lists `bench/run.py --only`'s groups: every one of them, and
    no other."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    assert spec is not None and spec.loader is not None
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        run = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    listed = re.search(r"`bench/run\.py --help` lists them: ([^)]*)\)", text)
    assert listed, "docs/benchmarks.md no longer lists the groups"
    assert re.findall(r"`([a-z0-9-]+)`", listed.group(1)) == list(run.GROUPS)
