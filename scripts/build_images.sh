#!/usr/bin/env bash
# `make image`: kvmesh's images for the compose cluster, built with podman from what this machine
# reaches (Debian's packages and PyPI; no image registry):
#   localhost/kvmesh-base:bookworm  a Debian bookworm made with debootstrap (once; kept)
#   localhost/kvmesh:local          ./Dockerfile on that base (the tag compose.yaml names)
#   localhost/kvmesh-redis:local    Debian's redis-server on that base (deploy/image/redis)
# Installs podman, runc and debootstrap (Debian's packages) when they are missing and we are
# root, and points podman at deploy/podman/containers.conf (a restricted host's settings) unless
# CONTAINERS_CONF is set. The CPU build of torch goes in from this machine's pip (its find-links,
# no download) when it has it, else from PyTorch's CPU index; the CA bundle this machine's pip
# trusts (a TLS-inspecting proxy's) goes in too. Users with a registry: `docker compose up --build`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BASE=localhost/kvmesh-base:bookworm
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

need=()
for tool in podman runc debootstrap; do command -v "$tool" >/dev/null 2>&1 || need+=("$tool"); done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "make image needs ${need[*]}: install them (Debian: apt-get install ${need[*]})" >&2
    exit 1
  fi
  echo "installing ${need[*]} (Debian packages) ..."
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/podman/containers.conf}

if ! podman image exists "$BASE"; then
  root=$(mktemp -d /tmp/kvmesh-base.XXXXXX)
  trap 'rm -rf "$root"' EXIT
  echo "making $BASE with debootstrap ($MIRROR) ..."
  debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" >/dev/null
  tar -C "$root" -c . | podman import --quiet - "$BASE" >/dev/null
fi

torch_index=()
rm -f deploy/image/wheels/*.whl
if "$PY" -m pip download --quiet --no-deps --no-index --dest deploy/image/wheels "torch==2.13.0+cpu" 2>/dev/null; then
  echo "torch: $(ls deploy/image/wheels/*.whl) (this machine's)"
else
  torch_index=(--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)
fi
rm -f deploy/image/certs/*.crt
cert=${PIP_CERT:-$("$PY" -m pip config get global.cert 2>/dev/null || true)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
  cp "$cert" deploy/image/certs/pip.crt
fi

build() {  # podman build "$@", its log shown only when it fails
  local log
  log=$(mktemp)
  if ! podman build "$@" >"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "make image: podman build $* failed (whole log: $log)" >&2
    exit 1
  fi
  rm -f "$log"
}
echo "building localhost/kvmesh:local and localhost/kvmesh-redis:local (minutes the first time; cached after) ..."
build --build-arg BASE_IMAGE="$BASE" "${torch_index[@]}" -t localhost/kvmesh:local .
build --build-arg BASE_IMAGE="$BASE" -t localhost/kvmesh-redis:local deploy/image/redis
# a rebuild leaves the last image's layers untagged (4 GB a time): drop them
podman image prune --force >/dev/null
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^localhost/kvmesh' || true
