#!/usr/bin/env bash
# The README's TLS example, run as written with verifyctl: its tls-setup lines (a throwaway CA,
# a server certificate, a token), its tls-daemon line in the background, then its tls-client
# lines in order, on free ports instead of the README's. Then what the example leaves out: a
# plaintext client gets a hint, mutual TLS from flags and from the environment, a swapped
# certificate and key found at start-up before the probe suite runs.
#   tls_example_test.sh VERIFYD VERIFYCTL README
set -euo pipefail
verifyd=$(realpath "$1") verifyctl=$(realpath "$2") readme=$(realpath "$3")
work=$(mktemp -d /tmp/verifyd-tls.XXXXXX)
pid=
cleanup() {
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill "$pid"; wait "$pid" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; echo "--- verifyd's log"; tail -30 "$work/verifyd.log" 2>/dev/null; exit 1; }

mkdir -p "$work/bin"
ln -s "$verifyd" "$work/bin/verifyd"
ln -s "$verifyctl" "$work/bin/verifyctl"
export PATH=$work/bin:$PATH
read -r data_port admin_port < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])')

# The lines of the ```sh block after the marker <!-- NAME: ... -->, continuation lines joined,
# the README's ports replaced by free ones.
block() {
  awk -v name="$1" '
    index($0, "<!-- " name ":") == 1 { marked = 1; next }
    marked && /^```sh/ { inside = 1; next }
    inside && /^```/ { exit }
    inside && /\\$/ { sub(/\\$/, ""); line = line $0; next }
    inside { print line $0; line = "" }
  ' "$readme" | sed -e "s/50443/$data_port/g" -e "s/50444/$admin_port/g"
}
run_lines() {
  local line
  while IFS= read -r line; do
    [ -n "$line" ] || continue
    echo "\$ $line"
    eval "$line" >"$work/out" 2>&1 || { cat "$work/out"; fail "README line: $line"; }
    tail -3 "$work/out"
  done <<<"$1"
}
wait_serving() {  # the log of the daemon started last says it serves
  for _ in $(seq 1200); do
    grep -q "admin on" "$work/verifyd.log" && return
    kill -0 "$pid" 2>/dev/null || fail "verifyd exited"
    sleep 0.1
  done
  fail "verifyd did not start"
}

cd "$work"
setup=$(block tls-setup) daemon=$(block tls-daemon) client=$(block tls-client)
[ -n "$setup" ] && [ -n "$daemon" ] && [ -n "$client" ] || fail "README.md lacks a tls-* block"
run_lines "$setup"
echo "\$ $daemon &"
(eval "exec $daemon") >"$work/verifyd.log" 2>&1 &
pid=$!
wait_serving
# The client lines run in this shell, so that their export carries to the checks below.
run_lines "$client"
grep -q "^succeeded 4  failed 0" "$work/out" || fail "send over TLS: $(cat "$work/out")"

# A plaintext client of the TLS ports: UNAVAILABLE, and a hint to pass the CA.
rc=0; env -u VERIFYD_TLS_CA_FILE verifyctl --admin_token_file=token status 2>"$work/err" || rc=$?
[ "$rc" -eq 1 ] || fail "plaintext status exited $rc"
grep -q "UNAVAILABLE: .*(is 127.0.0.1:$admin_port serving TLS? pass --tls_ca_file" "$work/err" \
  || fail "no TLS hint for the admin: $(cat "$work/err")"
[ "$(wc -l <"$work/err")" -eq 1 ] || fail "more than one line: $(cat "$work/err")"
env -u VERIFYD_TLS_CA_FILE verifyctl send --shape 2,4,8,256 --count 1 >"$work/out" || true
grep -q "^first error: UNAVAILABLE: .*(is 127.0.0.1:$data_port serving TLS? pass --tls_ca_file" \
  "$work/out" || fail "no TLS hint for send: $(cat "$work/out")"
# A file that holds no PEM block is refused naming the flag, before any call.
rc=0; verifyctl --tls_ca_file=token --admin_token_file=token status 2>"$work/err" || rc=$?
[ "$rc" -eq 1 ] && grep -q -- "--tls_ca_file: token holds no PEM block" "$work/err" \
  || fail "a CA file without PEM: exit $rc: $(cat "$work/err")"
kill -TERM "$pid"; wait "$pid" || fail "verifyd exited $? on SIGTERM"; pid=

# Mutual TLS: a client certificate from the same CA, required by --tls_client_ca_file.
key="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req $key -subj /CN=operator -keyout client.key -out client.csr 2>/dev/null
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 -out client.pem \
  2>/dev/null
(eval "exec $daemon --tls_client_ca_file=ca.pem") >"$work/verifyd.log" 2>&1 &
pid=$!
wait_serving
rc=0; verifyctl --admin_token_file=token status 2>"$work/err" || rc=$?
[ "$rc" -eq 1 ] || fail "status without a client certificate exited $rc"
grep -q "UNAVAILABLE: .*--tls_cert_file and --tls_key_file" "$work/err" \
  || fail "no client-certificate hint: $(cat "$work/err")"
verifyctl --admin_token_file=token --tls_cert_file=client.pem --tls_key_file=client.key status \
  >/dev/null || fail "status with a client certificate"
VERIFYD_TLS_CERT_FILE=$PWD/client.pem VERIFYD_TLS_KEY_FILE=$PWD/client.key \
  verifyctl send --shape 2,4,8,256 --count 2 >"$work/out" || fail "send with VERIFYD_TLS_CERT_FILE"
grep -q "^succeeded 2  failed 0" "$work/out" || fail "send with mTLS: $(cat "$work/out")"
rc=0; verifyctl --tls_cert_file=client.pem status 2>"$work/err" || rc=$?
[ "$rc" -eq 1 ] && grep -q -- "--tls_cert_file, --tls_key_file: give both" "$work/err" \
  || fail "a certificate without its key: exit $rc: $(cat "$work/err")"
kill -TERM "$pid"; wait "$pid" || fail "verifyd exited $? on SIGTERM"; pid=

# A swapped certificate and key: refused at once, naming both flags, before the engine and the
# start-up probe suite (no state directory, no probe in the log).
swapped=${daemon/--tls_cert_file=server.pem/--tls_cert_file=server.key}
swapped=${swapped/--tls_key_file=server.key/--tls_key_file=server.pem}
swapped=${swapped/--state_dir=state/--state_dir=state-swapped}
rc=0; (eval "exec $swapped") >"$work/swapped.log" 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "verifyd started with a swapped certificate and key"
grep -q "tls_cert_file: holds no PEM certificate (--tls_cert_file and --tls_key_file are swapped)" \
  "$work/swapped.log" || fail "swapped pair: $(cat "$work/swapped.log")"
if grep -q "probe" "$work/swapped.log"; then fail "the probe suite ran: $(cat "$work/swapped.log")"; fi
[ ! -e state-swapped ] || fail "the state directory was created before the TLS check"
echo "PASS: the README's TLS example and verifyctl's TLS options"
