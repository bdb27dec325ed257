#!/usr/bin/env bash
# Runs the build stage of a container recipe outside a container: every RUN step of the stage
# `FROM ... AS build`, read from the recipe itself (continuation lines joined), in the
# repository (the stage's WORKDIR /src), with /build and /stage moved into a work dir. Then
# checks that the staged /usr/bin/verifyd and verifyctl run, and that the runtime stage's
# packages provide every shared library they load (tests/packaging/check_container_recipe.py).
#   deploy/container/check_build_steps.sh [--dockerfile FILE] [WORK_DIR]
# FILE: deploy/container/Dockerfile (default; the CPU image, on debian:12) or Dockerfile.cuda
# (the CUDA image, on NVIDIA's Ubuntu 24.04 CUDA images).
# The host must be Debian 12. For the CPU recipe that is the image's base. For the CUDA recipe
# it is not (Ubuntu 24.04 apt steps cannot run here), so the rehearsal relies on what the
# recipe is built to allow: its one dependency step, scripts/install_deps.sh, installs the
# same package names from either distribution, and nvcc is where NVIDIA's devel image has it,
# /usr/local/cuda (skipped, exit 77, without it). Every step runs as written otherwise; the
# runtime stage's Ubuntu package names are checked against a table in the recipe check.
# scripts/install_deps.sh installs what is missing with apt (as root or through sudo). Set
# CMAKE_CXX_COMPILER_LAUNCHER=ccache (and CMAKE_CUDA_COMPILER_LAUNCHER) to reuse a compiler
# cache. WORK_DIR (default: a temp dir, removed) keeps the build for the next run.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
dockerfile=$here/Dockerfile
if [ "${1:-}" = "--dockerfile" ]; then
  dockerfile=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
  shift 2
fi
work=${1:-}

if ! grep -q '^ID=debian' /etc/os-release || ! grep -q '^VERSION_ID="12"' /etc/os-release; then
  echo "SKIP: the host is not Debian 12"
  exit 77
fi
base=$(awk '/^FROM[ \t].*[ \t]AS[ \t]+build[ \t]*$/ { print $2; exit }' "$dockerfile")
case "$base" in
  debian:12) ;;
  nvidia/cuda:*-devel-ubuntu24.04)
    if [ ! -x /usr/local/cuda/bin/nvcc ]; then
      echo "SKIP: $base builds with /usr/local/cuda/bin/nvcc, which this host does not have"
      exit 77
    fi
    want=$(sed -E 's#^nvidia/cuda:([0-9]+\.[0-9]+)\..*#\1#' <<< "$base")
    have=$(/usr/local/cuda/bin/nvcc --version | sed -nE 's/.*release ([0-9]+\.[0-9]+).*/\1/p')
    if [ "$want" != "$have" ]; then
      echo "FAIL: $base has CUDA $want, this host's nvcc is $have: the rehearsal would not be one"
      exit 1
    fi
    echo "build stage on $base: its steps run on this Debian 12 host with nvcc $have"
    ;;
  *)
    echo "FAIL: $dockerfile: no build stage this script knows how to rehearse (FROM $base AS build)"
    exit 1
    ;;
esac

if [ -z "$work" ]; then
  work=$(mktemp -d /tmp/verifyd-container-steps.XXXXXX)
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work"

# The build stage's RUN commands, one per line.
steps=$(awk '
  /^FROM[ \t]/ { in_build = ($0 ~ /[ \t]AS[ \t]+build[ \t]*$/); next }
  !in_build || /^[ \t]*#/ { next }
  cont { cmd = cmd " " $0 }
  !cont && /^RUN[ \t]/ { cmd = substr($0, 5) }
  !cont && !/^RUN[ \t]/ { next }
  { if (cmd ~ /\\[ \t]*$/) { sub(/\\[ \t]*$/, "", cmd); cont = 1 } else { cont = 0; print cmd } }
  ' "$dockerfile")
if [ -z "$steps" ]; then
  echo "FAIL: no RUN steps in the build stage of $dockerfile"
  exit 1
fi
n=0
while IFS= read -r step; do
  n=$((n + 1))
  # The container's paths: /src is the repository, /build and /stage go under the work dir.
  mapped=$(printf '%s' "$step" | sed -E \
    -e "s#(^|[ =])/src(/|\\b)#\\1$root\\2#g" \
    -e "s#(^|[ =])/build(/|\\b)#\\1$work/build\\2#g" \
    -e "s#(^|[ =])/stage(/|\\b)#\\1$work/stage\\2#g")
  echo "== step $n: $step"
  [ "$mapped" = "$step" ] || echo "   as: $mapped"
  (cd "$root" && DEBIAN_FRONTEND=noninteractive bash -euo pipefail -c "$mapped")
done <<< "$steps"

# (--helpfull exits 1 after printing the flags: look at what it prints.)
help=$("$work/stage/usr/bin/verifyd" --helpfull 2>&1 || true)
grep -q -- "--listen" <<< "$help" || { echo "FAIL: the staged verifyd does not run: $help"; exit 1; }
help=$("$work/stage/usr/bin/verifyctl" --help 2>&1 || true)
grep -q -- "--admin" <<< "$help" || { echo "FAIL: the staged verifyctl does not run: $help"; exit 1; }
binaries=()
for b in "$work"/stage/usr/bin/*; do binaries+=(--binary "$b"); done
python3 "$root/tests/packaging/check_container_recipe.py" --root "$root" \
  --dockerfile "$dockerfile" "${binaries[@]}"
echo "the $(basename "$dockerfile") build stage's $n steps ran; the staged binaries run with" \
  "the runtime packages"
