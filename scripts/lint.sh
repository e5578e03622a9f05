#!/usr/bin/env bash
# buf lint and buf breaking on the contracts, ruff (lint and format), mypy (config in pyproject.toml).
#
# buf breaking compares the contracts with BUF_AGAINST, a git ref. Unset, it is the merge-base with
# `main` when HEAD is on a branch off main (all of the branch's changes), else HEAD~1 (on main
# itself, as in CI's fresh full clone: the latest commit). It is skipped, saying so, when that
# commit is not in the clone (a shallow clone) or has no contracts yet.
set -euo pipefail
cd "$(dirname "$0")/.."

buf lint

against=${BUF_AGAINST:-}
if [ -z "$against" ]; then
  base=$(git merge-base HEAD main 2>/dev/null || true)
  if [ -n "$base" ] && [ "$base" != "$(git rev-parse HEAD)" ]; then
    against=$base
  else
    against=HEAD~1
  fi
fi
if git rev-parse --verify -q "$against^{commit}" >/dev/null && git cat-file -e "$against:buf.yaml" 2>/dev/null; then
  echo "buf breaking against $against ($(git rev-parse --short "$against"))"
  buf breaking --against ".git#ref=$(git rev-parse "$against")"
else
  echo "buf breaking: $against is not in this clone or has no contracts; skipped"
fi

ruff check .
ruff format --check .
mypy
