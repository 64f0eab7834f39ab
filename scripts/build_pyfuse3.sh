#!/usr/bin/env bash
# Build pyfuse3 against libfuse >= 3.17 with two small patches:
#
# - scripts/patches/pyfuse3-killpriv-v2.patch: negotiate FUSE_HANDLE_KILLPRIV_V2
#   when the Operations class sets `enable_killpriv_v2`. Without it the kernel
#   sends GETXATTR(security.capability) to the daemon before every write()
#   syscall, a full round trip that caps 4 KiB writes at ~60 MB/s here.
# - scripts/patches/pyfuse3-passthrough.patch: FUSE passthrough (Linux >= 6.9):
#   `Operations.enable_passthrough`, `pyfuse3.passthrough_enabled()`,
#   `pyfuse3.backing_open(fd)`/`backing_close(id)` and `FileInfo.backing_id`;
#   reads, writes and mmap of a file opened with a backing id go straight to the
#   backing file (tests/test_pyfuse3_passthrough.py).
# - scripts/patches/pyfuse3-fallocate.patch: `Operations.fallocate(fh, mode,
#   offset, length)`, libfuse's low-level fallocate, which pyfuse3 does not
#   register (the kernel then answers EOPNOTSUPP to every fallocate()).
#
# Debian 12's libfuse 3.14 can do neither, so libfuse 3.17 is built from
# Debian's own source package (trixie, from the mirror this machine's apt
# uses: scripts/fetch_fuse3_source.sh) into .venv/opt/libfuse, and pyfuse3
# 3.5.0 from its sdist against it. Only pyfuse3 is built from source: its
# build dependencies (Cython, ...) come as wheels.
#
# Any failure leaves the stock pyfuse3 in place: mtcfs works either way, only
# small writes are slower and passthrough is unavailable. The mount is always
# nosuid, so the kernel's suid/capability clearing that KILLPRIV_V2 hands to
# the daemon never matters.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=$PWD/.venv
PREFIX=$VENV/opt/libfuse
MARKER=$VENV/.pyfuse3-fallocate
PYFUSE3_VERSION=3.5.0
PATCHES=(pyfuse3-killpriv-v2.patch pyfuse3-passthrough.patch pyfuse3-fallocate.patch)
[ -f "$MARKER" ] && exit 0

work=$(mktemp -d /tmp/mtcfs-pyfuse3.XXXXXX)
trap 'rm -rf "$work"' EXIT
pip() { "$VENV/bin/pip" "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }
started=$SECONDS
step() { echo "build_pyfuse3: [$((SECONDS - started)) s] $*"; }

for p in patch; do command -v $p >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $p >/dev/null; done

# libfuse: kept when an earlier build already installed a version with passthrough.
if PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig pkg-config --atleast-version=3.17 fuse3 2>/dev/null \
        && grep -q FUSE_CAP_PASSTHROUGH "$PREFIX/include/fuse3/fuse_common.h" 2>/dev/null; then
    step "keeping libfuse $(PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig pkg-config --modversion fuse3) in $PREFIX"
else
    step "fetching the fuse3 source package"
    src=$(scripts/fetch_fuse3_source.sh "$work")
    pip install -q --disable-pip-version-check meson ninja
    grep -q FUSE_CAP_HANDLE_KILLPRIV_V2 "$src/include/fuse_common.h"
    grep -q FUSE_CAP_PASSTHROUGH "$src/include/fuse_common.h"

    step "building $(basename "$src") into $PREFIX"
    (cd "$src" && PATH=$VENV/bin:$PATH meson setup build --prefix="$PREFIX" --libdir=lib \
        -Dexamples=false -Dutils=false -Dtests=false >/dev/null \
        && PATH=$VENV/bin:$PATH ninja -C build install >/dev/null)
fi

step "building pyfuse3 $PYFUSE3_VERSION with ${PATCHES[*]}"
(cd "$work" && pip download -q --disable-pip-version-check --no-deps \
    --no-binary pyfuse3 "pyfuse3==$PYFUSE3_VERSION")
tar xzf "$work/pyfuse3-$PYFUSE3_VERSION.tar.gz" -C "$work"
for p in "${PATCHES[@]}"; do
    patch -s -p1 -d "$work/pyfuse3-$PYFUSE3_VERSION" < "scripts/patches/$p"
done
rm -f "$work/pyfuse3-$PYFUSE3_VERSION/src/pyfuse3/__init__.c"  # generated from the patched .pyx
# Built into a wheel first and installed last: the pyfuse3 in place keeps working
# (daemons of this venv keep starting) until the one-second swap.
PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig LDFLAGS="-Wl,-rpath,$PREFIX/lib" \
SETUPTOOLS_SCM_PRETEND_VERSION=$PYFUSE3_VERSION \
    pip wheel -q --disable-pip-version-check --no-deps -w "$work/wheel" \
    "$work/pyfuse3-$PYFUSE3_VERSION"
step "installing it"
pip install -q --disable-pip-version-check --force-reinstall --no-deps "$work"/wheel/pyfuse3-*.whl
so=$(echo "$VENV"/lib/python3*/site-packages/pyfuse3/*.so)
ldd "$so" | grep "$PREFIX" >/dev/null  # not grep -q: ldd may fail on the closed pipe
grep -q backing_open "$so"  # the passthrough patch is in
grep -q fuse_fallocate "$so"  # the fallocate patch is in
rm -f "$VENV/.pyfuse3-killpriv-v2" "$VENV/.pyfuse3-passthrough"  # markers of earlier builds
touch "$MARKER"
step "ok"
