#!/usr/bin/env python3
"""Print the Debian mirror this machine's apt uses, as `URI [SIGNED-BY]`.

The mirror is the URI of the first enabled `deb`/`deb-src` entry for the running
release's own suite (VERSION_CODENAME in /etc/os-release, e.g. `bookworm`), read
from /etc/apt/sources.list, /etc/apt/sources.list.d/*.list (one-line format)
and /etc/apt/sources.list.d/*.sources (deb822). Security, updates and
third-party entries use other suites and are skipped. SIGNED-BY is the entry's
keyring file, if it names one. Exit status 1 if no entry matches.

`--suffix=SUFFIX` looks for the suite `<codename>SUFFIX` instead, e.g.
`--suffix=-security` for the security mirror (`bookworm-security`).

Used by scripts/build_pyfuse3.sh and bench/passthrough_hp.sh to fetch Debian
source packages of a newer release from the same mirror, and by
scripts/build_image.sh to debootstrap the image's base from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

APT = Path("/etc/apt")


def codename(os_release: Path = Path("/etc/os-release")) -> str:
    for line in os_release.read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "VERSION_CODENAME":
            return value.strip().strip('"')
    return ""


def one_line_entries(text: str):
    """(types, uris, suites, signed_by) of each entry in sources.list format."""
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words or words[0] not in ("deb", "deb-src"):
            continue
        kind, rest = words[0], words[1:]
        options: dict[str, str] = {}
        if rest and rest[0].startswith("["):
            opts = []
            while rest:
                word = rest.pop(0)
                opts.append(word)
                if word.endswith("]"):
                    break
            for opt in " ".join(opts).strip("[] ").split():
                key, _, value = opt.partition("=")
                options[key.lower()] = value
        if len(rest) >= 2:
            yield [kind], [rest[0]], [rest[1]], options.get("signed-by", ""), True


def deb822_entries(text: str):
    """(types, uris, suites, signed_by, enabled) of each stanza in deb822 format."""
    stanza: dict[str, str] = {}
    key = ""
    for line in [*text.splitlines(), ""]:
        if line.startswith("#"):
            continue
        if not line.strip():
            if stanza:
                yield (stanza.get("types", "").split(), stanza.get("uris", "").split(),
                       stanza.get("suites", "").split(), stanza.get("signed-by", "").strip(),
                       stanza.get("enabled", "yes").strip().lower() != "no")
            stanza, key = {}, ""
        elif line[0] in " \t" and key:
            stanza[key] += "\n" + line.strip()
        else:
            key, _, value = line.partition(":")
            key = key.strip().lower()
            stanza[key] = value.strip()


def entries(apt: Path = APT):
    files = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]
    for f in files:
        if f.is_file():
            yield from one_line_entries(f.read_text(errors="replace"))
    for f in sorted((apt / "sources.list.d").glob("*.sources")):
        yield from deb822_entries(f.read_text(errors="replace"))


def mirror(suite: str, apt: Path = APT) -> tuple[str, str] | None:
    for types, uris, suites, signed_by, enabled in entries(apt):
        if not enabled or suite not in suites or not {"deb", "deb-src"} & set(types):
            continue
        for uri in uris:
            if uri.startswith(("http://", "https://")):
                keyring = signed_by if signed_by.startswith("/") and "\n" not in signed_by else ""
                return uri.rstrip("/"), keyring
    return None


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Print the Debian mirror apt uses.")
    parser.add_argument("--suffix", default="",
                        help="suite suffix, e.g. --suffix=-security for <codename>-security")
    args = parser.parse_args(argv)
    suite = codename()
    suite = suite + args.suffix if suite else ""
    found = mirror(suite) if suite else None
    if found is None:
        print(f"apt_mirror: no Debian mirror for suite {suite!r} in {APT}/sources.list*",
              file=sys.stderr)
        return 1
    print(*[part for part in found if part])
    return 0


if __name__ == "__main__":
    sys.exit(main())
