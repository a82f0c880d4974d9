#!/usr/bin/env bash
# Make sure a `docker-compose` that can validate compose files offline is on PATH.
# Debian's docker-compose (1.29, Python) runs `docker-compose config` without a Docker engine; it
# understands the compose file format 3.x only, which is why docker-compose.yml uses version "3.8".
# Installs it with apt when missing and we are root on a Debian/Ubuntu system; exits 3 when it cannot
# (not root, or no apt), so callers can tell "unavailable here" from a real failure.
set -euo pipefail

if command -v docker-compose >/dev/null 2>&1; then
  command -v docker-compose
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure_compose: apt-get not available; install docker-compose by hand" >&2
  exit 3
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "ensure_compose: need root to apt-get install docker-compose" >&2
  exit 3
fi
export DEBIAN_FRONTEND=noninteractive
# The package lists may be missing or stale on a fresh machine: update once, then install.
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
command -v docker-compose
