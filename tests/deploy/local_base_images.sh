#!/usr/bin/env bash
# Local stand-ins for the two Python base images the image test builds on, for machines where no
# container registry is reachable (no `FROM python:...` pull):
#
#   local/python:3.11-slim   like python:3.11-slim-bookworm: Python with its C headers, no compiler
#   local/python:3.11-full   like python:3.11-bookworm: the same plus build-essential (gcc, g++, make)
#
#   sudo bash tests/deploy/local_base_images.sh [DEBIAN_MIRROR]     (needs debootstrap and docker)
#   KVSERVE_IMAGE_BASES="local/python:3.11-slim local/python:3.11-full" python -m pytest -m docker tests/deploy/test_image.py
#
# Debian bookworm's own Python (3.11) from debootstrap's minimal variant. The machine's CA trust
# store is copied in, so that pip inside trusts the same package index (and any TLS proxy) as pip
# here. ~2 minutes each.
set -euo pipefail
MIRROR="${1:-http://deb.debian.org/debian}"
WORK="$(mktemp -d)"
ROOTFS="$WORK/rootfs"
trap 'rm -rf "$WORK"' EXIT

in_root() { chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive "$@"; }

import_as() {
  # The image's environment, as the python images set it.
  tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$1" >/dev/null
  echo "built $1 ($(docker image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'))"
}

debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -n 20 "$WORK/debootstrap.log"; exit 1; }
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
in_root apt-get update -qq
# python3-dev: the official python images keep Python's headers (/usr/local/include), and the
# compiled forward's kernels are Python extension modules.
in_root apt-get install -y -qq --no-install-recommends python3 python3-venv python3-pip python3-dev \
  python-is-python3 ca-certificates >/dev/null
mkdir -p "$ROOTFS/usr/local/share/ca-certificates"
cp -a /usr/local/share/ca-certificates/. "$ROOTFS/usr/local/share/ca-certificates/" 2>/dev/null || true
cp -a /etc/ssl/certs/. "$ROOTFS/etc/ssl/certs/"
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$ROOTFS/etc/pip.conf"
in_root apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/*
import_as local/python:3.11-slim

in_root apt-get update -qq
in_root apt-get install -y -qq --no-install-recommends build-essential >/dev/null
in_root apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/*
import_as local/python:3.11-full
