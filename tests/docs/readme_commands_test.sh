#!/usr/bin/env bash
# The README's Quick start and Transports commands, run in order as a newcomer runs them: start
# scripts/run.sh, then every line of the README's blocks marked "quickstart" and "transports",
# from a checkout-like directory whose build/ is this build and whose run/ is a temp dir.
# Fails on the first line that fails, printing it and verifyd's log.
#   readme_commands_test.sh REPO BUILD_DIR
set -euo pipefail
root=$1 build=$2
work=$(mktemp -d /tmp/verifyd-readme.XXXXXX)
pid=
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill "$pid"; wait "$pid" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; echo "--- verifyd's log"; tail -40 "$work/verifyd.log"; exit 1; }

# The lines of the ```sh block that follows the marker <!-- NAME: ... -->.
block() {
  awk -v name="$1" '
    index($0, "<!-- " name ":") == 1 { marked = 1; next }
    marked && /^```sh/ { inside = 1; next }
    inside && /^```/ { exit }
    inside { print }
  ' "$root/README.md"
}

mkdir -p "$work/checkout/run"
ln -s "$build" "$work/checkout/build"
BUILD_DIR=$build RUN_DIR=$work/checkout/run "$root/scripts/run.sh" >"$work/verifyd.log" 2>&1 &
pid=$!
for _ in $(seq 1200); do
  [ -S "$work/checkout/run/admin.sock" ] && [ -S "$work/checkout/run/verifyd.sock" ] && break
  kill -0 "$pid" 2>/dev/null || fail "scripts/run.sh exited"
  sleep 0.1
done
[ -S "$work/checkout/run/admin.sock" ] || fail "scripts/run.sh did not start verifyd"

for name in quickstart transports; do
  lines=$(block "$name")
  [ -n "$lines" ] || fail "README.md has no block marked $name"
  cd "$work/checkout"
  while IFS= read -r line; do
    [ -n "$line" ] || continue
    echo "\$ $line"
    # Each line runs in this shell, so that an export carries to the next ones.
    eval "$line" >"$work/out" 2>&1 || { cat "$work/out"; fail "README line: $line"; }
    tail -3 "$work/out"
  done <<<"$lines"
done
echo "PASS: the README's quickstart and transports lines ran in order"
