#!/usr/bin/env bash
# Lays out FlashMLA's sources, with its CUTLASS submodule's headers, in a git-ignored folder for
# build.py to compile on the GPU machine. It fetches nothing: it reads two git directories that
# are already here (snapshots of github.com/deepseek-ai/FlashMLA and github.com/NVIDIA/cutlass).
# FlashMLA is a benchmark peer only; nothing of it is committed or linked into verifyd.
#
#   bench/flashmla_peer/prepare.sh FLASHMLA_GIT_DIR CUTLASS_GIT_DIR [DEST]   (DEST: .gpu/flashmla)
#
# The CUTLASS commit is the one FlashMLA's tree names for csrc/cutlass.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FLASHMLA=${1:?FlashMLA git dir} CUTLASS=${2:?CUTLASS git dir}
DEST=${3:-$ROOT/.gpu/flashmla}
rm -rf "$DEST"
mkdir -p "$DEST/src"
commit=$(git --git-dir="$FLASHMLA" rev-parse HEAD)
git --git-dir="$FLASHMLA" archive HEAD csrc | tar -x -C "$DEST/src"
cutlass=$(git --git-dir="$FLASHMLA" ls-tree HEAD csrc/cutlass | awk '{print $3}')
[[ -n $cutlass ]] || { echo "prepare: FlashMLA's tree names no csrc/cutlass commit" >&2; exit 1; }
mkdir -p "$DEST/src/csrc/cutlass"
# The snapshot lacks some of CUTLASS's images; git names one and goes on, and the headers come.
git --git-dir="$CUTLASS" archive "$cutlass" include tools/util/include 2> /dev/null |
  tar -x -C "$DEST/src/csrc/cutlass"
for f in include/cutlass/cutlass.h include/cute/tensor.hpp tools/util/include/cutlass/util/device_memory.h; do
  [[ -f $DEST/src/csrc/cutlass/$f ]] || { echo "prepare: CUTLASS's $f is missing" >&2; exit 1; }
done
cp "$ROOT"/bench/flashmla_peer/{build.py,flashmla_dense_decode.cpp,flashmla_peer.py} "$DEST/"
printf 'flashmla %s\ncutlass %s\n' "$commit" "$cutlass" > "$DEST/SOURCES"
echo "prepare: $DEST ($(du -sh "$DEST" | cut -f1)): FlashMLA ${commit:0:7}, CUTLASS ${cutlass:0:7}"
