#!/usr/bin/env bash
# buf lint, buf breaking against the previous commit of main (when it has contracts), and ruff.
set -euo pipefail
cd "$(dirname "$0")/.."
buf lint
if git rev-parse --verify -q HEAD~1 >/dev/null && git cat-file -e HEAD~1:buf.yaml 2>/dev/null; then
  buf breaking --against '.git#ref=HEAD~1'
else
  echo "buf breaking: no previous commit with contracts; skipped"
fi
ruff check .
