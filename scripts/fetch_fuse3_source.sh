#!/usr/bin/env bash
# Fetch and unpack Debian's fuse3 (libfuse) source package into DIR; print the
# source tree's path on stdout. The suite is trixie (libfuse 3.17; Debian 12
# ships 3.14), or $LIBFUSE_SUITE; the mirror is the one this machine's apt uses
# (scripts/apt_mirror.py). apt runs with its own lists under DIR, so the
# machine's apt state is left alone.
#
#   scripts/fetch_fuse3_source.sh DIR
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$1
suite=${LIBFUSE_SUITE:-trixie}

read -r mirror keyring < <(python3 scripts/apt_mirror.py)
echo "fetch_fuse3_source: fuse3 from $mirror ($suite)" >&2
mkdir -p "$dir/lists/partial"
echo "deb-src ${keyring:+[signed-by=$keyring] }$mirror $suite main" > "$dir/sources.list"
APT=(apt-get -qq -o Dir::Etc::SourceList="$dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o Dir::State::Lists="$dir/lists" -o APT::Sandbox::User=root)
"${APT[@]}" update
(cd "$dir" && "${APT[@]}" source --download-only fuse3 >/dev/null)
tar xzf "$dir"/fuse3_*.orig.tar.gz -C "$dir"
echo "$dir"/fuse-3.*
