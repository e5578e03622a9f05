#!/usr/bin/env bash
# Installs Debian's chromium when it is missing: the status page test drives it headless (over the
# DevTools pipe, no driver download). Quiet when it is already there.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "chromium is not installed and cannot be installed here (need root and apt-get); the status page test will be skipped" >&2
  exit 0
fi
echo "installing chromium from Debian (for the status page test)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq chromium >/dev/null
command -v chromium >/dev/null
