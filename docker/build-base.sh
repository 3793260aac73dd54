#!/usr/bin/env bash
# Build a base image (Debian + python3) from Debian's package archive, for hosts that can
# reach no image registry (so `FROM python:3.11-slim` cannot be pulled).
#
#   docker/build-base.sh [IMAGE]          # default IMAGE: zmqsync-base:bookworm
#   docker build --build-arg BASE_IMAGE=zmqsync-base:bookworm ...
#
# Needs root and debootstrap (apt-get install debootstrap). Does nothing if IMAGE exists
# already (FORCE=1 rebuilds). SUITE and MIRROR choose the Debian release and mirror.
# The suite's python3 must match the wheels in docker/wheelhouse (bookworm: 3.11).
set -euo pipefail

IMAGE=${1:-zmqsync-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-docker}

if [ "${FORCE:-0}" != 1 ] && $DOCKER image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "build-base: $IMAGE exists (FORCE=1 rebuilds it)"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "build-base: debootstrap needs root" >&2
    exit 1
fi
if ! command -v debootstrap >/dev/null; then
    echo "build-base: debootstrap is missing: apt-get install -y debootstrap" >&2
    exit 1
fi

rootfs=$(mktemp -d /var/tmp/zmqsync-rootfs.XXXXXX)
cleanup() {
    # debootstrap mounts proc/sys inside the target; never rm -rf through a mount
    grep -o " $rootfs/[^ ]*" /proc/mounts | sort -r | while read -r m; do
        umount -l "$m" || true
    done || true
    rm -rf --one-file-system "$rootfs"
}
trap cleanup EXIT

echo "build-base: debootstrap $SUITE into $rootfs"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 || {
    tail -n 30 "$rootfs.log" >&2
    rm -f "$rootfs.log"
    exit 1
}
rm -f "$rootfs.log"
# what an image does not need: package lists and caches, docs, man pages
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/cache/debconf/*-old \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/var/log/* "$rootfs"/tmp/*

tar --numeric-owner -C "$rootfs" -c . | $DOCKER import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "debootstrap --variant=minbase $SUITE (python3, python3-venv, ca-certificates)" \
    - "$IMAGE" >/dev/null
echo "build-base: built $IMAGE"
