#!/usr/bin/env bash
# Service-level benchmark on the GPU machine: verifyd --engine=cuda driven by `verifyctl send`
# (another process) through each transport (inline bytes, a POSIX shm region, a CUDA IPC region
# of verifyctl's own GPU memory) at concurrency 1 and 8 on two shapes, in reference and in shadow
# mode. Also measures one host memcpy of each bundle's bytes on the same machine. Writes
# service-<commit>.{md,json} into OUT_DIR; per row: p50/p99, the served path's own time on the
# GPU, overhead = p50 - that time, and shadow's added p50.
#
#   gpu_service_bench.sh PACK_DIR OUT_DIR [COUNT]
#   TRANSPORTS="inline inline+message shm cuda_ipc cuda_ipc+stream cuda_ipc+channel
#   cuda_ipc+channel+resident inline+channel" (the default; inline unary calls send q and the pool
#   from the client's memory, "+message" copies them into the message first as the generated stub
#   does; "+stream" sends on one bidirectional stream per worker instead of unary calls,
#   "+channel" through one call channel per worker: no gRPC call per verify; "+resident": each
#   worker writes its bundle into its region once, so calls come back to back; "+e4m3": the pool
#   in e4m3 at kv_scale 0.37, e.g. TRANSPORTS="cuda_ipc+channel+resident cuda_ipc+channel+resident+e4m3")
#   DAEMON_FLAGS="--cuda_sync_spin_us=0 ..." (extra verifyd flags, for A/B runs)
set -uo pipefail
PACK=$1 OUT=$2 COUNT=${3:-300}
bin=$PACK/bin
dir=$(mktemp -d)
commit=$(cat "$PACK/COMMIT" 2>/dev/null || echo unknown)
shapes=("4,16,8,4096" "1,64,16,8192")
results=$OUT/service.jsonl
METRICS_PORT=${METRICS_PORT:-9477}
: > "$results"

start_daemon() {  # [ENGINE]
  rm -rf "$dir/state"
  "$bin/verifyd" --engine="${1:-cuda}" --listen="unix:$dir/verifyd.sock" --admin_listen="unix:$dir/admin.sock" \
    --metrics_address=127.0.0.1:$METRICS_PORT --state_dir="$dir/state" --capture_dir=off \
    --shadow_threads=2 --shadow_queue=256 --log_level=warn ${DAEMON_FLAGS:-} \
    >> "$OUT/service_daemon.log" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do [ -S "$dir/admin.sock" ] && return 0; sleep 0.1; done  # after the start-up probe
  echo "verifyd did not start"; cat "$OUT/service_daemon.log"; return 1
}
ctl() { "$bin/verifyctl" --target="unix:$dir/verifyd.sock" --admin="unix:$dir/admin.sock" "$@"; }
record() {  # MODE REP TRANSPORT: appends $dir/one.json, labelled, to the results
  python3 -c "import json,sys; j=json.load(open(sys.argv[1])); j['mode']=sys.argv[2]; j['rep']=int(sys.argv[3]); j['transport']=sys.argv[4]; print(json.dumps(j))" \
    "$dir/one.json" "$1" "$2" "$3" >> "$results"
}
# The per-call floor: the smallest call (1,1,1,16: a few KB of refs and indices, next to no
# attention) through a shm region, unary and on a stream, in reference mode: what gRPC and the
# daemon cost per call on this host when there is nothing to move. ENGINE labels the rows.
floor_rows() {  # ENGINE
  for how in "" --stream --channel; do
    ctl send --transport shm $how --shape 1,1,1,16 --page_size 16 --count 100 > /dev/null
    ctl send --transport shm $how --shape 1,1,1,16 --page_size 16 --count "$((COUNT * 10))" \
      --json > "$dir/one.json" || echo "send failed: floor $1 $how: $(tail -c 300 "$dir/one.json")"
    record reference 1 "floor: $1, shm${how:++${how#--}}"
  done
}

start_daemon || exit 1
# Reference and shadow alternate, twice per configuration, so that drift hits both alike.
for transport in ${TRANSPORTS:-inline inline+message shm cuda_ipc cuda_ipc+stream cuda_ipc+channel cuda_ipc+channel+resident inline+channel}; do
  how=(--transport "${transport%%+*}")
  [[ $transport == *+message* ]] && how+=(--inline_encode message)
  [[ $transport == *+stream* ]] && how+=(--stream)
  [[ $transport == *+channel* ]] && how+=(--channel)
  [[ $transport == *+resident* ]] && how+=(--resident)
  [[ $transport == *+e4m3* ]] && how+=(--kv_dtype e4m3 --kv_scale 0.37)
  for shape in "${shapes[@]}"; do
    for conc in 1 8; do
      for rep in 1 2; do
        for mode in reference shadow; do
          ctl flip "$mode" --reason "service bench" > /dev/null || { echo "flip $mode failed"; exit 1; }
          ctl send "${how[@]}" --shape "$shape" --page_size 64 --count 20 \
            --concurrency "$conc" > /dev/null
          ctl send "${how[@]}" --shape "$shape" --page_size 64 --count "$COUNT" \
            --concurrency "$conc" --json > "$dir/one.json" ||
            echo "send failed: $transport $mode $shape $conc: $(tail -c 300 "$dir/one.json")"
          record "$mode" "$rep" "$transport"
        done
      done
    done
  done
done
# One host memcpy of each shape's bundle bytes (median of 20, after 3 warm-ups): the yardstick of
# the shm target (overhead <= 2x this) and of the inline one (>= 50% of this bandwidth).
python3 - "$results" > "$OUT/memcpy.json" <<'PY'
import json, sys, time
import numpy as np
sizes = {}
for l in open(sys.argv[1]):
    if l.strip():
        r = json.loads(l)
        sizes[r["shape"]] = r["bundle_bytes"]
out = {}
for shape, n in sizes.items():
    a = np.random.randint(0, 255, n, dtype=np.uint8)
    b = np.empty_like(a)
    ts = []
    for i in range(23):
        t = time.perf_counter(); np.copyto(b, a); ts.append(time.perf_counter() - t)
    ts = sorted(ts[3:])
    med = ts[len(ts) // 2]
    out[shape] = {"bytes": n, "seconds": med, "gb_per_s": n / med / 1e9}
print(json.dumps(out))
PY
# Appends the finite check's and the custom path's histogram sums and counts to finite_check.jsonl.
scrape_check() {
  python3 - "$METRICS_PORT" "$1" "$OUT/finite_check.jsonl" "$2" <<'PY'
import json, re, sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode()
def val(name):
    m = re.search(r"^" + re.escape(name) + r" ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0
row = {"shape": sys.argv[2], "phase": sys.argv[4],
       "check_sum": val("verifyd_finite_check_seconds_sum"),
       "check_count": val("verifyd_finite_check_seconds_count"),
       "custom_sum": val('verifyd_path_duration_seconds_sum{path="custom"}'),
       "custom_count": val('verifyd_path_duration_seconds_count{path="custom"}')}
open(sys.argv[3], "a").write(json.dumps(row) + "\n")
PY
}
# The NaN/Inf check of a served custom output, in custom mode: its mean time (the
# verifyd_finite_check_seconds histogram) against the served custom path's mean time, which
# includes it (verifyd_path_duration_seconds{path="custom"}), per shape at concurrency 1.
ctl flip custom --force --reason "service bench: finite check" > /dev/null || echo "flip custom failed"
for shape in ${FINITE_CHECK_SHAPES-${shapes[@]}}; do
  ctl send --shape "$shape" --page_size 64 --count 20 > /dev/null
  scrape_check "$shape" before
  ctl send --shape "$shape" --page_size 64 --count "$COUNT" --concurrency 1 > /dev/null
  scrape_check "$shape" after
done
ctl flip reference --reason "service bench: floor" > /dev/null || echo "flip reference failed"
floor_rows cuda
ctl status > "$OUT/service_status.txt"
kill "$pid"; wait "$pid" 2>/dev/null
# The same floor on the CPU engine: the GPU's share of the CUDA engine's floor.
if start_daemon cpu; then
  floor_rows cpu
  kill "$pid"; wait "$pid" 2>/dev/null
fi

python3 - "$results" "$OUT" "$commit" <<'PY'
import json, os, sys, datetime, subprocess
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
# One row per (transport, mode, shape, concurrency): the mean over the alternating repetitions.
rows, groups = [], {}
for r in runs:
    r.setdefault("transport", "inline")
    groups.setdefault((r["transport"], r["mode"], r["shape"], r["concurrency"]), []).append(r)
def mean(xs):
    return sum(xs) / len(xs)
for (transport, mode, shape, conc), rs in groups.items():
    row = dict(rs[0])
    row["reps"] = len(rs)
    row["calls_per_second"] = mean([r["calls_per_second"] for r in rs])
    row["latency_seconds"] = {k: mean([r["latency_seconds"][k] for r in rs]) for k in ("p50", "p90", "p99", "max")}
    row["server_seconds_p50"] = mean([r["server_seconds_p50"] for r in rs])
    row["client_encode_seconds"] = mean([r.get("client_encode_seconds", 0.0) for r in rs])
    row["server_stage_seconds_p50"] = {k: mean([r["server_stage_seconds_p50"][k] for r in rs])
                                       for k in rs[0]["server_stage_seconds_p50"]}
    rows.append(row)
order = {"inline": 0, "inline+message": 1, "inline+channel": 2, "shm": 3, "cuda_ipc": 4,
         "cuda_ipc+stream": 5, "cuda_ipc+channel": 6, "cuda_ipc+channel+resident": 7}  # then the floor rows
rows.sort(key=lambda r: (order.get(r["transport"], 9), r["shape"], r["concurrency"], r["mode"] != "reference"))
try:
    memcpy = json.load(open(f"{sys.argv[2]}/memcpy.json"))
except (OSError, ValueError):
    memcpy = {}
out, commit = sys.argv[2], sys.argv[3]
try:
    device = subprocess.check_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]).decode().strip()
except Exception:
    device = "unknown"
base = {(r["transport"], r["shape"], r["concurrency"]): r for r in rows if r["mode"] == "reference"}
lines = [f"# verifyd service benchmark on {device}", "",
         f"commit `{commit}`, {datetime.date.today()}; verifyd flags beyond the defaults: "
         f"`{os.environ.get('DAEMON_FLAGS') or 'none'}`; `verifyctl send` (another process) over a Unix "
         "socket, page size 64, CUDA engine; latency is client-side, stages are server-side p50; "
         "overhead = p50 - the served path's own work (its kernels' time between CUDA events: the "
         "attention itself; tables before 2026-12-01's second run subtracted the host's time to "
         "start the path instead); each row is the mean of two runs, reference and shadow "
         "alternating. Bundle bytes: what inline carries (shm and cuda_ipc carry refs; cuda_ipc "
         "sends the index tensors inline). inline: q and the pool sent from verifyctl's memory "
         "around the rest of the message; +message: copied into the message first, as the "
         "generated stub sends it. +stream: one gRPC stream per worker; +channel: one "
         "call channel per worker (shared memory and a futex doorbell, no gRPC call per verify); "
         "+resident: each worker writes its bundle into its region once and calls with it every "
         "time (a stack whose KV pool stays resident), so calls come back to back; without it a "
         "worker writes its bundle (10-20 MB) before each call.", "",
         "Host memcpy of one bundle on this machine (median of 20): " +
         ", ".join(f"{k}: {v['bytes']/1e6:.1f} MB in {v['seconds']*1e3:.2f} ms ({v['gb_per_s']:.1f} GB/s)"
                   for k, v in memcpy.items()), "",
         "Where the time goes: client encode (inline: the request's pieces made once, +message: the "
         "message serialized once; timed by verifyctl), "
         "parse (the server parsing the message), decode (checks), prepare (inputs onto the GPU), "
         "served path (the host's time to start it), fetch/deliver (the output back, waiting for "
         "the GPU), and the rest of p50: the transport (gRPC's framing and the socket, or the "
         "channel's doorbell) and the client's receive. The floor rows: the smallest call "
         "(1,1,1,16, page 16) through a shm region in reference mode on the CUDA and on the CPU "
         "engine, 10x the calls: the transport's and the daemon's own cost per call on this host.", "",
         "| transport | mode | shape B,T,H,prefix | conc | MB/call | calls/s | p50 ms | p99 ms | served path ms | its own work ms | overhead ms | shadow adds to p50 | client encode ms | parse ms | decode ms | prepare ms | fetch/deliver ms | transport ms | end-to-end GB/s | vs memcpy |",
         "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
for r in rows:
    lat, st = r["latency_seconds"], r["server_stage_seconds_p50"]
    add = ""
    if r["mode"] == "shadow":
        b = base.get((r["transport"], r["shape"], r["concurrency"]))
        if b:
            add = f"{100 * (lat['p50'] / b['latency_seconds']['p50'] - 1):+.1f}%"
    own = st.get("served_device", 0.0) or st["served_path"]
    overhead = lat["p50"] - own
    r["overhead_seconds_p50"] = overhead
    mc = memcpy.get(r["shape"])
    gbps = r["bundle_bytes"] / lat["p50"] / 1e9
    vs = ""
    if mc and not r["transport"].startswith("floor"):
        vs = (f"{100 * gbps / mc['gb_per_s']:.0f}% of bw" if r["transport"].startswith("inline")
              else f"{overhead / mc['seconds']:.2f}x memcpy time")
    encode = (r.get("client_encode_seconds", 0.0) if r["transport"].startswith("inline")
              else 0.0)
    parse = st.get("parse", 0.0)
    rest = lat["p50"] - r["server_seconds_p50"] - parse - encode
    lines.append(f"| {r['transport']} | {r['mode']} | {r['shape']} | {r['concurrency']} | {r['bundle_bytes']/1e6:.1f} | "
                 f"{r['calls_per_second']:.1f} | {lat['p50']*1e3:.3f} | {lat['p99']*1e3:.3f} | "
                 f"{st['served_path']*1e3:.3f} | {own*1e3:.3f} | {overhead*1e3:.3f} | {add} | "
                 f"{encode*1e3:.3f} | {parse*1e3:.3f} | "
                 f"{st['decode']*1e3:.3f} | {st['prepare']*1e3:.3f} | {st['fetch']*1e3:.3f} | "
                 f"{rest*1e3:.3f} | {gbps:.2f} | {vs} |")
fc_rows = []
try:
    fc = [json.loads(l) for l in open(f"{out}/finite_check.jsonl") if l.strip()]
except OSError:
    fc = []
for b, a in zip(fc[0::2], fc[1::2]):
    n = a["check_count"] - b["check_count"]
    m = a["custom_count"] - b["custom_count"]
    if n > 0 and m > 0:
        check = (a["check_sum"] - b["check_sum"]) / n
        served = (a["custom_sum"] - b["custom_sum"]) / m
        fc_rows.append({"shape": a["shape"], "calls": int(n), "check_ms": check * 1e3,
                        "served_custom_ms": served * 1e3, "share": check / served})
if fc_rows:
    lines += ["", "NaN/Inf check of the served custom output (custom mode, concurrency 1; means):", "",
              "| shape | calls | check ms | served custom path ms (incl. check) | check share |",
              "|---|---:|---:|---:|---:|"]
    for r in fc_rows:
        lines.append(f"| {r['shape']} | {r['calls']} | {r['check_ms']:.4f} | "
                     f"{r['served_custom_ms']:.4f} | {100 * r['share']:.2f}% |")
md = "\n".join(lines) + "\n"
open(f"{out}/service-{commit}.md", "w").write(md)
json.dump({"device": device, "commit": commit, "date": str(datetime.date.today()),
           "daemon_flags": os.environ.get("DAEMON_FLAGS", ""), "rows": rows,
           "memcpy": memcpy,
           "finite_check": fc_rows,
           "runs": runs},
          open(f"{out}/service-{commit}.json", "w"), indent=1)
print(md)
PY
