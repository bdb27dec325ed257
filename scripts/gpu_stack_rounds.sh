#!/usr/bin/env bash
# Several verifyd builds in turn on the serving-stack step (bench/stack_bench.py), custom mode:
# ROUNDS rounds under MPS (each build once per round, in the order given), then one without MPS.
# Under MPS a median of 30 step replays moves by 10-20% from one run to the next, so a difference
# that small between two builds shows only when each is measured more than once, interleaved.
# Writes OUT/rounds.json (rows carry "verifyd": "LABEL/rROUND") and OUT/rounds.md.
#
#   gpu_stack_rounds.sh PACK_DIR OUT_DIR LABEL=VERIFYD_DIR [LABEL=VERIFYD_DIR ...]
#   (ROUNDS: rounds under MPS, default 2; STACK_BENCH_ARGS: more arguments for stack_bench.py)
set -uo pipefail
PACK=$1 OUT=$2
shift 2
# shellcheck source=gpu_stack_env.sh
source "$(dirname "$0")/gpu_stack_env.sh"
mkdir -p "$OUT"
rows=$OUT/rounds.json
: > "$rows"

run() {  # $1: label, $2: folder of its verifyd, $3: mps 0/1, $4: round
  rm -rf "$dir/state" "$dir"/*.sock
  "$2/verifyd" --engine=cuda --listen="unix:$dir/verifyd.sock" --admin_listen="unix:$dir/admin.sock" \
    --metrics_address=127.0.0.1:0 --state_dir="$dir/state" --capture_dir=off --shadow_threads=2 \
    --shadow_queue=1024 --log_level=warn > "$OUT/verifyd_$1.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do [ -S "$dir/admin.sock" ] && break; sleep 0.1; done
  timeout 200 python3 "$PACK/py/bench/stack_bench.py" --data "unix://$dir/verifyd.sock" \
    --admin "unix://$dir/admin.sock" --mps "$3" --modes custom --eager_calls 100 \
    --label "$1/r$4" --out "$rows" ${STACK_BENCH_ARGS:-} > "$dir/bench.txt" 2>&1 ||
    { echo "FAIL $1 (mps $3, round $4): $(tail -3 "$dir/bench.txt")"; status=1; }
  kill "$pid"; wait "$pid" 2>/dev/null
}

mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
"$mps_ctl" -d || { echo "FAIL MPS did not start"; exit 1; }
for r in $(seq "${ROUNDS:-2}"); do
  for b in "$@"; do run "${b%%=*}" "${b#*=}" 1 "$r"; done
done
quit_mps
sleep 1
for b in "$@"; do run "${b%%=*}" "${b#*=}" 0 1; done

python3 - "$rows" "$(cat "$PACK/COMMIT" 2>/dev/null)" "$@" > "$OUT/rounds.md" <<'PY'
import collections, json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
labels = [a.split("=", 1)[0] for a in sys.argv[3:]]
rounds = sorted({r["verifyd"].split("/")[1] for r in rows})
t = collections.defaultdict(dict)
for r in rows:
    lab, rnd = r["verifyd"].split("/")
    v = r.get("per_call_overhead_us") if r["graph"] else r.get("eager_p50_us")
    t[(r["mps"], "graph" if r["graph"] else "eager", tuple(r["shape"]))][(lab, rnd)] = v
print(f"# Builds in turn on the serving-stack step, custom mode (pack {sys.argv[2]}, H200)\n")
print("bench/stack_bench.py (61-layer captured step, medians of 30 replays; eager: p50 of 100 "
      "synchronised calls), each build once per round, in turn. Overhead per call, "
      "microseconds.\n")
for a in sys.argv[3:]:
    print(f"- `{a.split('=', 1)[0]}`: {a.split('=', 1)[1]}")
for kind, title in (("graph", "Captured step: overhead per call"), ("eager", "Eager call p50")):
    print(f"\n## {title}\n")
    print("| MPS | B,T,H,prefix | " + " | ".join(f"{b} {r}" for b in labels for r in rounds) + " |")
    print("|---|---|" + "---:|" * (len(labels) * len(rounds)))
    for (mps, k, shape), d in sorted(t.items(), key=lambda x: (not x[0][0], x[0][2])):
        if k != kind:
            continue
        cells = ["-" if d.get((b, r)) is None else f"{d[(b, r)]:.1f}" for b in labels for r in rounds]
        print(f"| {'yes' if mps else 'no'} | {','.join(map(str, shape))} | " + " | ".join(cells) + " |")
PY
cat "$OUT/rounds.md"
exit $status
