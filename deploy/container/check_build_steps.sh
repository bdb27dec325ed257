#!/usr/bin/env bash
# Runs the build stage of deploy/container/Dockerfile outside a container: every RUN step of the
# stage `FROM debian:12 AS build`, read from the Dockerfile itself (continuation lines joined),
# in the repository (the stage's WORKDIR /src), with /build and /stage moved into a temp dir.
# Then checks that the staged /usr/bin/verifyd and verifyctl run, and that the runtime stage's
# packages provide every shared library they load (tests/packaging/check_container_recipe.py).
#   deploy/container/check_build_steps.sh [WORK_DIR]
# Needs the host to be Debian 12 (the image's base); scripts/install_deps.sh, the first step,
# installs what is missing with apt (as root or through sudo). Set CMAKE_CXX_COMPILER_LAUNCHER
# =ccache to reuse a compiler cache. WORK_DIR (default: a temp dir, removed) keeps the build.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
dockerfile=$here/Dockerfile
work=${1:-}
if [ -z "$work" ]; then
  work=$(mktemp -d /tmp/verifyd-container-steps.XXXXXX)
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work"

if ! grep -q '^ID=debian' /etc/os-release || ! grep -q '^VERSION_ID="12"' /etc/os-release; then
  echo "SKIP: the host is not Debian 12, the image's base"
  exit 77
fi

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
python3 "$root/tests/packaging/check_container_recipe.py" --root "$root" \
  --binary "$work/stage/usr/bin/verifyd" --binary "$work/stage/usr/bin/verifyctl"
echo "the Dockerfile's $n build steps ran; the staged binaries run with the runtime packages"
