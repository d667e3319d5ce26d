#!/usr/bin/env bash
# Make sure the redis-server binary exists (kvmesh up and the tests start private ones).
# Installs Debian's redis-server package when it is missing and we are root.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing redis-server (Debian package) ..."
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  # the package may start a system instance; kvmesh does not need it
  exit 0
fi
echo "redis-server is missing: install it (apt-get install redis-server) or set REDIS_URL" >&2
exit 1
