#!/usr/bin/env bash
# A Debian bookworm base image built locally, for machines that reach no image
# registry: mmdebstrap (minbase) from the Debian mirror this machine's apt uses,
# imported as epd-base:bookworm. Then:
#   EPD_BASE_IMAGE=epd-base:bookworm docker compose -f compose.yaml -f compose.cpu.yaml build
set -euo pipefail
NAME="${1:-epd-base:bookworm}"
if docker image inspect "$NAME" >/dev/null 2>&1; then
  exit 0
fi
MIRROR="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
  | grep -oE '^(URIs:|deb) +https?://[^ ]+' | grep -v security | head -1 | awk '{print $2}' || true)"
TAR="$(mktemp --suffix=.tar)"
trap 'rm -f "$TAR"' EXIT
mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm "$TAR" "${MIRROR:-http://deb.debian.org/debian}"
docker import "$TAR" "$NAME" >/dev/null
echo "$NAME"
