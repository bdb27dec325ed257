#!/usr/bin/env bash
# Prints the commit that results are tagged with: HEAD's short hash (12 digits), with "-dirty" when
# tracked files under the given paths differ from it, or "unknown" outside a git checkout.
#   scripts/commit_stamp.sh ROOT [PATH...]   (PATHs relative to ROOT; default: the whole tree)
set -euo pipefail
root=${1:?usage: commit_stamp.sh ROOT [PATH...]}
shift
commit=$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null) || { echo unknown; exit 0; }
if ! git -C "$root" diff --quiet HEAD -- "$@"; then
  commit=$commit-dirty
fi
echo "$commit"
