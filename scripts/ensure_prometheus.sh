#!/usr/bin/env bash
# Make sure Prometheus' promtool exists: tests/unit/test_dashboards.py checks the alert and
# recording rules and every dashboard query with it. Installs Debian's prometheus package when
# it is missing and we are root (the package's own service is not needed).
set -euo pipefail
if command -v promtool >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing prometheus (Debian package, for promtool) ..."
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
  exit 0
fi
echo "promtool is missing: install it (apt-get install prometheus)" >&2
exit 1
