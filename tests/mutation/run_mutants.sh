#!/usr/bin/env bash
# The CPU mutation suite (run_cuda_mutants.sh runs the CUDA one). For the clean CPU engine and
# for every planted bug in tests/mutation/patches/ (the custom path's, and the e4m3
# dequantisation's that both paths read), builds mutant_driver from a scratch copy of the sources
# (the checkout is never patched), runs it over the shape classes and traffic models, and writes
# the detection matrix (markdown + JSON) under bench/results/.
#
#   run_mutants.sh [--quick] [--out DIR] [--only a,b,...] [--set "ARGS"]...
#                  [-- extra mutant_driver arguments]
#
# --quick: the reduced set CTest runs (prefixes 512 and 4096, T 4 and 16, 3 calls per class);
#          fails when the clean build breaches or when a mutant not listed in
#          expected_survivors.txt goes undetected on realistic traffic at some prefix.
# Default: every shape class of the matrix (prefix 512..64K, page 1 and 64, T 4/16/64).
# --set: run these mutant_driver arguments as a set instead of the default sets (repeatable).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
quick=0
out=$root/bench/results
only=""
extra=()
own_sets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --out) out=$2; shift ;;
    --only) only=$2; shift ;;
    --set) own_sets+=("$2"); shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "run_mutants.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

work=$(mktemp -d "${TMPDIR:-/tmp}/verifyd-mutants.XXXXXX")
trap 'rm -rf "$work"' EXIT
trap 'exit 130' INT TERM
tree=$work/tree
mkdir -p "$tree" "$work/obj" "$work/json"
cp -r "$root/src" "$root/kernels" "$tree/"
mkdir -p "$tree/tests/mutation"
cp "$here/mutant_driver.cc" "$tree/tests/mutation/"
cp -r "$tree" "$work/clean"

commit=$("$root/scripts/commit_stamp.sh" "$root" src kernels tests/mutation)

CXX=${CXX:-g++}
flags=(-std=c++20 -O2 -DNDEBUG -Wall -Wextra -I"$tree")
read -r -a deps <<<"$(pkg-config --cflags absl_strings absl_str_format absl_status \
  absl_statusor absl_synchronization tbb fmt)"
read -r -a libs <<<"$(pkg-config --libs absl_strings absl_str_format absl_status \
  absl_statusor absl_synchronization tbb fmt)"

# Every source is compiled once, clean. A planted bug's patch names the sources it changes (the
# custom path, src/cpu_engine/cpu_custom.cc, for most; src/bundle/dequantized_bundle.cc for the
# e4m3 dequantisation), and only those are compiled again for its driver; a patch that changes
# anything else (a header) is refused.
sources=(src/compare/compare.cc src/bundle/bundle.cc src/bundle/dequantized_bundle.cc src/bundle/validate.cc
         src/bundle/random_bundle.cc kernels/verify_problem.cc src/cpu_engine/cpu_oracle.cc
         src/cpu_engine/cpu_reference.cc src/cpu_engine/cpu_custom.cc src/cpu_engine/cpu_engine.cc
         src/engine/engine.cc src/engine/engine_factory.cc
         src/control/drift_test.cc src/probe/probe_suite.cc src/probe/probe_runner.cc
         src/probe/invariance.cc src/probe/repacked_bundle.cc
         tests/mutation/mutant_driver.cc)
obj_of() { echo "$work/obj/$(echo "$1" | tr / _).o"; }
objs=()
for s in "${sources[@]}"; do
  "$CXX" "${flags[@]}" "${deps[@]}" -c "$tree/$s" -o "$(obj_of "$s")" &
  objs+=("$(obj_of "$s")")
done
wait
for o in "${objs[@]}"; do
  [ -f "$o" ] || { echo "run_mutants.sh: the clean build failed (${o##*/})" >&2; exit 1; }
done
# The sources a patch changes ("+++ b/PATH" lines).
changed_by() { sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$1" | sort -u; }

# Each set is one driver run per mutant; calls per class shrink with T * kv_len (--budget) so
# that the 64K classes stay affordable on a small CPU box. Raise --calls/--budget with "--".
# The prefixes 501 and 4091 put the geometry of real prefixes in front of the tiling (64-token
# tiles, splits of 256 tokens and more): a draft block that straddles two tiles (and, at 501 with
# T = 16, a split boundary), and tails of odd length. The e4m3 set runs the same paths on e4m3
# pools at a scale that is not a power of two (README.md, "FP8 KV caches").
e4m3_set="--prefixes 512 --pages 1,64 --drafts 4,16 --calls 2 --kv_dtype e4m3 --kv_scale 0.37"
if [ $quick = 1 ]; then
  sets=("--prefixes 512,4096 --pages 1,64 --drafts 4,16 --calls 3 --budget 1e5 --drift"
        "--prefixes 501,4091 --pages 1,64 --drafts 4,16 --calls 3 --budget 1e5"
        "$e4m3_set")
else
  # The last set feeds the oracle drift test: a stream of calls per traffic model long enough for
  # its verdict (--drift_min_samples 16), which the budgeted sets are not.
  sets=("--prefixes 512 --pages 1,64 --drafts 4,16,64 --calls 3 --budget 5e4"
        "--prefixes 501,4091 --pages 1,64 --drafts 4,16,64 --calls 3 --budget 5e4"
        "--prefixes 4096 --pages 1,64 --drafts 4,16 --calls 3 --budget 5e4"
        "--prefixes 16384,65536 --pages 64 --drafts 4 --calls 1"
        "--prefixes 512,4096,16384 --pages 1,64 --drafts 4 --calls 6 --budget 1e12 --drift"
        "$e4m3_set")
fi
if [ ${#own_sets[@]} -gt 0 ]; then sets=("${own_sets[@]}"); fi
# Every set with --drift also runs the oracle on every call and feeds the oracle drift test (one
# stream per traffic model), and the first set runs the probe suite and the invariance probes
# once per mutant, so that the matrix says which of per-call tolerance, drift, probe or invariance
# caught each bug.
common=(--threads "$(nproc)" --commit "$commit")

mutants=(clean)
for p in "$here"/patches/*.patch; do mutants+=("$(basename "$p" .patch)"); done
if [ -n "$only" ]; then IFS=, read -r -a mutants <<<"clean,$only"; fi

start=$(date +%s)
for m in "${mutants[@]}"; do
  link=("${objs[@]}")
  if [ "$m" != clean ]; then
    p=$here/patches/$m.patch
    mapfile -t changed < <(changed_by "$p")
    patch -s -p1 -d "$tree" <"$p"
    mkdir -p "$work/mut"
    for f in "${changed[@]}"; do
      clean_o=$(obj_of "$f")
      case " ${objs[*]} " in
        *" $clean_o "*) ;;
        *) echo "run_mutants.sh: $m.patch changes $f, which is not a compiled source" >&2
           exit 2 ;;
      esac
      mut_o=$work/mut/${clean_o##*/}
      "$CXX" "${flags[@]}" "${deps[@]}" -c "$tree/$f" -o "$mut_o"
      for k in "${!link[@]}"; do
        if [ "${link[$k]}" = "$clean_o" ]; then link[$k]=$mut_o; fi
      done
      cp "$work/clean/$f" "$tree/$f"
    done
  fi
  "$CXX" -o "$work/driver" "${link[@]}" "${libs[@]}" -lpthread
  i=0
  for set in "${sets[@]}"; do
    read -r -a args <<<"$set"
    [ $i = 0 ] && args+=(--probe_max_prefix 1024 --invariance_max_prefix 1024)
    "$work/driver" --label "$m" --json "$work/json/$m.$i.json" "${args[@]}" "${common[@]}" \
      "${extra[@]}" | tail -n 1
    i=$((i + 1))
  done
done
echo "mutants ran in $(( $(date +%s) - start )) s"

mode=full
[ $quick = 1 ] && mode=quick
check=()
[ $quick = 1 ] && check=(--check "$here/expected_survivors.txt")
python3 "$here/detection_matrix.py" --mode "$mode" --out "$out" \
  --name "$(date -u +%F)-$commit-cpu-mutation" "${check[@]}" "$work"/json/*.json
