#!/usr/bin/env bash
# Every planted bug still applies to today's sources: the CPU patches (patches/) and the CUDA
# kernel ones (cuda_patches/), each dry-run against a scratch copy of src/ and kernels/. A patch
# that no longer applies would drop its mutant from the suite at build time, on the GPU machine.
# (refresh_patches.sh rewrites patches that apply only with an offset or fuzz.)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/verifyd-patches.XXXXXX")
trap 'rm -rf "$work"' EXIT
cp -r "$root/src" "$root/kernels" "$work/"
failed=0 n=0
for p in "$here"/patches/*.patch "$here"/cuda_patches/*.patch; do
  n=$((n + 1))
  if ! out=$(patch --dry-run -s -p1 -d "$work" <"$p" 2>&1); then
    echo "FAIL: ${p#"$root"/} does not apply: $out"
    failed=1
  fi
done
[ "$failed" = 0 ] && echo "ok: all $n planted bugs apply"
exit "$failed"
