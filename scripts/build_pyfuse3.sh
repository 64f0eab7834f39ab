#!/usr/bin/env bash
# Build pyfuse3 against libfuse >= 3.17 with FUSE_HANDLE_KILLPRIV_V2 negotiated.
#
# Why: without HANDLE_KILLPRIV_V2 the kernel sends GETXATTR(security.capability)
# to the daemon before every write() syscall, a full round trip that caps 4 KiB
# writes at ~60 MB/s here. Debian 12's libfuse 3.14 cannot negotiate it and
# stock pyfuse3 never asks, so we build libfuse 3.17 from Debian's own source
# package (trixie) into .venv/opt/libfuse and pyfuse3 3.5.0 with a two-line
# patch (scripts/patches/pyfuse3-killpriv-v2.patch) that requests it when the
# Operations class sets `enable_killpriv_v2`.
#
# Any failure leaves the stock pyfuse3 in place: mtcfs works either way, only
# small writes are slower. The mount is always nosuid, so the kernel's
# suid/capability clearing that KILLPRIV_V2 hands to the daemon never matters.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=$PWD/.venv
PREFIX=$VENV/opt/libfuse
MARKER=$VENV/.pyfuse3-killpriv-v2
PYFUSE3_VERSION=3.5.0
[ -f "$MARKER" ] && exit 0

work=$(mktemp -d /tmp/mtcfs-pyfuse3.XXXXXX)
trap 'rm -rf "$work"' EXIT

for p in patch; do command -v $p >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $p >/dev/null; done
"$VENV/bin/pip" install -q --disable-pip-version-check meson ninja 2>&1 | grep -v '^WARNING: Location' || true

echo "build_pyfuse3: fetching the libfuse 3.17 source package (Debian trixie)"
mkdir -p "$work/lists/partial"
echo "deb-src http://deb.debian.org/debian trixie main" > "$work/sources.list"
APT=(apt-get -qq -o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o Dir::State::Lists="$work/lists" -o APT::Sandbox::User=root)
"${APT[@]}" update
(cd "$work" && "${APT[@]}" source --download-only fuse3 >/dev/null)
tar xzf "$work"/fuse3_*.orig.tar.gz -C "$work"
src=$(echo "$work"/fuse-3.*)
grep -q FUSE_CAP_HANDLE_KILLPRIV_V2 "$src/include/fuse_common.h"

echo "build_pyfuse3: building $(basename "$src") into $PREFIX"
(cd "$src" && PATH=$VENV/bin:$PATH meson setup build --prefix="$PREFIX" --libdir=lib \
    -Dexamples=false -Dutils=false -Dtests=false >/dev/null \
    && PATH=$VENV/bin:$PATH ninja -C build install >/dev/null)

echo "build_pyfuse3: building pyfuse3 $PYFUSE3_VERSION with the KILLPRIV_V2 patch"
(cd "$work" && "$VENV/bin/pip" download -q --disable-pip-version-check --no-deps \
    --no-binary :all: "pyfuse3==$PYFUSE3_VERSION" 2>&1 | grep -v '^WARNING: Location' || true)
tar xzf "$work/pyfuse3-$PYFUSE3_VERSION.tar.gz" -C "$work"
(cd "$work/pyfuse3-$PYFUSE3_VERSION" && patch -s -p1 < "$OLDPWD/scripts/patches/pyfuse3-killpriv-v2.patch" \
    && rm -f src/pyfuse3/__init__.c)
PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig LDFLAGS="-Wl,-rpath,$PREFIX/lib" \
SETUPTOOLS_SCM_PRETEND_VERSION=$PYFUSE3_VERSION \
    "$VENV/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps \
    "$work/pyfuse3-$PYFUSE3_VERSION" 2>&1 | grep -v '^WARNING: Location' || true
ldd "$VENV"/lib/python3*/site-packages/pyfuse3/*.so | grep -q "$PREFIX" 
touch "$MARKER"
echo "build_pyfuse3: ok"
