#!/usr/bin/env bash
# Installs Debian package PACKAGE when none of COMMANDS is on the PATH (as root with apt-get); quiet
# when one is there, a warning naming WHAT will be skipped when it cannot install.
# Usage: ensure_deb.sh PACKAGE "WHAT needs it" COMMAND [COMMAND...]   (the first COMMAND must result)
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 PACKAGE \"WHAT needs it\" COMMAND [COMMAND...]" >&2
  exit 2
fi
package=$1 what=$2
shift 2
for cmd in "$@"; do
  if command -v "$cmd" >/dev/null 2>&1; then exit 0; fi
done
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "$1 is not installed and cannot be installed here (need root and apt-get); $what will be skipped" >&2
  exit 0
fi
echo "installing $package from Debian (for $what)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq "$package" >/dev/null
command -v "$1" >/dev/null
