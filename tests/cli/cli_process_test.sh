#!/usr/bin/env bash
# The shipped binaries as an operator uses them: start verifyd, drive it with verifyctl, kill it
# hard, start it again: the mode and the audit log are as they were; exit codes and --json hold.
# Then the command line itself: global options anywhere, environment defaults, --version, refusals
# with the gRPC code, send's tallies, replay's verdicts, the token file, and status showing what
# the daemon runs with.
set -euo pipefail
# PART (default both): "operator" runs the first half, "faults" the second; CTest runs them as
# two tests, side by side.
verifyd=$1 verifyctl=$2 part=${3:-both}
dir=$(mktemp -d)
pid=
trap '[ -z "$pid" ] || kill -9 "$pid" 2>/dev/null || true; rm -rf "$dir"' EXIT

start() {  # extra verifyd flags
  rm -f "$dir/data.sock" "$dir/admin.sock"  # left behind by kill -9
  "$verifyd" --listen="unix:$dir/data.sock" --listen=127.0.0.1:0 --admin_listen="unix:$dir/admin.sock" \
    --metrics_address=127.0.0.1:0 --state_dir="$dir/state" --engine=cpu --gate_window=2 "$@" \
    >>"$dir/log" 2>&1 &
  pid=$!
  # The start-up probe runs before verifyd listens (seconds under the sanitizers).
  for _ in $(seq 1200); do [ -S "$dir/admin.sock" ] && [ -S "$dir/data.sock" ] && return; sleep 0.1; done
  cat "$dir/log"; echo "verifyd did not start"; exit 1
}
stop() { kill -9 "$pid"; wait "$pid" 2>/dev/null || true; }
ctl() { "$verifyctl" --target="unix:$dir/data.sock" --admin="unix:$dir/admin.sock" "$@"; }
fail() { echo "FAIL: $*"; cat "$dir/log"; exit 1; }
# json FILE PYTHON-EXPRESSION-ON-j: exits non-zero when the expression is false.
json() { python3 -c "import json,sys; j=json.load(open(sys.argv[1])); sys.exit(0 if ($2) else 1)" "$1"; }

if [ "$part" != faults ]; then
  if "$verifyd" --engine=cpu --state_dir="$dir/bad" --atol_rel=-1 >"$dir/bad.log" 2>&1; then
    fail "a negative --atol_rel started"
  fi
  grep -q "atol_rel" "$dir/bad.log" || fail "no field named for a bad --atol_rel: $(cat "$dir/bad.log")"
  if "$verifyd" --engine=cpu --state_dir="$dir/bad" --max_lse_abs=nan >"$dir/bad.log" 2>&1; then
    fail "a NaN --max_lse_abs started"
  fi
  grep -q "max_lse_abs: must be >= 0" "$dir/bad.log" \
    || fail "no field named for a bad --max_lse_abs: $(cat "$dir/bad.log")"
  start
  # A refusal names its gRPC code, in text and in --json.
  if ctl flip custom --reason "too early" 2>"$dir/err"; then fail "flip past a closed gate passed"; fi
  grep -q "^verifyctl: flip: FAILED_PRECONDITION: gate: not ready" "$dir/err" \
    || fail "refusal without its code: $(cat "$dir/err")"
  if ctl flip custom --reason "too early" --json >"$dir/err.json"; then fail "json flip passed"; fi
  json "$dir/err.json" 'j["code"] == "FAILED_PRECONDITION"' || fail "json error: $(cat "$dir/err.json")"

  ctl send --shape 2,3,8,54 --page_size 16 --count 4 --json >"$dir/send.json" || fail "send"
  grep -q '"ok": 4' "$dir/send.json" || fail "send did not get 4 answers: $(cat "$dir/send.json")"
  # Inline calls as pieces (the default) and as one message: both served, the way reported.
  json "$dir/send.json" 'j["inline_encode"] == "pieces"' || fail "inline_encode: $(cat "$dir/send.json")"
  ctl send --shape 2,3,8,54 --page_size 16 --count 2 --inline_encode message --json \
    >"$dir/send_msg.json" || fail "send --inline_encode message"
  json "$dir/send_msg.json" 'j["ok"] == 2 and j["inline_encode"] == "message"' \
    || fail "send --inline_encode message: $(cat "$dir/send_msg.json")"
  if ctl send --count 1 --inline_encode bogus >/dev/null 2>"$dir/err"; then
    fail "--inline_encode bogus passed"
  fi
  grep -q -- "--inline_encode" "$dir/err" || fail "no field named for a bad --inline_encode"
  ctl send --shape 1,4,2,40 --page_size 16 --count 2 --traffic realistic --json \
    >"$dir/send_real.json" || fail "send --traffic realistic"
  grep -q '"traffic": "realistic"' "$dir/send_real.json" || fail "traffic model not reported"
  if ctl send --count 1 --traffic bogus >/dev/null 2>"$dir/err"; then fail "--traffic bogus passed"; fi
  grep -q -- "--traffic" "$dir/err" || fail "no field named for a bad --traffic: $(cat "$dir/err")"
  # An e4m3 pool (the same random values at kv_scale 0.37): inline, and through shm bit for bit.
  ctl send --shape 2,3,8,54 --page_size 16 --count 2 --kv_dtype e4m3 --kv_scale 0.37 --json \
    >"$dir/send_e4m3.json" || fail "send --kv_dtype e4m3"
  grep -q '"ok": 2' "$dir/send_e4m3.json" && grep -q '"kv_dtype": "e4m3"' "$dir/send_e4m3.json" \
    || fail "send --kv_dtype e4m3: $(cat "$dir/send_e4m3.json")"
  ctl send --shape 2,3,8,54 --page_size 16 --count 2 --kv_dtype e4m3 --kv_scale 0.37 \
    --transport shm --check >/dev/null || fail "send --kv_dtype e4m3 --transport shm --check"
  for bad in "--kv_dtype fp16" "--kv_scale 0" "--kv_scale 2"; do
    # shellcheck disable=SC2086
    if ctl send --count 1 $bad >/dev/null 2>"$dir/err"; then fail "send $bad passed"; fi
    grep -q -- "${bad%% *}" "$dir/err" || fail "send $bad: the error names no flag: $(cat "$dir/err")"
  done
  # canary without --fraction serves the persisted fraction (0.05 until one was set).
  ctl flip canary --reason "default fraction" --force --json >"$dir/c.json" || fail "canary"
  json "$dir/c.json" 'j["mode"] == "canary" and j["canary_fraction"] == 0.05' \
    || fail "canary without --fraction: $(cat "$dir/c.json")"
  ctl flip shadow --reason "back" >/dev/null || fail "back to shadow"
  if ctl flip custom >/dev/null 2>&1; then fail "flip without --reason passed"; fi

  # --fraction belongs to canary only.
  if ctl flip custom --fraction 0.3 --reason x --force 2>"$dir/err"; then
    fail "flip custom --fraction was accepted"
  fi
  grep -q -- "--fraction: only canary" "$dir/err" || fail "fraction refusal: $(cat "$dir/err")"

  # Global options after the subcommand, and from the environment.
  "$verifyctl" status --admin="unix:$dir/admin.sock" --json >"$dir/s.json" \
    || fail "status --admin=... after the subcommand"
  json "$dir/s.json" 'j["mode"] == "shadow"' || fail "status after the subcommand"
  VERIFYD_ADMIN="unix:$dir/admin.sock" VERIFYD_TARGET="unix:$dir/data.sock" "$verifyctl" status \
    >"$dir/s.txt" || fail "status with VERIFYD_ADMIN"
  VERIFYD_ADMIN="unix:$dir/admin.sock" VERIFYD_TARGET="unix:$dir/data.sock" "$verifyctl" send \
    --shape 2,3,8,54 --page_size 16 --count 2 >/dev/null || fail "send with VERIFYD_TARGET"
  grep -q "unix:/run/verifyd/admin.sock" <("$verifyctl" --help) || fail "default admin address"
  "$verifyctl" --version >"$dir/v" || fail "--version exit code"
  grep -Eq '^verifyctl [0-9]+\.[0-9]+\.[0-9]+ \(.+\)$' "$dir/v" || fail "--version: $(cat "$dir/v")"

  # status shows what the daemon runs with.
  grep -q "^tolerances  atol 0  atol_rel 0.02  rtol 0.02  max rel-L2 0.01  max row rel-L2 0.01  max-abs 0.25  max lse 0.01" "$dir/s.txt" || fail "tolerances: $(cat "$dir/s.txt")"
  grep -q "^rollback    after 3 breaches within 1000" "$dir/s.txt" || fail "rollback thresholds"
  grep -q "^listening   data unix:$dir/data.sock, 127.0.0.1:[0-9]*  admin unix:$dir/admin.sock  metrics 127.0.0.1:" \
    "$dir/s.txt" || fail "listen addresses: $(cat "$dir/s.txt")"
  grep -q "^regions     none" "$dir/s.txt" || fail "regions"
  grep -q "^channels    none" "$dir/s.txt" || fail "channels"
  grep -q "^up          " "$dir/s.txt" || fail "uptime"
  if grep -q WARNING "$dir/s.txt"; then fail "fault warning without a fault"; fi
  json "$dir/s.json" 'j["runtime"]["inject_custom_fault"] == "" and j["runtime"]["rollback_breaches"] == 3
    and j["runtime"]["tolerances"]["max_rel_l2"] == 0.01 and j["regions"] == []
    and j["runtime"]["listen"][0] == "unix:'"$dir"'/data.sock" and j["runtime"]["uptime_seconds"] >= 0' \
    || fail "status --json runtime: $(cat "$dir/s.json")"

  # The audit keeps the claimed name and the kernel's uid apart.
  USER=alice ctl flip canary --fraction 0.25 --reason "ci canary" --force --json \
    | grep -q '"mode": "canary"' || fail "flip canary"
  ctl status --json >"$dir/status.json" || fail "status"
  grep -q '"mode": "canary"' "$dir/status.json" || fail "status after flip"
  json "$dir/status.json" 'j["audit"][-1]["who"].startswith("alice@")
    and j["audit"][-1]["peer"].startswith("uid:'"$(id -u)"'")' \
    || fail "audit who/peer: $(cat "$dir/status.json")"
  ctl status >"$dir/s.txt" || fail "status"
  grep -q "by uid:$(id -u)([^)]*) (claims alice@[^)]*): ci canary" "$dir/s.txt" \
    || fail "the audit line leads with the verified peer: $(grep -A3 '^audit' "$dir/s.txt")"

  stop
  start
  ctl status --json >"$dir/status2.json" || fail "status after restart"
  grep -q '"mode": "canary"' "$dir/status2.json" || fail "mode lost across a hard restart"
  grep -q '"reason": "ci canary"' "$dir/status2.json" || fail "audit lost across a hard restart"
  if ctl rollback 2>"$dir/err"; then fail "rollback without --reason passed"; fi
  grep -q -- "--reason" "$dir/err" || fail "rollback refusal: $(cat "$dir/err")"
  ctl rollback --reason "ci done" | grep -q "mode is now shadow" || fail "rollback"
  ctl status | grep -q "^mode        shadow" || fail "human status"

  # A start-up probe that fails rolls canary back to shadow before serving, and the start-up log
  # says the mode it serves, not the one it read.
  ctl flip canary --fraction 0.5 --reason "before a bad build" --force >/dev/null || fail "flip"
  stop
  lines=$(wc -l <"$dir/log")
  start --inject_custom_fault=error
  tail -n +"$((lines + 1))" "$dir/log" >"$dir/restart.log"
  grep -q "mode shadow, state in" "$dir/restart.log" || fail "start-up log: $(cat "$dir/restart.log")"
  if grep -q "mode canary, state in" "$dir/restart.log"; then fail "start-up log says canary"; fi
  ctl status --json >"$dir/s.json" || fail "status"
  json "$dir/s.json" 'j["mode"] == "shadow" and j["last_rollback_reason"].startswith("probe:")' \
    || fail "after the failed start-up probe: $(cat "$dir/s.json")"
  stop
  start

  # A call channel over TCP stops with the daemon's reason, which names the Unix socket, once.
  tcp=$(ctl status --json | python3 -c 'import json,sys; print([a for a in json.load(sys.stdin)["runtime"]["listen"] if not a.startswith("unix:")][0])')
  rc=0; "$verifyctl" --target="$tcp" send --shape 2,3,8,54 --page_size 16 --count 2 --channel \
    >"$dir/out" 2>"$dir/err" || rc=$?
  [ "$rc" -eq 1 ] || fail "send --channel over TCP: exit $rc: $(cat "$dir/out" "$dir/err")"
  [ ! -s "$dir/out" ] || fail "send --channel over TCP printed a summary: $(cat "$dir/out")"
  grep -q "PERMISSION_DENIED\|OpenChannel: .*--listen=unix:PATH" "$dir/err" \
    || fail "send --channel over TCP: $(cat "$dir/err")"
  if grep -q "OpenChannel: OpenChannel" "$dir/err"; then fail "doubled prefix: $(cat "$dir/err")"; fi

  # Sampling needs a reason; a custom rate of 0 (nothing compared while custom serves, so no
  # rollback) needs --force, and the audit log says it was forced.
  if ctl sample shadow 0.5 2>"$dir/err"; then fail "sample without --reason passed"; fi
  grep -q -- "--reason" "$dir/err" || fail "sample refusal: $(cat "$dir/err")"
  rc=0; ctl sample custom 0 --reason "too slow" 2>"$dir/err" || rc=$?
  [ "$rc" -eq 1 ] || fail "sample custom 0 without --force: exit $rc"
  grep -q "FAILED_PRECONDITION: rate: .*--force" "$dir/err" || fail "sample custom 0: $(cat "$dir/err")"
  ctl sample custom 0 --reason "ci: off on purpose" --force >/dev/null || fail "sample custom 0 --force"
  ctl status --json >"$dir/s.json" || fail "status"
  json "$dir/s.json" 'j["custom_sample_rate"] == 0 and j["audit"][-1]["forced"] is True' \
    || fail "forced sampling not audited: $(cat "$dir/s.json")"
  ctl sample custom 0.01 --reason "ci: back on" >/dev/null || fail "sample custom 0.01"

  # The token file: a trailing newline is fine, an inner one is refused with the reason.
  printf 'tok\n' >"$dir/token-ok"
  ctl --admin_token_file="$dir/token-ok" status >/dev/null || fail "token with a trailing newline"
  printf 'to\nk\n' >"$dir/token-bad"
  rc=0; ctl --admin_token_file="$dir/token-bad" status 2>"$dir/err" || rc=$?
  [ "$rc" -eq 1 ] || fail "token with an inner newline: exit $rc: $(cat "$dir/err")"
  grep -q "admin_token_file: .*token-bad: the token has byte 0x0a" "$dir/err" || fail "token: $(cat "$dir/err")"

  # Captures replay: "reproduced" agrees with the per-path re-run results.
  ctl capture --next 1 >/dev/null || fail "capture"
  ctl send --shape 2,3,8,54 --page_size 16 --count 1 --compare_sync >/dev/null || fail "send"
  for _ in $(seq 100); do ls "$dir"/state/captures/*.safetensors >/dev/null 2>&1 && break; sleep 0.05; done
  capture=$(ls "$dir"/state/captures/*.safetensors | head -1)
  ctl replay --engine=cpu --json "$capture" >"$dir/r.json" || fail "replay: $(cat "$dir/r.json")"
  json "$dir/r.json" 'j["files"][0]["reproduced"] is True' || fail "replay: $(cat "$dir/r.json")"

  # A dead daemon: non-zero exit with a one-line reason; send tallies its failures.
  stop
  if ctl status 2>"$dir/err"; then fail "status against a dead daemon exited 0"; fi
  [ "$(wc -l <"$dir/err")" -eq 1 ] || fail "expected one line, got: $(cat "$dir/err")"
  if ctl send --shape 2,3,8,54 --page_size 16 --count 2 >"$dir/send.txt"; then
    fail "send with every call failing exited 0"
  fi
  grep -q "^succeeded 0  failed 2 " "$dir/send.txt" || fail "send tally: $(cat "$dir/send.txt")"
  grep -q "^first error: UNAVAILABLE: " "$dir/send.txt" || fail "send error: $(cat "$dir/send.txt")"
  if grep -q "^sent " "$dir/send.txt"; then fail "send claims it sent: $(cat "$dir/send.txt")"; fi

  # Replay of a file that is not safetensors: one error, naming the file once.
  echo "not a bundle" >"$dir/junk.safetensors"
  if ctl replay --engine=cpu "$dir/junk.safetensors" 2>"$dir/err"; then fail "replay of junk passed"; fi
  [ "$(grep -o "junk.safetensors" "$dir/err" | wc -l)" -eq 1 ] || fail "replay error: $(cat "$dir/err")"
fi

if [ "$part" != operator ]; then
  # A daemon with a test-only fault: status says so loudly, and a capture it took does not
  # reproduce on a healthy engine.
  start --inject_custom_fault=perturb:0.5
  ctl status >"$dir/s.txt" || fail "status with a fault"
  grep -q "^WARNING .*FAULT INJECTION IS ON.*perturb:0.5" "$dir/s.txt" || fail "no fault warning: $(cat "$dir/s.txt")"
  rm -f "$dir"/state/captures/*.safetensors
  ctl capture --next 1 >/dev/null || fail "capture"
  ctl send --shape 2,3,8,54 --page_size 16 --count 1 --compare_sync >/dev/null || fail "send"
  for _ in $(seq 100); do ls "$dir"/state/captures/*.safetensors >/dev/null 2>&1 && break; sleep 0.05; done
  capture=$(ls "$dir"/state/captures/*.safetensors | head -1)
  ctl replay --engine=cpu --json "$capture" >"$dir/r.json" || true
  json "$dir/r.json" 'j["files"][0]["reproduced"] is False
    and j["files"][0]["rerun_equals_recorded"]["custom"] is False
    and j["files"][0]["rerun_equals_recorded"]["reference"] is True' \
    || fail "replay of a faulted capture: $(cat "$dir/r.json")"
  stop

  # The probe suite: run at start-up, on demand with every probe printed, in status; a wrong
  # custom path fails it (exit 1) and the flip is refused naming it.
  start --probe_max_prefix=256
  ctl probe >"$dir/p.txt" || fail "probe on a clean engine: $(cat "$dir/p.txt")"
  grep -q "^ok    split_boundaries " "$dir/p.txt" || fail "probe lines: $(cat "$dir/p.txt")"
  grep -q "probes passed in" "$dir/p.txt" || fail "probe summary: $(cat "$dir/p.txt")"
  ctl status | grep -q "^probe       passed: .* (requested, .*); 2 runs, 0 failed" \
    || fail "probe status line: $(ctl status)"
  stop
  if "$verifyd" --engine=cpu --state_dir="$dir/bad" --probe_max_prefix=7 >"$dir/bad.log" 2>&1; then
    fail "--probe_max_prefix=7 started"
  fi
  grep -q "probe_max_prefix" "$dir/bad.log" || fail "no field named: $(cat "$dir/bad.log")"
  start --probe_max_prefix=256 --inject_custom_fault=perturb:0.05
  rc=0; ctl probe --json >"$dir/p.json" || rc=$?
  [ $rc = 1 ] || fail "a failing probe exited $rc"
  json "$dir/p.json" 'j["passed"] is False and any(not r["passed"] for r in j["results"])' \
    || fail "probe --json: $(cat "$dir/p.json")"
  if ctl flip custom --reason x 2>"$dir/err"; then fail "flip past a failed probe passed"; fi
  grep -q "probe suite failed" "$dir/err" || fail "flip refusal: $(cat "$dir/err")"
  stop

  # Oracle drift: a bf16 P·V accumulator passes every call on concentrated traffic, and status
  # says the drift test is in breach; a bad drift flag is refused naming it.
  if "$verifyd" --engine=cpu --state_dir="$dir/bad" --drift_min_samples=1 >"$dir/bad.log" 2>&1; then
    fail "--drift_min_samples=1 started"
  fi
  grep -q "drift_min_samples" "$dir/bad.log" || fail "no field named: $(cat "$dir/bad.log")"
  start --inject_custom_fault=bf16_pv --oracle_sample_rate=1
  ctl send --shape 1,4,8,500 --page_size 16 --count 16 --distinct 16 --traffic realistic \
    --compare_sync --json >"$dir/send.json" || fail "send"
  ctl status >"$dir/s.txt" || fail "status"
  grep -q "^drift       IN BREACH: custom/reference error vs oracle .*x over 16 samples" "$dir/s.txt" \
    || fail "no drift line: $(cat "$dir/s.txt")"
  grep -q "^comparisons match 16, breach 0" "$dir/s.txt" || fail "a call breached: $(cat "$dir/s.txt")"
  ctl status --json >"$dir/s.json" || fail "status --json"
  json "$dir/s.json" 'j["drift"]["breach"] is True and j["drift"]["breaches"] == 1
    and j["drift"]["ratio"] > 1.35 and j["gate"]["ready"] is False' \
    || fail "drift in --json: $(cat "$dir/s.json")"
  stop
fi
echo "PASS"
