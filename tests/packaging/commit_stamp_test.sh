#!/usr/bin/env bash
# The commit a build stamps into its binaries is written when it builds, not when CMake
# configured it: scripts/commit_stamp.cmake names HEAD (with -dirty for changed tracked files, or
# unknown outside git) and rewrites its header only when that changes; and this build's header,
# after `cmake --build BUILD --target verifyd_commit_stamp`, says what scripts/commit_stamp.sh
# says of the checkout now.
#   commit_stamp_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
script=$src/scripts/commit_stamp.cmake
fail() { echo "FAIL: $*" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

stamp() { sed -n 's/^#define VERIFYD_GIT_COMMIT "\(.*\)"$/\1/p' "$work/h/verifyd_commit.h"; }
run() { cmake -DSRC="$work/repo" -DOUT="$work/h/verifyd_commit.h" -P "$script"; }

mkdir -p "$work/repo" "$work/h"
run
[[ $(stamp) == unknown ]] || fail "outside git: '$(stamp)', not unknown"
git -C "$work/repo" init -q
git -C "$work/repo" -c user.name=t -c user.email=t@t commit -q --allow-empty -m one
echo a >"$work/repo/f"
git -C "$work/repo" add f
git -C "$work/repo" -c user.name=t -c user.email=t@t commit -q -m two
head=$(git -C "$work/repo" rev-parse --short=12 HEAD)
run
[[ $(stamp) == "$head" ]] || fail "clean checkout: '$(stamp)', not $head"
before=$(stat -c %y "$work/h/verifyd_commit.h")
sleep 1.1
run
[[ $(stat -c %y "$work/h/verifyd_commit.h") == "$before" ]] || fail "rewritten with the same stamp"
echo b >"$work/repo/f"
run
[[ $(stamp) == "$head-dirty" ]] || fail "changed file: '$(stamp)', not $head-dirty"
git -C "$work/repo" -c user.name=t -c user.email=t@t commit -qam three
run
now=$(git -C "$work/repo" rev-parse --short=12 HEAD)
[[ $now != "$head" && $(stamp) == "$now" ]] || fail "new commit: '$(stamp)', not $now"

# This build's own header, brought up to date as every build does.
cmake --build "$build" --target verifyd_commit_stamp >/dev/null
got=$(sed -n 's/^#define VERIFYD_GIT_COMMIT "\(.*\)"$/\1/p' "$build/generated/verifyd_commit.h")
want=$("$src/scripts/commit_stamp.sh" "$src")
[[ $got == "$want" ]] || fail "the build's stamp is '$got'; the checkout is $want"
echo "ok: stamps follow the checkout ($got)"
