#!/usr/bin/env bash
# The shipped binaries as an operator uses them: start verifyd, drive it with verifyctl, kill it
# hard, start it again: the mode and the audit log are as they were; exit codes and --json hold.
set -euo pipefail
verifyd=$1 verifyctl=$2
dir=$(mktemp -d)
trap 'kill -9 $pid 2>/dev/null || true; rm -rf "$dir"' EXIT

start() {
  rm -f "$dir/data.sock" "$dir/admin.sock"  # left behind by kill -9
  "$verifyd" --listen="unix:$dir/data.sock" --admin_listen="unix:$dir/admin.sock" \
    --metrics_address=127.0.0.1:0 --state_dir="$dir/state" --engine=cpu --gate_window=2 \
    >>"$dir/log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do [ -S "$dir/admin.sock" ] && [ -S "$dir/data.sock" ] && return; sleep 0.05; done
  cat "$dir/log"; echo "verifyd did not start"; exit 1
}
ctl() { "$verifyctl" --target="unix:$dir/data.sock" --admin="unix:$dir/admin.sock" "$@"; }
fail() { echo "FAIL: $*"; cat "$dir/log"; exit 1; }

if "$verifyd" --engine=cpu --state_dir="$dir/bad" --atol_rel=-1 >"$dir/bad.log" 2>&1; then
  fail "a negative --atol_rel started"
fi
grep -q "atol_rel" "$dir/bad.log" || fail "no field named for a bad --atol_rel: $(cat "$dir/bad.log")"
start
ctl send --shape 2,3,8,54 --page_size 16 --count 4 --json >"$dir/send.json" || fail "send"
grep -q '"ok": 4' "$dir/send.json" || fail "send did not get 4 answers: $(cat "$dir/send.json")"
ctl send --shape 1,4,2,40 --page_size 16 --count 2 --traffic realistic --json \
  >"$dir/send_real.json" || fail "send --traffic realistic"
grep -q '"traffic": "realistic"' "$dir/send_real.json" || fail "traffic model not reported"
if ctl send --count 1 --traffic bogus >/dev/null 2>"$dir/err"; then fail "--traffic bogus passed"; fi
grep -q -- "--traffic" "$dir/err" || fail "no field named for a bad --traffic: $(cat "$dir/err")"
if ctl flip canary --reason x >/dev/null 2>"$dir/err"; then fail "canary without --fraction passed"; fi
grep -q "fraction" "$dir/err" || fail "no reason given for the missing fraction"
if ctl flip custom >/dev/null 2>&1; then fail "flip without --reason passed"; fi
ctl flip canary --fraction 0.25 --reason "ci canary" --force --json | grep -q '"mode": "canary"' \
  || fail "flip canary"
ctl status --json >"$dir/status.json" || fail "status"
grep -q '"mode": "canary"' "$dir/status.json" || fail "status after flip"

kill -9 "$pid"; wait "$pid" 2>/dev/null || true
start
ctl status --json >"$dir/status2.json" || fail "status after restart"
grep -q '"mode": "canary"' "$dir/status2.json" || fail "mode lost across a hard restart"
grep -q '"reason": "ci canary"' "$dir/status2.json" || fail "audit lost across a hard restart"
ctl rollback --reason "ci done" | grep -q "mode is now shadow" || fail "rollback"
ctl status | grep -q "^mode        shadow" || fail "human status"

# A dead daemon: non-zero exit with a one-line reason.
kill -9 "$pid"; wait "$pid" 2>/dev/null || true
if ctl status 2>"$dir/err"; then fail "status against a dead daemon exited 0"; fi
[ "$(wc -l <"$dir/err")" -eq 1 ] || fail "expected one line, got: $(cat "$dir/err")"
echo "PASS"
