#!/usr/bin/env bash
# Rewrites each planted bug (patches/, cuda_patches/) as a clean diff against today's sources:
# after an edit to src/ or kernels/ moves a patch's lines, `patch` still applies it with an offset
# or fuzz, and this records the result with exact line numbers and context, so that
# patches_apply.sh and the mutant builds stay exact. Each patch keeps its description (the text
# before its first "--- a/"). A patch that no longer applies is left as it is and named; the
# script then fails: that bug has to be planted again by hand.
#
#   tests/mutation/refresh_patches.sh [PATCH ...]     (default: every patch)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/verifyd-refresh.XXXXXX")
trap 'rm -rf "$work"' EXIT
if [ $# -gt 0 ]; then patches=("$@"); else patches=("$here"/patches/*.patch "$here"/cuda_patches/*.patch); fi
failed=0 changed=0
for p in "${patches[@]}"; do
  rm -rf "$work/tree" && mkdir -p "$work/tree"
  cp -r "$root/src" "$root/kernels" "$work/tree/"
  if ! out=$(patch -s -p1 --no-backup-if-mismatch -d "$work/tree" <"$p" 2>&1); then
    echo "FAIL: ${p#"$root"/} does not apply: $out"
    failed=1
    continue
  fi
  {
    sed -n '1,/^--- a\//p' "$p" | sed '$d'
    grep '^+++ b/' "$p" | sed 's|^+++ b/||; s|[[:space:]].*$||' | while read -r f; do
      diff -u --label "a/$f" --label "b/$f" "$root/$f" "$work/tree/$f"
    done
  } >"$work/new.patch"
  if ! cmp -s "$work/new.patch" "$p"; then
    cp "$work/new.patch" "$p"
    changed=$((changed + 1))
    echo "refreshed: ${p#"$root"/}"
  fi
done
echo "refresh_patches: ${#patches[@]} patches, $changed rewritten"
exit "$failed"
