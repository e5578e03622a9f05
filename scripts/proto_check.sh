#!/usr/bin/env bash
# Fails when the committed generated code differs from what the pinned grpcio-tools makes now.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bash "$here/scripts/gen_proto.sh" "$tmp" 2>/dev/null
stale=0
while IFS= read -r f; do
  rel=${f#"$tmp"/}
  if ! cmp -s "$f" "$here/$rel"; then
    echo "stale or missing generated file: $rel (run 'make proto')" >&2
    stale=1
  fi
done < <(find "$tmp" -type f \( -name '*_pb2*.py' -o -name '*_pb2*.pyi' \) | sort)
# Generated files whose proto is gone.
while IFS= read -r f; do
  rel=${f#"$here"/}
  [ -f "$tmp/$rel" ] || { echo "generated file without a proto: $rel" >&2; stale=1; }
done < <(find "$here"/globaldiscovery "$here"/poolrelay "$here"/globalrouter "$here"/mocker \
           -path '*/v1/*' -type f \( -name '*_pb2*.py' -o -name '*_pb2*.pyi' \) | sort)
if [ "$stale" -ne 0 ]; then exit 1; fi
echo "generated code is up to date"
