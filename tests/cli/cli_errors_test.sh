#!/usr/bin/env bash
# What an operator's mistakes get from verifyctl, and a prompt stop:
#   - a misspelt command is named, with the nearest command and the list;
#   - the data and admin sockets swapped: which service the socket does not serve;
#   - a socket path without unix:, the default admin socket missing, --transport cuda_ipc on a
#     host without a GPU: each says what to do instead;
#   - status's next step after a failed probe asks for a passing verifyctl probe;
#   - sample custom 0 in shadow mode says the mode it applies to;
#   - SIGTERM with a full queue of comparisons stops within seconds, the queue dropped.
#   cli_errors_test.sh VERIFYD VERIFYCTL
set -euo pipefail
verifyd=$(realpath "$1") verifyctl=$(realpath "$2")
dir=$(mktemp -d)
pid=
trap '[ -z "$pid" ] || kill -9 "$pid" 2>/dev/null || true; rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; cat "$dir/log" 2>/dev/null; exit 1; }
start() {  # extra verifyd flags
  rm -f "$dir/data.sock" "$dir/admin.sock"
  "$verifyd" --listen="unix:$dir/data.sock" --admin_listen="unix:$dir/admin.sock" \
    --metrics_address= --state_dir="$dir/state" --engine=cpu --gate_window=2 \
    --probe_max_prefix=256 "$@" >"$dir/log" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do [ -S "$dir/admin.sock" ] && [ -S "$dir/data.sock" ] && return; sleep 0.1; done
  fail "verifyd did not start"
}
ctl() { "$verifyctl" --target="unix:$dir/data.sock" --admin="unix:$dir/admin.sock" "$@"; }
# expect_err EXIT-CODE PATTERN COMMAND...: the command exits EXIT-CODE and its stderr matches.
expect_err() {
  local want=$1 pattern=$2 rc=0
  shift 2
  "$@" >"$dir/out" 2>"$dir/err" || rc=$?
  [ "$rc" -eq "$want" ] || fail "$*: exit $rc, not $want: $(cat "$dir/out" "$dir/err")"
  grep -qE -- "$pattern" "$dir/err" || fail "$*: expected /$pattern/, got: $(cat "$dir/err")"
}

# Commands.
expect_err 2 "^verifyctl: unknown command 'stauts' \(did you mean 'status'\?\); commands: status, flip, rollback, send, sample, capture, probe, replay" \
  "$verifyctl" stauts
expect_err 2 "unknown command 'rolback' \(did you mean 'rollback'\?\)" "$verifyctl" --admin=unix:/x rolback
expect_err 2 "^verifyctl: unknown command 'xyzzy'; commands: status" "$verifyctl" xyzzy

# Addresses, before any daemon runs.
expect_err 1 "^verifyctl: status: UNAVAILABLE: .*\(no socket at /run/verifyd/admin.sock, the default: is verifyd running\? Give its admin socket with --admin or VERIFYD_ADMIN\)" \
  env -u VERIFYD_ADMIN "$verifyctl" status
expect_err 1 "^verifyctl: send: --target: '$dir/data.sock' is a path; a Unix socket is written unix:$dir/data.sock" \
  "$verifyctl" --target="$dir/data.sock" send --count 1
expect_err 1 "^verifyctl: status: --admin: '/run/x/admin.sock' is a path; a Unix socket is written unix:/run/x/admin.sock" \
  "$verifyctl" --admin=/run/x/admin.sock status
grep -q "unix:/run/verifyd/verifyd.sock" <("$verifyctl" --help) || fail "default data address"
grep -q -- "--listen=unix:/run/verifyd/verifyd.sock" <("$verifyd" --help) \
  || fail "verifyd's default data address: $("$verifyd" --help | grep -A1 -- --listen)"

start
# The sockets swapped: each says which service it does not serve, and where the right one is.
expect_err 1 "^verifyctl: status: UNIMPLEMENTED: unix:$dir/data.sock does not serve the admin API: is it verifyd's data socket\? Give the admin API's address with --admin or VERIFYD_ADMIN$" \
  "$verifyctl" --admin="unix:$dir/data.sock" status
"$verifyctl" --target="unix:$dir/admin.sock" send --shape 1,2,2,16 --page_size 16 --count 1 \
  >"$dir/out" 2>&1 || true
grep -q "^first error: UNIMPLEMENTED: unix:$dir/admin.sock does not serve the data plane: is it verifyd's admin socket? Give the data plane's address with --target or VERIFYD_TARGET" \
  "$dir/out" || fail "send to the admin socket: $(cat "$dir/out")"

# cuda_ipc without a GPU says so (a verifyctl built without CUDA says that instead).
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  expect_err 1 "send: --transport cuda_ipc: (no usable GPU on this host|this verifyctl was built without CUDA)" \
    ctl send --shape 1,2,2,16 --page_size 16 --count 1 --transport cuda_ipc
fi

# sample custom 0 in shadow: refused for what it would do once custom is served.
expect_err 1 "FAILED_PRECONDITION: rate: the mode is shadow, so nothing changes now, but custom mode keeps this rate: .*--force" \
  ctl sample custom 0 --reason "off"
if grep -q "while custom is served" "$dir/err"; then fail "shadow mode said custom is served"; fi
kill -9 "$pid"; wait "$pid" 2>/dev/null || true; pid=

# A failed probe: the next step asks for a passing verifyctl probe.
start --inject_custom_fault=perturb:0.05
ctl status >"$dir/s.txt" || fail "status"
grep -q "^gate        NOT ready: .*the probe suite failed" "$dir/s.txt" || fail "gate: $(cat "$dir/s.txt")"
grep -q "^next        the gate needs 2 more clean comparisons in a row (traffic, or verifyctl send); and a passing probe run: fix the custom path, then verifyctl probe" \
  "$dir/s.txt" || fail "next after a failed probe: $(grep ^next "$dir/s.txt")"
kill -9 "$pid"; wait "$pid" 2>/dev/null || true; pid=

# SIGTERM after custom-mode traffic that left the comparisons queued (one shadow thread, each
# comparison with the fp64 oracle): verifyd drops the queue and stops within seconds.
rm -rf "$dir/state"
start --oracle_sample_rate=1 --shadow_threads=1
ctl flip custom --force --reason "ci: shutdown" >/dev/null || fail "flip custom"
ctl sample custom 1 --reason "ci: compare every call" >/dev/null || fail "sample custom 1"
ctl send --shape 2,16,8,512 --count 60 --concurrency 2 >"$dir/out" || fail "send: $(cat "$dir/out")"
t0=$(date +%s%N)
kill -TERM "$pid"
wait "$pid" || fail "verifyd exited $? on SIGTERM"
ms=$((($(date +%s%N) - t0) / 1000000))
pid=
grep -q "shutdown: [0-9]* queued comparisons dropped unrun" "$dir/log" \
  || fail "no comparison was left queued, so the stop was not tested: $(cat "$dir/out")"
[ "$ms" -lt 3000 ] || fail "SIGTERM took $ms ms"
echo "SIGTERM with a queue of comparisons: stopped in $ms ms"
echo "PASS"
