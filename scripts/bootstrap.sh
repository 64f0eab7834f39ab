#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian machine (as root): system packages, the
# .venv, and mtcfs installed in it with its test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES=(fuse3 libfuse3-dev pkg-config gcc python3-venv fio attr iproute2 nftables rclone psmisc patch)

missing=()
for p in "${DEB_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "bootstrap: installing Debian packages: ${missing[*]}"
    if [ "$(id -u)" -ne 0 ]; then
        echo "bootstrap: error: run as root to install ${missing[*]}" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv"
    "$PY" -m venv .venv
fi
# pyfuse3 built against libfuse 3.17 with the KILLPRIV_V2, passthrough and fallocate
# patches (see the script); falls back to stock pyfuse3. A venv built before the
# fallocate patch (marker .pyfuse3-passthrough or older) is rebuilt once.
if [ ! -f .venv/.pyfuse3-fallocate ] && [ -z "${MTCFS_STOCK_PYFUSE3:-}" ]; then
    scripts/build_pyfuse3.sh \
        || echo "bootstrap: warning: using stock pyfuse3 (small writes slower, no FUSE passthrough, no fallocate)" >&2
fi
stamp=.venv/.mtcfs-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] \
        || ! .venv/bin/python -c 'import pyfuse3, trio, google_crc32c, crc32c, blake3, atheris, mtcfs' 2>/dev/null; then
    echo "bootstrap: installing mtcfs and its test dependencies into .venv"
    .venv/bin/pip install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -c 'import pyfuse3, trio, google_crc32c, crc32c, blake3, atheris, mtcfs' || {
        echo "bootstrap: error: the .venv is incomplete (see pip output above)" >&2
        exit 1
    }
    touch "$stamp"
fi
echo "bootstrap: ok"
