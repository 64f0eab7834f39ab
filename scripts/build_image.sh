#!/usr/bin/env bash
# Build the container image mtcfs:<version> from deploy/Dockerfile with buildah,
# on a Debian machine as root, with no Docker Hub and no container engine:
#
# 1. buildah and debootstrap are installed with apt-get if missing.
# 2. The base image `debian:trixie-slim` (stored as
#    docker.io/library/debian:trixie-slim, the name `FROM debian:trixie-slim`
#    resolves to) is made once with `debootstrap --variant=minbase trixie` from
#    the Debian mirror this machine's apt uses (scripts/apt_mirror.py), slimmed
#    the way Debian's official slim images are (no docs, man pages or locales;
#    apt keeps no caches or package lists) and imported into buildah's storage.
#    It is kept between runs, made again when older than 30 days
#    ($MTCFS_BASE_MAX_AGE_DAYS) for Debian's updates, or with --rebuild-base.
# 3. `buildah bud --isolation chroot --layers --pull=never` builds the image:
#    RUN steps use the host's network (Debian's packages, PyPI) and the cached
#    layers of earlier builds, so a rebuild after a change in mtcfs/ only redoes
#    the last steps.
#
# Network steps are retried (apt-get, debootstrap, the whole build). Prints the
# image's size at the end.
#
#   scripts/build_image.sh [--rebuild-base] [--no-cache] [--prune] [--tag NAME:TAG]
#
# --prune: afterwards remove every dangling image of buildah's storage: the
# layers earlier builds left (after --no-cache, --rebuild-base or a change of
# dependencies), but also the build stage's cached layers, which the image does
# not contain: the next build redoes the build stage (minutes).
#
# Environment: MTCFS_IMAGE (default mtcfs:<version from pyproject.toml>),
# MTCFS_BASE_MIRROR (default: the mirror apt uses here), MTCFS_CA_BUNDLE (the
# CA bundle pip in the build trusts, default /etc/ssl/certs/ca-certificates.crt).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/sbin:/sbin  # debootstrap

BASE=docker.io/library/debian:trixie-slim
SUITE=trixie
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
IMAGE=${MTCFS_IMAGE:-mtcfs:$VERSION}
REBUILD_BASE=0
NO_CACHE=()
PRUNE=0
while (($#)); do
    case $1 in
        --prune) PRUNE=1 ;;
        --rebuild-base) REBUILD_BASE=1 ;;
        --no-cache) NO_CACHE=(--no-cache) ;;
        --tag) IMAGE=$2; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "build_image: error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

started=$SECONDS
step() { echo "build_image: [$((SECONDS - started)) s] $*"; }
die() { echo "build_image: error: $*" >&2; exit 1; }

# umount_under DIR: detach whatever a failed debootstrap left mounted below DIR
# (its /proc, /sys), deepest first, so that rm -rf never walks into them.
umount_under() {
    awk -v p="$1/" 'index($5, p) == 1 { print $5 }' /proc/self/mountinfo | sort -r \
        | while read -r m; do umount -l "$m" || true; done
}

work=
ctr=
cleanup() {
    if [ -n "$ctr" ]; then buildah rm "$ctr" >/dev/null 2>&1 || true; fi
    if [ -n "$work" ]; then umount_under "$work"; rm -rf --one-file-system "$work"; fi
}
trap cleanup EXIT

# retry N CMD...: run CMD up to N times, 10 s apart.
retry() {
    local n=$1 i; shift
    for ((i = 1; ; i++)); do
        "$@" && return 0
        ((i < n)) || return 1
        echo "build_image: attempt $i of $n failed: $*; retrying in 10 s" >&2
        sleep 10
    done
}

[ "$(id -u)" -eq 0 ] || die "run as root (buildah's chroot isolation and debootstrap need it)"
[ -f /etc/debian_version ] || die "this script installs its tools with apt-get: run it on Debian"

# -- 1. tools ---------------------------------------------------------------------------
missing=()
for p in buildah debootstrap; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$p")
done
if ((${#missing[@]})); then
    step "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    retry 3 apt-get update -qq || die "apt-get update failed"
    retry 3 apt-get install -y -qq -o Acquire::Retries=3 \
        "${missing[@]}" >/dev/null || die "could not install ${missing[*]} with apt-get"
fi

# -- 2. the base image ------------------------------------------------------------------
make_base() {
    local mirror keyring security rootfs mnt
    if [ -n "${MTCFS_BASE_MIRROR:-}" ]; then
        mirror=$MTCFS_BASE_MIRROR keyring=
    else
        read -r mirror keyring < <(python3 scripts/apt_mirror.py) \
            || die "no Debian mirror found in /etc/apt/sources.list* (set MTCFS_BASE_MIRROR)"
    fi
    security=$(python3 scripts/apt_mirror.py --suffix=-security 2>/dev/null | cut -d' ' -f1) || true
    work=$(mktemp -d /var/tmp/mtcfs-base.XXXXXX)
    rootfs=$work/rootfs

    step "debootstrap --variant=minbase $SUITE from $mirror (about a minute)"
    debootstrap_once() {
        umount_under "$rootfs"
        rm -rf --one-file-system "$rootfs"
        debootstrap --variant=minbase ${keyring:+--keyring="$keyring"} \
            "$SUITE" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
            || { tail -n 20 "$work/debootstrap.log" >&2; return 1; }
    }
    retry 3 debootstrap_once || die "debootstrap of $SUITE from $mirror failed (log above)"

    step "slimming the base"
    # What Debian's official -slim images do: dpkg leaves out docs (but copyright
    # files), man and info pages and locales, also for packages installed later;
    # apt keeps no .deb files, no binary caches and no translations.
    cat > "$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
    cat > "$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    echo 'Acquire::Languages "none";' > "$rootfs/etc/apt/apt.conf.d/docker-no-languages"
    echo 'Acquire::GzipIndexes "true";' > "$rootfs/etc/apt/apt.conf.d/docker-gzip-indexes"
    echo 'Apt::AutoRemove::SuggestsImportant "false";' \
        > "$rootfs/etc/apt/apt.conf.d/docker-autoremove-suggests"
    (cd "$rootfs" \
        && find usr/share/doc -mindepth 1 -not -type d -not -name copyright -delete \
        && find usr/share/doc -mindepth 1 -type d -empty -delete \
        && rm -rf usr/share/man/* usr/share/groff/* usr/share/info/* usr/share/lintian/* \
        && find usr/share/locale -mindepth 1 -maxdepth 1 -not -name locale.alias \
               -exec rm -rf {} +)
    # apt sources as in the official image (deb822), from this machine's mirror.
    rm -f "$rootfs/etc/apt/sources.list"
    {
        printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main\n' \
            "$mirror" "$SUITE" "$SUITE"
        printf 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n'
        if [ -n "$security" ]; then
            printf '\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: main\n' \
                "$security" "$SUITE"
            printf 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n'
        fi
    } > "$rootfs/etc/apt/sources.list.d/debian.sources"
    # Nothing of this machine or of the bootstrap: the runtime provides /dev,
    # resolv.conf and the hostname.
    rm -rf "$rootfs"/dev/* "$rootfs"/proc/* "$rootfs"/sys/* "$rootfs"/tmp/* "$rootfs"/run/* \
        "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/* \
        "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/lib/dpkg/*-old \
        "$rootfs"/root/.bash_history
    mkdir -p "$rootfs/var/lib/apt/lists/partial" "$rootfs/var/cache/apt/archives/partial"
    : > "$rootfs/etc/resolv.conf"
    : > "$rootfs/etc/hostname"
    rm -f "$rootfs/etc/machine-id" "$rootfs/var/lib/dbus/machine-id"
    grep -q 'VERSION_CODENAME=trixie' "$rootfs/etc/os-release" || die "the base is not trixie"

    step "importing it as $BASE"
    ctr=$(buildah from --pull=never scratch)
    mnt=$(buildah mount "$ctr")
    tar -C "$rootfs" -c . | tar -C "$mnt" -x --numeric-owner
    buildah umount "$ctr" >/dev/null
    buildah config --cmd bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --label "dev.mtcfs.base.source=debootstrap --variant=minbase $SUITE $mirror, slimmed" \
        --label "dev.mtcfs.base.created=$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$ctr"
    buildah commit -q --rm "$ctr" "$BASE" >/dev/null
    ctr=
    rm -rf "$work"
    work=
}

made=$(buildah inspect --type image \
    --format '{{index .OCIv1.Config.Labels "dev.mtcfs.base.created"}}' "$BASE" 2>/dev/null) || made=
max_age=${MTCFS_BASE_MAX_AGE_DAYS:-30}
if ((REBUILD_BASE)); then
    make_base
elif [ -z "$made" ]; then
    make_base  # none yet (or not one of ours)
elif (( $(date +%s) - $(date -d "$made" +%s) > max_age * 86400 )); then
    step "the base image is from $made, older than $max_age days: making it again"
    make_base
else
    step "keeping the base image $BASE (made $made; --rebuild-base makes it again)"
fi

# -- 3. the image -----------------------------------------------------------------------
# This machine's CA bundle goes to pip in the build as the secret `ca-bundle`
# (HTTPS here may pass a TLS-inspecting proxy whose CA only the host trusts).
ca=${MTCFS_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
SECRET=()
if [ -s "$ca" ]; then SECRET=(--secret "id=ca-bundle,src=$ca"); fi
previous=$(buildah inspect --type image --format '{{.FromImageID}}' "$IMAGE" 2>/dev/null) || true
step "buildah bud -f deploy/Dockerfile -t $IMAGE"
retry 2 buildah bud --isolation chroot --layers --pull=never "${NO_CACHE[@]}" "${SECRET[@]}" \
    -f deploy/Dockerfile -t "$IMAGE" . || die "buildah bud failed twice (output above)"
step "built $IMAGE"
# The image this one replaces, now nameless: removed (unless a container uses it),
# so that rebuilds do not pile up copies of the venv layer.
current=$(buildah inspect --type image --format '{{.FromImageID}}' "$IMAGE")
if [ -n "$previous" ] && [ "$previous" != "$current" ] \
        && [ "$(buildah images --format '{{.Name}}' "$previous" 2>/dev/null)" = "<none>" ]; then
    buildah rmi "$previous" >/dev/null 2>&1 && step "removed the image it replaces (${previous:0:12})" || true
fi
if ((PRUNE)); then
    step "removing dangling images"
    buildah rmi --prune >/dev/null
fi
buildah images "$IMAGE"
