#!/usr/bin/env bash
# Region transports across two processes on the GPU machine: verifyd --engine=cuda and
# `verifyctl send`, which allocates its own POSIX shm or GPU memory (CUDA IPC) and registers it.
#   1. Every output written into the client's region equals the inline transport's bit for bit
#      (--check), on page sizes 1 and 64, while the client overwrites q and the pool right after
#      each response (--scribble): the shadow comparisons must all stay clean (the shadow hazard).
#   2. A region call is captured and `verifyctl replay` reproduces it bit for bit.
#   3. With the Python client and torch (PACK/py): CUDA IPC, doorbell graphs, VMM regions, and a
#      KV pool per layer registered as one region set, called through each SGLang adapter.
# Prints one line per check; exits non-zero when one fails.
#
#   gpu_region_test.sh PACK_DIR OUT_DIR
set -uo pipefail
PACK=$1 OUT=$2
bin=$PACK/bin
dir=$(mktemp -d)
log=$OUT/region_daemon.log
status=0
ctl() { "$bin/verifyctl" --target="unix:$dir/verifyd.sock" --admin="unix:$dir/admin.sock" "$@"; }
fail() { echo "FAIL $*"; status=1; }

"$bin/verifyd" --engine=cuda --listen="unix:$dir/verifyd.sock" --admin_listen="unix:$dir/admin.sock" \
  --metrics_address=127.0.0.1:0 --state_dir="$dir/state" --capture_dir="$dir/captures" \
  --shadow_threads=2 --shadow_queue=256 --log_level=info > "$log" 2>&1 &
pid=$!
for _ in $(seq 1200); do [ -S "$dir/admin.sock" ] && break; sleep 0.1; done  # the start-up probe runs first
[ -S "$dir/admin.sock" ] || { echo "FAIL verifyd did not start"; cat "$log"; exit 1; }

counters() {  # match breach error skipped, once every served call's comparison is recorded
  for _ in $(seq 100); do
    ctl status --json > "$dir/status.json" || return 1
    python3 - "$dir/status.json" <<'PY' && return 0
import json, sys
c = json.load(open(sys.argv[1]))["counters"]
done = c["comparisons_match"] + c["comparisons_breach"] + c["comparisons_error"] + c["comparisons_skipped"]
if done < c["requests"] - c["request_errors"]:
    sys.exit(1)
print(c["comparisons_match"], c["comparisons_breach"], c["comparisons_error"], c["comparisons_skipped"])
PY
    sleep 0.1
  done
}

calls=0
for transport in cuda_ipc shm cuda_ipc+channel; do
  how=(--transport "${transport%+channel}")
  [[ $transport == *+channel ]] && how+=(--channel)
  for page in 1 64; do
    for shape in 2,16,8,2048 1,64,16,4096; do
      out=$(ctl send "${how[@]}" --check --scribble --shape "$shape" \
              --page_size "$page" --count 40 --distinct 40 --concurrency 4 2>&1)
      rc=$?
      calls=$((calls + 40))
      check=$(echo "$out" | grep -E '^check:' || true)
      if [[ $rc != 0 ]]; then
        fail "send ${how[*]} page $page shape $shape: rc=$rc: $(echo "$out" | tail -3)"
      else
        echo "ok   send ${how[*]} --check --scribble page $page shape $shape: $check"
      fi
    done
  done
done
# A resident slot: each worker writes its bundle once and names it in every call.
out=$(ctl send --transport cuda_ipc --channel --resident --check --shape 2,16,8,2048 \
        --page_size 64 --count 40 --distinct 4 --concurrency 4 2>&1)
rc=$?
calls=$((calls + 40))
if [[ $rc != 0 ]]; then
  fail "send --transport cuda_ipc --channel --resident: rc=$rc: $(echo "$out" | tail -3)"
else
  echo "ok   send --transport cuda_ipc --channel --resident --check: $(echo "$out" | grep -E '^check:' || true)"
fi
sleep 1
read -r match breach error skipped < <(counters)
echo "shadow comparisons after $calls scribbled region calls: match $match breach $breach error $error skipped $skipped"
[[ "$breach" == 0 && "$error" == 0 && "$match" -gt 0 ]] || fail "the shadow hazard: comparisons were not all clean"

# The Python client's cuda_ipc transport with torch CUDA tensors (another process again).
if [[ -d "$PACK/py" ]]; then
  gen=$PACK/py/gen
  if python3 -c "import grpc_tools" 2>/dev/null; then
    mkdir -p "$dir/gen" && python3 -m grpc_tools.protoc -I"$PACK/py/proto" \
      --python_out="$dir/gen" --grpc_python_out="$dir/gen" "$PACK"/py/proto/verifyd/v1/*.proto &&
      gen=$dir/gen
  fi
  VERIFYD_CLIENT_GEN=$gen timeout 300 python3 "$PACK/py/tests/python/gpu_cuda_ipc_test.py" \
    --data "unix://$dir/verifyd.sock" --admin "unix://$dir/admin.sock" \
    > "$OUT/python_cuda_ipc.txt" 2>&1
  rc=$?
  if [[ $rc == 0 ]]; then
    echo "ok   python cuda_ipc transport: $(grep -cE '^PASS' "$OUT/python_cuda_ipc.txt") checks passed"
  else
    fail "python cuda_ipc transport (rc=$rc): $(grep -E '^(FAIL|SETUP)' "$OUT/python_cuda_ipc.txt" | head -5)"
  fi
  # Doorbell channels from a captured CUDA graph: 10,000 calls per client, two client processes.
  VERIFYD_CLIENT_GEN=$gen timeout 400 python3 "$PACK/py/tests/python/gpu_doorbell_test.py" \
    --data "unix://$dir/verifyd.sock" --admin "unix://$dir/admin.sock" --replays 2500 --clients 2 --verifyd "$bin/verifyd" \
    --custom_replays 500 --fp8_replays 200 \
    > "$OUT/python_doorbell.txt" 2>&1
  rc=$?
  if [[ $rc == 0 ]]; then
    grep -E '^(ok|shadow)' "$OUT/python_doorbell.txt"
  else
    fail "python doorbell graph test (rc=$rc): $(grep -E '^(FAIL|SETUP)|Error' "$OUT/python_doorbell.txt" | head -5)"
  fi
  # Tensors in torch's expandable segments (CUDA VMM): chunks passed as descriptors, mapped by verifyd.
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True VERIFYD_CLIENT_GEN=$gen timeout 300 \
    python3 "$PACK/py/tests/python/gpu_vmm_test.py" \
    --data "unix://$dir/verifyd.sock" --admin "unix://$dir/admin.sock" > "$OUT/python_vmm.txt" 2>&1
  rc=$?
  if [[ $rc == 0 ]]; then
    echo "ok   python cuda_ipc transport, expandable segments (VMM): $(grep -cE '^PASS' "$OUT/python_vmm.txt") checks passed"
  else
    fail "python cuda_ipc transport, expandable segments (VMM) (rc=$rc): $(grep -E '^(FAIL|SETUP)' "$OUT/python_vmm.txt" | head -5)"
  fi
  # 61 layer pools as one region set (VMM and CUDA IPC members), each backend's adapter on it.
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True VERIFYD_CLIENT_GEN=$gen timeout 300 \
    python3 "$PACK/py/tests/python/gpu_region_set_test.py" --verifyctl "$bin/verifyctl" \
    --data "unix://$dir/verifyd.sock" --admin "unix://$dir/admin.sock" > "$OUT/python_region_set.txt" 2>&1
  rc=$?
  if [[ $rc == 0 ]]; then
    echo "ok   python region set of 61 layer pools through the three adapters: $(grep -cE '^PASS' "$OUT/python_region_set.txt") checks passed, $(grep -m1 -E 'worst rel-L2' "$OUT/python_region_set.txt" | sed 's/^ *//')"
  else
    fail "python region set of 61 layer pools (rc=$rc): $(grep -E '^(FAIL|SETUP)' "$OUT/python_region_set.txt" | head -5)"
  fi
fi

# A captured region call replays bit for bit.
ctl capture --next 1 > /dev/null || fail "capture --next 1"
ctl send --transport cuda_ipc --shape 2,16,8,1024 --page_size 16 --count 1 > /dev/null ||
  fail "send for the capture"
for _ in $(seq 100); do
  f=$(ls "$dir"/captures/*.safetensors 2>/dev/null | head -1)
  [[ -n "$f" ]] && break
  sleep 0.1
done
if [[ -z "${f:-}" ]]; then
  fail "no capture of the region call was written"
else
  sleep 0.5
  if "$bin/verifyctl" replay --engine cuda "$f" > "$OUT/region_replay.txt" 2>&1; then
    echo "ok   capture of a cuda_ipc call replays: $(grep -m1 -iE 'reproduced|bit for bit' "$OUT/region_replay.txt")"
  else
    fail "replay of the captured region call: $(tail -5 "$OUT/region_replay.txt")"
  fi
fi
ctl status > "$OUT/region_status.txt"
kill "$pid"
wait "$pid" 2>/dev/null
exit $status
