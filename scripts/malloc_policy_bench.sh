#!/usr/bin/env bash
# The inline transport with glibc's default malloc policy and with verifyd's (--keep_freed_mb,
# KeepFreedMemory in src/common/malloc_arenas.h), side by side in one run on the CPU engine:
# `verifyctl send` over a Unix socket, rounds alternating between the two, the host memcpy of one
# bundle measured in the same run. Shapes with a small attention and a large pool, so that the
# transport dominates. Writes OUT_DIR/malloc-policy-<commit>.{md,json}.
#
#   malloc_policy_bench.sh BUILD_DIR OUT_DIR [rounds (3)] [calls per round (20)]
set -euo pipefail
build=$(cd "${1:?usage: malloc_policy_bench.sh BUILD_DIR OUT_DIR [rounds] [calls]}" && pwd)
out=${2:?out dir}
rounds=${3:-3}
calls=${4:-20}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
dir=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$dir"' EXIT
commit=$("$root/scripts/commit_stamp.sh" "$root")
shapes=("1,1,1,16384" "1,1,1,32768")

start_daemon() {  # $1: --keep_freed_mb
  [ -n "$pid" ] && { kill "$pid"; wait "$pid" 2>/dev/null || true; }
  rm -f "$dir"/*.sock
  "$build/src/main/verifyd" --listen="unix:$dir/d.sock" --admin_listen="unix:$dir/a.sock" \
    --metrics_address= --state_dir="$dir/state" --engine=cpu --probe=false \
    --keep_freed_mb="$1" >"$dir/log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do [ -S "$dir/d.sock" ] && return 0; sleep 0.1; done
  echo "verifyd did not start: $(cat "$dir/log")" >&2
  exit 1
}

: >"$dir/rows"
for r in $(seq "$rounds"); do
  for policy in default keep; do
    if [ $policy = default ]; then
      start_daemon 0
      env=(MALLOC_MMAP_MAX_=65536 MALLOC_TRIM_THRESHOLD_=131072)  # glibc's defaults, in verifyctl
    else
      start_daemon 2047
      env=()
    fi
    for shape in "${shapes[@]}"; do
      env "${env[@]}" "$build/src/cli/verifyctl" --json --target "unix:$dir/d.sock" send \
        --shape "$shape" --count "$calls" --distinct "$calls" --seed "$r" >"$dir/one.json"
      python3 - "$policy" "$r" "$dir/one.json" >>"$dir/rows" <<'PY'
import json, sys
j = json.load(open(sys.argv[3]))
print(json.dumps({"policy": sys.argv[1], "round": int(sys.argv[2]), **j}))
PY
    done
  done
done

python3 - "$dir/rows" "$out" "$commit" "$calls" "${shapes[@]}" <<'PY'
import json, os, platform, statistics, sys, time
rows_path, out, commit, calls, shapes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
rows = [json.loads(l) for l in open(rows_path)]
def memcpy_seconds(n):
    a, b = bytearray(n), bytearray(n)
    ts = []
    for _ in range(20):
        t = time.perf_counter(); b[:] = a; ts.append(time.perf_counter() - t)
    return statistics.median(ts)
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
           platform.machine())
table, doc = [], {"commit": commit, "device": cpu, "engine": "cpu", "calls_per_round": int(calls),
                  "rows": []}
for shape in shapes:
    mine = [r for r in rows if r["shape"] == shape]
    nbytes = mine[0]["bundle_bytes"]
    mc = memcpy_seconds(nbytes)
    med = {}
    for policy in ("default", "keep"):
        rs = [r for r in mine if r["policy"] == policy]
        stage = lambda k: statistics.median(r["server_stage_seconds_p50"][k] for r in rs)
        m = {"p50_ms": statistics.median(r["latency_seconds"]["p50"] for r in rs) * 1e3,
             "p99_ms": statistics.median(r["latency_seconds"]["p99"] for r in rs) * 1e3,
             "parse_ms": stage("parse") * 1e3, "prepare_ms": stage("prepare") * 1e3,
             "served_ms": stage("served_path") * 1e3,
             "encode_ms": statistics.median(r["client_encode_seconds"] for r in rs) * 1e3,
             "rounds": len(rs)}
        m["transport_ms"] = m["p50_ms"] - m["served_ms"]
        m["gbps"] = nbytes / (m["transport_ms"] / 1e3) / 1e9
        med[policy] = m
        doc["rows"].append({"shape": shape, "bytes": nbytes, "policy": policy,
                            "memcpy_ms": mc * 1e3, **m})
    for policy in ("default", "keep"):
        m = med[policy]
        table.append(f"| {shape} | {nbytes / 1e6:.1f} | {policy} | {m['p50_ms']:.1f} | "
                     f"{m['p99_ms']:.1f} | {m['parse_ms']:.2f} | {m['prepare_ms']:.2f} | "
                     f"{m['encode_ms']:.2f} | {m['served_ms']:.2f} | {m['transport_ms']:.1f} | "
                     f"{m['gbps']:.2f} | {mc * 1e3:.2f} ({nbytes / mc / 1e9:.1f} GB/s) | "
                     f"{100 * (nbytes / (m['transport_ms'] / 1e3)) / (nbytes / mc):.1f}% |")
    d, k = med["default"], med["keep"]
    table.append(f"| {shape} | | keep / default | {k['p50_ms'] / d['p50_ms']:.2f}x | | "
                 f"{k['parse_ms'] / d['parse_ms']:.2f}x | {k['prepare_ms'] / d['prepare_ms']:.2f}x | "
                 f"| | {k['transport_ms'] / d['transport_ms']:.2f}x | | | |")
md = [f"# Inline transport: glibc's malloc defaults vs --keep_freed_mb", "",
      f"commit `{commit}`, {time.strftime('%Y-%m-%d')}, {cpu}; CPU engine, `verifyctl send` over "
      f"a Unix socket (another process), {calls} distinct bundles per round, rounds alternating "
      f"(medians over rounds of each round's p50). default: `--keep_freed_mb=0` and verifyctl "
      f"with glibc's defaults (MALLOC_MMAP_MAX_/MALLOC_TRIM_THRESHOLD_); keep: both as shipped. "
      f"transport = p50 - served path (everything but the attention); vs memcpy = its bandwidth "
      f"over one host memcpy of the bundle.", "",
      "| shape B,T,H,prefix | MB | malloc | p50 ms | p99 ms | parse ms | prepare ms | "
      "client encode ms | served path ms | transport ms | transport GB/s | memcpy ms | vs memcpy |",
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"] + table
name = os.path.join(out, f"malloc-policy-{commit}")
open(name + ".md", "w").write("\n".join(md) + "\n")
json.dump(doc, open(name + ".json", "w"), indent=1)
print("\n".join(md))
PY
