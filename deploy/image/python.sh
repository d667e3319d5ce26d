#!/bin/sh
# Python for kvmesh's images, on any Debian-based base image (Dockerfile): the base image's own
# python3 when it has one (the public Python image), else Debian's (3.11 on bookworm); then the
# virtual environment /opt/kvmesh/venv that the image puts on PATH. The arguments: more Debian
# packages to install. Certificates in /tmp/certs/*.crt (deploy/image/certs/: a proxy's CA) join
# the system's trust store, which pip is pointed at (PIP_CERT in the Dockerfile).
set -eu
packages="$* ca-certificates"
if ! command -v python3 >/dev/null 2>&1; then
    packages="$packages python3 python3-venv"
fi
if [ -n "$packages" ]; then
    apt-get update
    # shellcheck disable=SC2086 # a list of package names
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages
    rm -rf /var/lib/apt/lists/*
fi
if ls /tmp/certs/*.crt >/dev/null 2>&1; then
    cp /tmp/certs/*.crt /usr/local/share/ca-certificates/
    update-ca-certificates
fi
rm -rf /tmp/certs
python3 -m venv /opt/kvmesh/venv
/opt/kvmesh/venv/bin/python -c 'import sys; assert sys.version_info >= (3, 11), f"kvmesh needs Python 3.11+, the image has {sys.version}"'
