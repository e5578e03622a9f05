#!/usr/bin/env bash
# Installs Debian's chromium when it is missing: the status page test drives it headless (over the
# DevTools pipe, no driver download). Quiet when it is already there.
set -euo pipefail
exec bash "$(dirname "$0")/ensure_deb.sh" chromium "the status page test" chromium chromium-browser
