#!/usr/bin/env bash
# The verifyd binary as an operator starts it: --help and --version, refusals with a one-line
# reason and a non-zero exit (a second instance, a token file others can read or with a newline
# inside, plaintext TCP admin), and systemd's READY/STOPPING notifications.
set -euo pipefail
verifyd=$1
dir=$(mktemp -d)
pid=""
# Every background job dies with the test: one left holding stdout keeps ctest waiting.
trap 'kill -9 $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; cat "$dir/log" 2>/dev/null || true; exit 1; }

# --help lists the daemon's own flags and exits 0; --version prints version and commit.
"$verifyd" --help >"$dir/help" 2>&1 || fail "--help exited $?"
for f in listen admin_listen state_dir metrics_address tls_cert_file grpc_max_threads; do
  grep -q -- "--$f=" "$dir/help" || fail "--help does not list --$f: $(head -5 "$dir/help")"
done
grep -q "unix:/run/verifyd/admin.sock" "$dir/help" || fail "--help shows another admin default"
if grep -q "No flags matched" "$dir/help"; then fail "--help matched no flags"; fi
"$verifyd" --version >"$dir/version" 2>&1 || fail "--version exited $?"
grep -Eq "^verifyd [0-9]+\.[0-9]+\.[0-9]+ \(commit ([0-9a-f]+|unknown)\)$" "$dir/version" \
  || fail "--version: $(cat "$dir/version")"

# A refusal: exit code non-zero, one line naming the reason ($1: the text, rest: verifyd flags).
refused() {
  local want=$1
  shift
  if "$verifyd" --engine=cpu --metrics_address= "$@" >"$dir/out" 2>&1; then
    fail "started with $*"
  fi
  [ "$(wc -l <"$dir/out")" -eq 1 ] || fail "expected one line for $*, got: $(cat "$dir/out")"
  grep -qF -- "$want" "$dir/out" || fail "expected '$want', got: $(cat "$dir/out")"
}
flags=(--listen="unix:$dir/d2.sock" --admin_listen="unix:$dir/a2.sock" --state_dir="$dir/s2")
printf 's3cret\n' >"$dir/token"
chmod 644 "$dir/token"
refused "admin_token_file: $dir/token has mode 0644" "${flags[@]}" --admin_token_file="$dir/token"
printf 'abc\ndef\n' >"$dir/token2"
chmod 600 "$dir/token2"
refused "the token has byte 0x0a at offset 3" "${flags[@]}" --admin_token_file="$dir/token2"
refused "keep_freed_mb: must be in [0, 2047]" "${flags[@]}" --keep_freed_mb=4096
refused "cuda_sync_spin_us: must be in [0, 100000]" "${flags[@]}" --cuda_sync_spin_us=-1
refused "max_channels: must be in [0, 1024]" "${flags[@]}" --max_channels=5000
refused "max_regions: must be in [0, 3072]" "${flags[@]}" --max_regions=4000
refused "max_regions_per_client: must be in [1, 3072]" "${flags[@]}" --max_regions_per_client=0
chmod 600 "$dir/token"
refused "is TCP without TLS" --listen="unix:$dir/d2.sock" --admin_listen=127.0.0.1:0 \
  --state_dir="$dir/s2" --admin_token_file="$dir/token"

# Under umask 0 the sockets still get their modes (data 0660, admin 0600), never looser.
(umask 0 && exec "$verifyd" --listen="unix:$dir/um.sock" --admin_listen="unix:$dir/uma.sock" \
  --metrics_address= --state_dir="$dir/um" --engine=cpu --probe=false >"$dir/um.log" 2>&1) &
um=$!
for _ in $(seq 2400); do [ -S "$dir/uma.sock" ] && [ -S "$dir/um.sock" ] && break; sleep 0.05; done
data_mode=$(stat -c %a "$dir/um.sock") admin_mode=$(stat -c %a "$dir/uma.sock")
kill -TERM $um; wait $um || true
[ "$data_mode" = 660 ] || fail "data socket under umask 0: mode $data_mode, not 660"
[ "$admin_mode" = 600 ] || fail "admin socket under umask 0: mode $admin_mode, not 600"

# Without --state_dir nothing is created in the working directory, even when the start fails.
mkdir -p "$dir/cwd"
(cd "$dir/cwd" && "$verifyd" --engine=cpu --listen=not-an-address --metrics_address= \
  --admin_listen="unix:$dir/cwd.sock" >/dev/null 2>&1) || true
[ -z "$(ls -A "$dir/cwd")" ] || fail "verifyd left $(ls -A "$dir/cwd") in its working directory"
grep -q -- "--state_dir=/var/lib/verifyd" <("$verifyd" --help 2>&1) || fail "--state_dir default"

# The first instance, with systemd's notify socket.
python3 - "$dir/notify" >"$dir/notified" <<'PY' &
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
s.settimeout(180)
for _ in range(2):
    print(s.recv(4096).decode().replace("\n", " "), flush=True)
PY
listener=$!
for _ in $(seq 100); do [ -S "$dir/notify" ] && break; sleep 0.05; done
NOTIFY_SOCKET="$dir/notify" "$verifyd" --listen=127.0.0.1:0 --admin_listen="unix:$dir/admin.sock" \
  --metrics_address=127.0.0.1:0 --state_dir="$dir/state" --engine=cpu >"$dir/log" 2>&1 &
pid=$!
# READY=1 follows the start-up probe: seconds, or tens of seconds under the sanitizers.
for _ in $(seq 2400); do grep -q "READY=1" "$dir/notified" && break; sleep 0.05; done
grep -q "READY=1" "$dir/notified" || fail "no READY=1 from systemd's notify socket"
[ -S "$dir/admin.sock" ] || fail "READY=1 before the admin socket exists"

# A second instance on the same state dir or admin socket: refused, naming the first's pid.
refused "state_dir $dir/state is locked by pid $pid" --listen=127.0.0.1:0 \
  --admin_listen="unix:$dir/a3.sock" --state_dir="$dir/state"
refused "admin_listen: unix:$dir/admin.sock is in use by pid $pid" --listen=127.0.0.1:0 \
  --admin_listen="unix:$dir/admin.sock" --state_dir="$dir/s3"
kill -0 "$pid" || fail "the first daemon died"
[ -S "$dir/admin.sock" ] || fail "the first daemon's socket was removed"

# --engine=auto on a host that looks like a GPU node (what the NVIDIA container runtime sets) but
# has no usable GPU: it serves from the CPU, and says so at warn level, in a metric and in status.
NVIDIA_VISIBLE_DEVICES=all "$verifyd" --listen=127.0.0.1:0 --admin_listen="unix:$dir/fb.sock" \
  --metrics_address=127.0.0.1:0 --state_dir="$dir/fb" --engine=auto --probe=false \
  >"$dir/fb.log" 2>&1 &
fb=$!
for _ in $(seq 2400); do grep -q "metrics on http" "$dir/fb.log" && break; sleep 0.05; done
grep -q "\[warning\] engine: NVIDIA_VISIBLE_DEVICES=all, but .*serving from the CPU engine" \
  "$dir/fb.log" || { kill $fb; fail "no warning for the CPU fallback: $(cat "$dir/fb.log")"; }
maddr=$(sed -n 's|.*metrics on http://\([^/]*\)/metrics.*|\1|p' "$dir/fb.log" | head -1)
grep -q "^verifyd_engine_cpu_fallback 1" <(curl -s "http://$maddr/metrics") \
  || { kill $fb; fail "verifyd_engine_cpu_fallback is not 1 at $maddr"; }
kill -TERM $fb; wait $fb || true
# Without the sign, no fallback is reported.
env -u NVIDIA_VISIBLE_DEVICES "$verifyd" --listen=127.0.0.1:0 --admin_listen="unix:$dir/fb2.sock" \
  --metrics_address=127.0.0.1:0 --state_dir="$dir/fb2" --engine=cpu --probe=false \
  >"$dir/fb2.log" 2>&1 &
fb=$!
for _ in $(seq 2400); do grep -q "metrics on http" "$dir/fb2.log" && break; sleep 0.05; done
maddr=$(sed -n 's|.*metrics on http://\([^/]*\)/metrics.*|\1|p' "$dir/fb2.log" | head -1)
grep -q "^verifyd_engine_cpu_fallback 0" <(curl -s "http://$maddr/metrics") \
  || { kill $fb; fail "verifyd_engine_cpu_fallback is not 0 with --engine=cpu"; }
kill -TERM $fb; wait $fb || true

kill -TERM "$pid"
wait "$pid" || fail "verifyd exited $? on SIGTERM"
pid=""
wait "$listener" || true
grep -q "STOPPING=1" "$dir/notified" || fail "no STOPPING=1: $(cat "$dir/notified")"
echo "PASS"
