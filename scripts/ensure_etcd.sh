#!/usr/bin/env bash
# Installs etcd (Debian's etcd-server) when it is missing; the etcd-backed discovery store and its
# tests need a real etcd binary. Quiet when it is already there.
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "etcd is not installed and cannot be installed here (need root and apt-get); etcd tests will be skipped" >&2
  exit 0
fi
echo "installing etcd-server from Debian (for the etcd-backed discovery store)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq etcd-server >/dev/null
# The package may start a system etcd; tests start their own on free ports.
(systemctl stop etcd 2>/dev/null || service etcd stop 2>/dev/null || true) >/dev/null 2>&1
command -v etcd >/dev/null
