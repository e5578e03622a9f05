#!/usr/bin/env bash
# Installs etcd (Debian's etcd-server) when it is missing; the etcd-backed discovery store and its
# tests need a real etcd binary. Quiet when it is already there.
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then exit 0; fi
bash "$(dirname "$0")/ensure_deb.sh" etcd-server "the etcd tests" etcd
# The package may start a system etcd; tests start their own on free ports.
if command -v etcd >/dev/null 2>&1; then
  (systemctl stop etcd 2>/dev/null || service etcd stop 2>/dev/null || true) >/dev/null 2>&1
fi
