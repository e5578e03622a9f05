#!/usr/bin/env bash
# Generates Python code for every contract under proto/ into OUT_DIR (default: the repo root),
# at the path of its proto package (proto/globaldiscovery/v1/x.proto -> globaldiscovery/v1/x_pb2.py).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here}
py=${PYTHON:-$here/.venv/bin/python}
bindir=$(dirname "$py")
cd "$here"
# proto/google/ is vendored: its Python comes from googleapis-common-protos, so it is not generated.
mapfile -t protos < <(find proto -path proto/google -prune -o -name '*.proto' -print | sort)
PATH="$bindir:$PATH" "$py" -m grpc_tools.protoc -Iproto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" --mypy_grpc_out="$out" \
  "${protos[@]}"
# Each generated directory is a Python package.
for f in "${protos[@]}"; do
  d=$(dirname "${f#proto/}")
  while [ "$d" != "." ]; do
    [ -f "$out/$d/__init__.py" ] || : > "$out/$d/__init__.py"
    d=$(dirname "$d")
  done
done
