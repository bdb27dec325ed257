#!/usr/bin/env bash
# Fails when a C++ or CUDA source of the tree differs from what clang-format (.clang-format, Debian's
# clang-format) makes of it; prints the files. FIX=1 formats them in place instead.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cf=${CLANG_FORMAT:-$(command -v clang-format || command -v clang-format-14 || true)}
[ -n "$cf" ] || { echo "check_format.sh: clang-format not found (apt-get install clang-format)" >&2; exit 1; }
cd "$root"
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if [ "${FIX:-0}" = 1 ]; then
  "$cf" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$cf" "$f" | cmp -s - "$f" || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  printf 'not clang-formatted (FIX=1 scripts/check_format.sh formats them):\n' >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "clang-format: ${#files[@]} files clean"
