#!/usr/bin/env bash
# Builds mutant_driver against the CUDA engine once clean and once per planted kernel bug in
# tests/mutation/cuda_patches/, for the GPU machine to run (run_cuda_mutants.sh).
#
#   build_cuda_mutants.sh BUILD_DIR OUT_DIR [--only a,b,...]
#
# BUILD_DIR is a configured CUDA build of this checkout. mutant_driver is built there once; for
# each mutant the patched kernel sources (a scratch copy: the checkout is never patched) are
# compiled for sm_90a with that build's nvcc flags, put into a copy of the custom-kernel library
# (and, for a patch of a kernels/reference/*.cu file, that file into a copy of the reference
# library), and linked with that build's link line. Writes OUT_DIR/mutant_driver.<name> (debug info
# stripped) and OUT_DIR/commit.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
[ $# -ge 2 ] || { echo "usage: build_cuda_mutants.sh BUILD_DIR OUT_DIR [--only a,b]" >&2; exit 2; }
build=$(cd "$1" && pwd)
out=$2
only=""
[ "${3:-}" = --only ] && only=${4:?--only needs a list}
mkdir -p "$out"
out=$(cd "$out" && pwd)

cmake --build "$build" --target mutant_driver -j "$(nproc)"
kdir=$build/kernels/custom
lib=$kdir/libverifyd_custom_kernels.a
ref_lib=$build/kernels/reference/libverifyd_reference_kernels.a
flags_make=$kdir/CMakeFiles/verifyd_custom_objects.dir/flags.make  # where custom_attention.cu is compiled
link_txt=$build/tests/mutation/CMakeFiles/mutant_driver.dir/link.txt
for f in "$lib" "$ref_lib" "$flags_make" "$link_txt"; do
  [ -f "$f" ] || { echo "build_cuda_mutants.sh: $f is missing: not a CUDA build?" >&2; exit 1; }
done
nvcc=$(sed -n 's/^# compile CUDA with //p' "$flags_make")
# The build's CUDA flags with only the sm_90a target: the mutants run on Hopper.
read -r -a cuda_flags <<<"$(sed -n 's/^CUDA_FLAGS = //p' "$flags_make")"
flags=()
for f in "${cuda_flags[@]}"; do
  case "$f" in -gencode=*) [[ "$f" == *sm_90a* ]] && flags+=("$f") ;; *) flags+=("$f") ;; esac
done
read -r -a link <<<"$(cat "$link_txt")"

work=$(mktemp -d "${TMPDIR:-/tmp}/verifyd-cuda-mutants.XXXXXX")
trap 'rm -rf "$work"' EXIT
cp -r "$root/kernels" "$work/kernels.clean"

commit=$("$root/scripts/commit_stamp.sh" "$root" src kernels tests/mutation)
echo "$commit" >"$out/commit"

mutants=(clean)
for p in "$here"/cuda_patches/*.patch; do mutants+=("$(basename "$p" .patch)"); done
[ -n "$only" ] && IFS=, read -r -a mutants <<<"clean,$only"

for m in "${mutants[@]}"; do
  start=$(date +%s)
  rm -rf "$work/tree" && mkdir -p "$work/tree" && cp -r "$work/kernels.clean" "$work/tree/kernels"
  if [ "$m" != clean ]; then
    patch -s -p1 -d "$work/tree" <"$here/cuda_patches/$m.patch"
  fi
  # The scratch tree comes first on the include path, so its (patched) headers win. A patch of
  # kernels/reference/*.cu files alone leaves the custom kernel as built.
  cp "$lib" "$work/lib.a"
  if [ "$m" = clean ] || grep -q '^+++ b/kernels/\(custom/\|[a-z0-9_]*\.h\)' "$here/cuda_patches/$m.patch"; then
    "$nvcc" "${flags[@]}" -I"$work/tree" -I"$root" -isystem="$(dirname "$nvcc")/../include" \
      -c "$work/tree/kernels/custom/custom_attention.cu" -o "$work/custom_attention.cu.o"
    ar r "$work/lib.a" "$work/custom_attention.cu.o" 2>/dev/null
  fi
  # A patched reference kernel replaces its member (same name) in a copy of that library.
  cp "$ref_lib" "$work/ref_lib.a"
  if [ "$m" != clean ]; then
    for f in $(sed -n 's|^+++ b/\(kernels/reference/[a-z0-9_]*\.cu\)\([[:space:]].*\)\{0,1\}$|\1|p' \
                 "$here/cuda_patches/$m.patch"); do
      "$nvcc" "${flags[@]}" -I"$work/tree" -I"$root" -isystem="$(dirname "$nvcc")/../include" \
        -c "$work/tree/$f" -o "$work/$(basename "$f").o"
      ar r "$work/ref_lib.a" "$work/$(basename "$f").o" 2>/dev/null
    done
  fi
  cmd=()
  for w in "${link[@]}"; do
    case "$w" in
      ../../kernels/custom/libverifyd_custom_kernels.a) cmd+=("$work/lib.a") ;;
      ../../kernels/reference/libverifyd_reference_kernels.a) cmd+=("$work/ref_lib.a") ;;
      mutant_driver) cmd+=("$out/mutant_driver.$m") ;;
      *) cmd+=("$w") ;;
    esac
  done
  (cd "$build/tests/mutation" && "${cmd[@]}")
  objcopy --strip-debug "$out/mutant_driver.$m"
  echo "mutant_driver.$m: built in $(( $(date +%s) - start )) s"
done
