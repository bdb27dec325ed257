#!/usr/bin/env python3
"""Serving the custom kernel inside the serving process, against the stack's own attention
(FlashMLA's dense decode) and against verifyd's doorbell, in one torch process on the GPU.

A captured step of LAYERS layers, each a stand-in GEMM ([B*T, 7168] x [7168, 2048], bf16) and one
attention over the same paged KV (page 64, a causal draft block, the shapes of the doorbell's
benchmark). Per shape, medians of REPS replays of each step:

- ``step_ms_without``: the GEMMs alone;
- ``step_ms_stack``: the stack's attention, FlashMLA (its output copied into the layer's o);
- ``step_ms_op``: the op (libverifyd_kernel.so, VerifyKernel) called directly, its checks in
  kernels of their own around the kernel (VERIFYD_OP_CHECKS=separate);
  ``step_ms_op_kernel_checks``: the same with the checks inside the kernel (the default);
- ``step_ms_inprocess``: the op under the switch (Switch.step: one IF/ELSE node a step, the
  stack's attention as each layer's fallback), mode op; ``step_ms_switch_stack``: the same step
  in mode stack; ``step_ms_inprocess_kernel_checks``: mode op with the kernel-checks op;
- ``step_ms_inprocess_redo`` / ``step_ms_switch_stack_redo``: the kernel-checks op under
  Switch.step(redo=True) (one IF/ELSE node a step and no fallback node a layer: a step the op
  failed is redone by the stack), mode op and mode stack;
- ``step_ms_doorbell``: each layer a doorbell call to verifyd (CUDA engine) in custom mode.

and from a profile of the op's step, the custom kernel's own device time a call, its checks',
and FlashMLA's. Derived: ``per_call_overhead_us`` = the op's step over the GEMMs, a layer, minus
the kernel's own time (the op's checks and launch gaps), and ``..._kernel_checks`` the same for
the kernel-checks op (over the same kernel time: the kernel without checks of its own);
``switch_cost_us`` = mode stack over
FlashMLA called directly, a layer (the path not taken); ``switch_cost_us_mode_op`` = mode op over
the op called directly; ``custom_over_direct`` = step_ms_inprocess / step_ms_op; the ``_redo``
twins of the last three for the redo switch (over the kernel-checks op called directly).

Every path's output in each shape is checked against fp32 torch attention over the same pages
(rel-L2 < 1e-2). Then, under the same verifyd controlling a Switch (a switch channel): the
replays from a flip to custom until the op serves, from a rollback until the stack does, and with
verifyd SIGSTOPped, the time until the stack serves (the lease).

    VERIFYD_CLIENT_GEN=... VERIFYD_KERNEL_LIB=... VERIFYD_BIN=.../verifyd \\
        python3 bench/inprocess_bench.py --flashmla .../flashmla_dense.so --mps 0 --out rows.json
Appends one JSON row per shape, and one of the control measurements, to --out;
``inprocess_report.py ROWS COMMIT`` prints their markdown table.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.normpath(os.path.join(HERE, "..", "clients", "python")),
                os.path.normpath(os.path.join(HERE, "..", "tests", "python")),
                os.path.join(HERE, "flashmla_peer")]

import torch  # noqa: E402

import cuda_timing  # noqa: E402

from flashmla_peer import FlashMLADense  # noqa: E402
from verifyd_client import AdminClient, VerifyClient  # noqa: E402
from verifyd_client.kernel_op import VerifyKernel  # noqa: E402
from verifyd_client.switch import Switch  # noqa: E402
from verifyd_daemon import Daemon  # noqa: E402

SHAPES = [(1, 16, 16, 4096), (8, 16, 16, 4096), (32, 8, 16, 2048), (64, 4, 16, 8192)]
PAGE = 64
SCALE = 0.1352


def median_ms(graph, reps):
    return cuda_timing.median_ms(graph.replay, reps, warmup=3)


class Shape:
    """One shape's tensors: a paged pool read through a block table (FlashMLA) and through
    kv_indptr/kv_indices (the op and verifyd), the same pages either way."""

    def __init__(self, shape, gen):
        b, t, h, prefix = shape
        dev = "cuda"
        self.b, self.t, self.h, self.prefix = b, t, h, prefix
        per = -(-(prefix + t) // PAGE)
        pages = b * per + 8
        self.pool = (torch.randn(pages, PAGE, 576, generator=gen, device=dev) * 0.5).to(
            torch.bfloat16)
        self.lens = torch.full((b,), prefix + t, dtype=torch.int32, device=dev)
        self.table = torch.randperm(pages, generator=gen, device=dev)[:b * per].to(
            torch.int32).view(b, per)
        self.indices = self.table.reshape(-1).contiguous()
        self.indptr = torch.arange(0, (b + 1) * per, per, dtype=torch.int32, device=dev)
        self.mask = torch.tril(torch.ones(b, t, t, dtype=torch.uint8, device=dev))
        self.q = torch.randn(b * t, h, 576, generator=gen, device=dev).to(torch.bfloat16)
        self.x = torch.randn(b * t, 7168, generator=gen, device=dev).to(torch.bfloat16)
        self.w = (torch.randn(7168, 2048, generator=gen, device=dev) * 0.01).to(torch.bfloat16)
        self.y = torch.empty(b * t, 2048, dtype=torch.bfloat16, device=dev)

    def op(self, checks="separate"):
        """The op, its checks where ``checks`` says (VERIFYD_OP_CHECKS when it is made)."""
        os.environ["VERIFYD_OP_CHECKS"] = checks
        try:
            return VerifyKernel(self.b, self.t, self.h, PAGE, self.pool.shape[0],
                                self.indices.numel(), self.prefix + self.t, sm_scale=SCALE)
        finally:
            os.environ.pop("VERIFYD_OP_CHECKS", None)

    def op_args(self, op):
        return (op, self.q, self.pool, self.indptr, self.indices, self.lens, self.mask)

    def reference(self):
        """fp32 attention of every request: its prefix, then its draft block causally."""
        out = torch.empty(self.b * self.t, self.h, 512, device="cuda")
        n = self.prefix + self.t
        for r in range(self.b):
            kv = self.pool[self.table[r].long()].reshape(-1, 576)[:n].float()
            q = self.q[r * self.t:(r + 1) * self.t].float()  # [T, H, 576]
            s = torch.einsum("thd,ld->htl", q, kv) * SCALE
            j = torch.arange(n, device="cuda")
            allow = j[None, :] < self.prefix + 1 + torch.arange(self.t, device="cuda")[:, None]
            s = s.masked_fill(~allow[None], float("-inf"))
            out[r * self.t:(r + 1) * self.t] = torch.einsum("htl,ld->thd", s.softmax(-1),
                                                            kv[:, :512])
        return out


def rel_l2(got, want):
    return float((got.float() - want).norm() / want.norm())


def capture(body, stream):
    body()  # warm-up on the capture stream
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        body()
    return g


def bench_shape(args, shape, peer, client, admin, failures):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(34)
    s = Shape(shape, gen)
    layers = args.layers
    stream = torch.cuda.Stream()
    want = s.reference()
    o = torch.zeros(s.b * s.t, s.h, 512, dtype=torch.bfloat16, device="cuda")
    fm = peer.call(s.q.view(s.b, s.t, s.h, 576), s.pool, s.table, s.lens, SCALE)
    with torch.cuda.stream(stream):
        fm()  # fills FlashMLA's scheduler metadata, outside any capture
    stream.synchronize()

    def flashmla():
        o.copy_(fm()[0].view(s.b * s.t, s.h, 512))

    op = s.op()
    args_op = s.op_args(op)
    row = {"shape": list(shape), "layers": layers, "page_size": PAGE, "mps": bool(args.mps),
           "device": torch.cuda.get_device_name()}

    def checked(name):
        torch.cuda.synchronize()
        err = rel_l2(o, want)
        row[f"rel_l2_{name}"] = err
        if not err < 1e-2:
            failures.append(f"{shape} {name}: o rel-L2 to fp32 torch {err:.2e}")

    def gemm():
        torch.matmul(s.x, s.w, out=s.y)

    graphs = {}
    graphs["without"] = capture(lambda: [gemm() for _ in range(layers)], stream)

    def with_stack():
        for _ in range(layers):
            gemm()
            flashmla()
    o.zero_()
    graphs["stack"] = capture(with_stack, stream)
    checked("stack")

    def with_op(the_args):
        def body():
            for _ in range(layers):
                gemm()
                the_args[0].attend(*the_args[1:], o)
        return body

    op_k = s.op("kernel")
    args_k = s.op_args(op_k)
    for name, the_args in (("op", args_op), ("op_kernel_checks", args_k)):
        o.zero_()
        graphs[name] = capture(with_op(the_args), stream)
        checked(name)

    def switched(the_sw, the_args, redo=False):
        def body():
            def forward():
                for i in range(layers):
                    gemm()
                    the_sw.attend(i, flashmla, *the_args, o)
            the_sw.step(forward, redo=redo)
        return body

    sw = Switch(layers, conditional=None)
    sw_k = Switch(layers, conditional=None)
    sw_r = Switch(layers, conditional=None)
    for a_sw in (sw, sw_k, sw_r):
        a_sw.set_mode("op")
    o.zero_()
    graphs["switch"] = capture(switched(sw, args_op), stream)
    graphs["switch_kernel_checks"] = capture(switched(sw_k, args_k), stream)
    graphs["switch_redo"] = capture(switched(sw_r, args_k, redo=True), stream)
    row["switch_conditional"] = sw.conditional

    for name in ("without", "stack", "op", "op_kernel_checks"):
        row[f"step_ms_{name}"] = median_ms(graphs[name], args.reps)
    sw.set_mode("op")
    o.zero_()
    row["step_ms_inprocess"] = median_ms(graphs["switch"], args.reps)
    checked("inprocess")
    if bool(sw.layer_failed.any().item()):
        failures.append(f"{shape}: mode op, a layer served by the stack")
    o.zero_()
    row["step_ms_inprocess_kernel_checks"] = median_ms(graphs["switch_kernel_checks"], args.reps)
    checked("inprocess_kernel_checks")
    if bool(sw_k.layer_failed.any().item()):
        failures.append(f"{shape}: mode op, checks in the kernel, a layer served by the stack")
    o.zero_()
    row["step_ms_inprocess_redo"] = median_ms(graphs["switch_redo"], args.reps)
    checked("inprocess_redo")
    if bool(sw_r.layer_failed.any().item()):
        failures.append(f"{shape}: mode op, the redo switch, a layer served by the stack")
    sw.set_mode("stack")
    o.zero_()
    row["step_ms_switch_stack"] = median_ms(graphs["switch"], args.reps)
    checked("switch_stack")
    sw_r.set_mode("stack")
    o.zero_()
    row["step_ms_switch_stack_redo"] = median_ms(graphs["switch_redo"], args.reps)
    checked("switch_stack_redo")

    k_op = cuda_timing.device_us(graphs["op"].replay, layers)
    k_stack = cuda_timing.device_us(graphs["stack"].replay, layers)
    row["kernel_us"] = k_op["custom"]
    row["checks_us"] = k_op["checks"]
    row["flashmla_kernel_us"] = k_stack["flashmla"]
    per_layer = lambda a, b: (row[a] - row[b]) * 1e3 / layers  # noqa: E731
    row["per_call_overhead_us"] = per_layer("step_ms_op", "step_ms_without") - row["kernel_us"]
    row["kernel_checks_kernel_us"] = cuda_timing.device_us(graphs["op_kernel_checks"].replay,
                                                           layers)["custom"]
    row["per_call_overhead_us_kernel_checks"] = (
        per_layer("step_ms_op_kernel_checks", "step_ms_without") - row["kernel_us"])
    row["inprocess_overhead_us_kernel_checks"] = (
        per_layer("step_ms_inprocess_kernel_checks", "step_ms_without") - row["kernel_us"])
    row["inprocess_overhead_us"] = (per_layer("step_ms_inprocess", "step_ms_without")
                                    - row["kernel_us"])
    row["switch_cost_us"] = per_layer("step_ms_switch_stack", "step_ms_stack")
    row["switch_cost_us_mode_op"] = per_layer("step_ms_inprocess", "step_ms_op")
    row["custom_over_direct"] = row["step_ms_inprocess"] / row["step_ms_op"]
    row["inprocess_over_stack"] = row["step_ms_inprocess"] / row["step_ms_stack"]
    row["switch_cost_us_redo"] = per_layer("step_ms_switch_stack_redo", "step_ms_stack")
    row["switch_cost_us_mode_op_redo"] = per_layer("step_ms_inprocess_redo",
                                                   "step_ms_op_kernel_checks")
    row["custom_over_direct_redo"] = (row["step_ms_inprocess_redo"]
                                      / row["step_ms_op_kernel_checks"])
    sw.close()
    sw_k.close()
    sw_r.close()
    op_k.close()

    if client is not None:
        admin.flip("custom", "in-process benchmark", force=True)
        step = client.verify_step([s.pool] * layers, s.b, s.t, s.h, int(s.indices.numel()), SCALE)
        q2 = s.q.view(s.b * s.t, s.h * 576)
        o2 = o.view(s.b * s.t, s.h * 512)

        def with_doorbell():
            step.set_layout(s.indptr, s.indices, s.lens, s.mask)
            for i in range(layers):
                gemm()
                step.attend(i, q2, o2)
        o.zero_()
        graphs["doorbell"] = capture(with_doorbell, stream)
        row["step_ms_doorbell"] = median_ms(graphs["doorbell"], args.reps)
        checked("doorbell")
        row["doorbell_kernel_us"] = step.channel.last_response().timing.served_device_seconds * 1e6
        row["doorbell_overhead_us"] = (per_layer("step_ms_doorbell", "step_ms_without")
                                       - row["doorbell_kernel_us"])
        step.channel.check()
        step.close()
        admin.flip("shadow", "in-process benchmark", force=True)
    op.close()
    return row


def control(args, client, admin, daemon, failures):
    """Flip, rollback and lease under verifyd, counted in replays of a 61-layer step."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(35)
    s = Shape((8, 16, 16, 4096), gen)
    op = s.op()
    o = torch.zeros(s.b * s.t, s.h, 512, dtype=torch.bfloat16, device="cuda")
    stack_o = torch.zeros_like(o)

    def stack_fn():
        o.copy_(stack_o)

    sw = Switch(args.layers, client=client, model="inprocess-bench", lease_ms=args.lease_ms)
    stream = torch.cuda.Stream()

    def step():
        def forward():
            for i in range(args.layers):
                torch.matmul(s.x, s.w, out=s.y)
                sw.attend(i, stack_fn, *s.op_args(op), o)
        sw.step(forward)
    g = capture(step, stream)

    def served_by_stack():
        g.replay()
        torch.cuda.synchronize()
        return bool(sw.layer_failed[0].item())

    def replays_until(stack, limit_s=5.0):
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < limit_s:
            n += 1
            if served_by_stack() == stack:
                return n, (time.monotonic() - t0) * 1e3
        return None, None

    row = {"control": True, "mps": bool(args.mps), "lease_ms": args.lease_ms,
           "device": torch.cuda.get_device_name()}
    if not served_by_stack():
        failures.append("control: shadow, but the op served")
    admin.flip("custom", "in-process benchmark", force=True)
    row["flip_to_effect_steps"], row["flip_to_effect_ms"] = replays_until(False)
    admin.rollback("in-process benchmark")
    row["rollback_to_effect_steps"], row["rollback_to_effect_ms"] = replays_until(True)
    admin.flip("custom", "in-process benchmark", force=True)
    replays_until(False)
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        times, t0, fallback = [], time.monotonic(), None
        while time.monotonic() - t0 < 4 * args.lease_ms / 1e3 and fallback is None:
            a = time.monotonic()
            if served_by_stack():
                fallback = (time.monotonic() - t0) * 1e3
            times.append((time.monotonic() - a) * 1e3)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    row["lease_fallback_ms"] = fallback
    row["step_ms_max_while_stopped"] = max(times)
    row["step_ms_median_while_stopped"] = statistics.median(times)
    if fallback is None or fallback > 2 * args.lease_ms:
        failures.append(f"control: lease fallback {fallback} ms (lease {args.lease_ms} ms)")
    for k in ("flip_to_effect_steps", "rollback_to_effect_steps"):
        if row[k] is None:
            failures.append(f"control: {k} never")
    admin.flip("shadow", "in-process benchmark done", force=True)
    sw.close()
    op.close()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flashmla", required=True, help="flashmla_dense.so (bench/flashmla_peer)")
    ap.add_argument("--mps", type=int, default=0)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--lease_ms", type=int, default=400)
    ap.add_argument("--no_verifyd", action="store_true", help="skip the doorbell and control")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    peer = FlashMLADense.load(args.flashmla)
    failures, rows = [], []
    daemon = client = admin = None
    if not args.no_verifyd:
        daemon = Daemon("--engine=cuda", "--shadow_threads=2", "--shadow_queue=1024")
        client = VerifyClient(daemon.data, transport="cuda_ipc", timeout=60)
        admin = AdminClient(daemon.admin)
    try:
        for shape in SHAPES:
            try:
                row = bench_shape(args, shape, peer, client, admin, failures)
            except Exception as e:  # noqa: BLE001 - one shape's failure is reported, not fatal
                row = {"shape": list(shape), "mps": bool(args.mps), "error": repr(e)}
                failures.append(f"{shape}: {e!r}")
            rows.append(row)
            print(json.dumps(row), flush=True)
        if daemon is not None:
            try:
                row = control(args, client, admin, daemon, failures)
            except Exception as e:  # noqa: BLE001
                row = {"control": True, "mps": bool(args.mps), "error": repr(e)}
                failures.append(f"control: {e!r}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for c in (admin, client):
            if c is not None:
                c.close()
        if daemon is not None:
            daemon.stop()
    rows.append({"failures": failures, "mps": bool(args.mps)})
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{len(failures)} checks failed: {failures}" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
