#!/usr/bin/env bash
# Reference figures for FUSE passthrough: libfuse's own example file system
# passthrough_hp (C++, multi-threaded) over a tmpfs directory, with passthrough
# on and off (--nopassthrough), beside raw tmpfs, in one run
# (bench/passthrough_hp.py does the measuring).
#
# passthrough_hp is libfuse's code and never part of this repository: this
# script fetches Debian's fuse3 source package (scripts/fetch_fuse3_source.sh,
# the libfuse 3.17 that scripts/build_pyfuse3.sh builds) and compiles
# example/passthrough_hp.cc with g++ against .venv/opt/libfuse into
# .venv/opt/libfuse-examples/ (once). It is built without libfuse's config.h
# and so without HAVE_SETXATTR: the file system answers GETXATTR with ENOSYS,
# after which the kernel stops asking for security.capability before every
# write() (what KILLPRIV_V2 does for mtcfs).
#
#   bench/passthrough_hp.sh [--build-only | bench/passthrough_hp.py options]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=$PWD/.venv
PREFIX=$VENV/opt/libfuse
OUT=$VENV/opt/libfuse-examples
BIN=$OUT/passthrough_hp
export PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig

if ! pkg-config --atleast-version=3.17 fuse3 2>/dev/null; then
    echo "passthrough_hp.sh: no libfuse >= 3.17 in $PREFIX: run make bootstrap first" >&2
    exit 1
fi
if [ ! -x "$BIN" ]; then
    command -v g++ >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
    work=$(mktemp -d /tmp/mtcfs-passthrough-hp.XXXXXX)
    trap 'rm -rf "$work"' EXIT
    src=$(scripts/fetch_fuse3_source.sh "$work")
    echo "passthrough_hp.sh: compiling $(basename "$src")/example/passthrough_hp.cc into $OUT" >&2
    mkdir -p "$OUT"
    # shellcheck disable=SC2046  # pkg-config prints several words
    g++ -std=c++17 -O2 -DHAVE_UTIMENSAT -DHAVE_POSIX_FALLOCATE $(pkg-config --cflags fuse3) \
        -o "$BIN.tmp" "$src/example/passthrough_hp.cc" \
        $(pkg-config --libs fuse3) -Wl,-rpath,"$PREFIX/lib" -pthread
    mv "$BIN.tmp" "$BIN"
fi
if [ "${1:-}" = --build-only ]; then
    echo "$BIN"
    exit 0
fi
exec "$VENV/bin/python" bench/passthrough_hp.py --binary "$BIN" "$@"
