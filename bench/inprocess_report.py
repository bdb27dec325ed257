#!/usr/bin/env python3
"""The markdown table of bench/inprocess_bench.py's rows (both MPS settings), as bench/results
keeps it; needs no GPU and no torch:

    python3 bench/inprocess_report.py ROWS_JSON COMMIT > table.md
"""

import json
import sys


def report(rows_path, commit):
    """The markdown table of a run's rows (both MPS settings), as bench/results keeps it."""
    rows = [json.loads(line) for line in open(rows_path) if line.strip()]
    shapes = [r for r in rows if "step_ms_op" in r]
    controls = [r for r in rows if r.get("control") and "error" not in r]
    device = next((r["device"] for r in rows if "device" in r), "?")
    fmt = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    out = [f"# Serving the custom kernel in-process, against FlashMLA and the doorbell",
           "",
           f"`scripts/gpu_inprocess_bench.sh` at `{commit}` on {device}, one run. A captured "
           f"step of 61 layers (a stand-in GEMM and one attention a layer, page 64, causal "
           f"draft block), medians of 30 replays, ms. stack: FlashMLA's dense decode called "
           f"directly (its output copied into o); op: libverifyd_kernel.so called directly; "
           f"in-process: the op under the switch (Switch.step, mode op); doorbell: a verify call "
           f"to verifyd (CUDA engine, custom) a layer. Per layer, µs: overhead = the op's "
           f"step over the GEMMs minus the custom kernel's own device time; switch = mode "
           f"stack over FlashMLA direct (the path not taken); doorbell overhead likewise over "
           f"the kernel time verifyd reports. In the first columns the op's checks run in "
           f"kernels of their own around the kernel (VERIFYD_OP_CHECKS=separate); the last "
           f"three are the op with its checks inside the kernel (the default), called directly "
           f"and under the switch, and its overhead over the same kernel time.",
           "",
           "| MPS | B,T,H,prefix | GEMMs only | stack (FlashMLA) | op | in-process | "
           "switch, mode stack | doorbell | kernel µs | FlashMLA µs | op overhead µs | "
           "in-process overhead µs | switch µs | in-process / op | in-process / stack | "
           "doorbell overhead µs | op, checks in kernel | in-process, checks in kernel | "
           "op overhead µs, checks in kernel |",
           "|---|---|" + "---:|" * 17]
    for r in shapes:
        out.append("| " + " | ".join([
            "yes" if r["mps"] else "no", ",".join(map(str, r["shape"])),
            fmt(r["step_ms_without"]), fmt(r["step_ms_stack"]), fmt(r["step_ms_op"]),
            fmt(r["step_ms_inprocess"]), fmt(r["step_ms_switch_stack"]),
            fmt(r.get("step_ms_doorbell")), fmt(r["kernel_us"], 1),
            fmt(r["flashmla_kernel_us"], 1), fmt(r["per_call_overhead_us"], 2),
            fmt(r["inprocess_overhead_us"], 2), fmt(r["switch_cost_us"], 2),
            fmt(r["custom_over_direct"]), fmt(r["inprocess_over_stack"]),
            fmt(r.get("doorbell_overhead_us"), 1), fmt(r.get("step_ms_op_kernel_checks")),
            fmt(r.get("step_ms_inprocess_kernel_checks")),
            fmt(r.get("per_call_overhead_us_kernel_checks"), 2)]) + " |")
    redo = [r for r in shapes if "step_ms_inprocess_redo" in r]
    if redo:
        out += ["", "The switch with the redo step (`Switch.step(forward, redo=True)`: one IF/ELSE "
                "node a step and no fallback node a layer; a step the op failed is redone by the "
                "stack), the op's checks inside the kernel. ms a step; µs a layer: path not taken "
                "= mode stack over FlashMLA direct, mode op over the op called directly.", "",
                "| MPS | B,T,H,prefix | stack (FlashMLA) | op, checks in kernel | redo: mode op | "
                "redo: mode stack | path not taken µs | mode op over direct µs | "
                "mode op / op direct |", "|---|---|" + "---:|" * 7]
        for r in redo:
            out.append("| " + " | ".join([
                "yes" if r["mps"] else "no", ",".join(map(str, r["shape"])),
                fmt(r["step_ms_stack"]), fmt(r["step_ms_op_kernel_checks"]),
                fmt(r["step_ms_inprocess_redo"]), fmt(r["step_ms_switch_stack_redo"]),
                fmt(r["switch_cost_us_redo"], 2), fmt(r["switch_cost_us_mode_op_redo"], 2),
                fmt(r["custom_over_direct_redo"])]) + " |")
    out += ["", "Under verifyd's control (a switch channel, lease as given; B,T,H,prefix "
            "8,16,16,4096): replays from the flip's answer until the op served, from the "
            "rollback's until the stack did, and with verifyd SIGSTOPped, ms until the stack "
            "served and the slowest step meanwhile.", "",
            "| MPS | lease ms | flip → effect (replays, ms) | rollback → effect (replays, ms) | "
            "lease fallback ms | slowest step while stopped ms |", "|---|---:|---:|---:|---:|---:|"]
    for r in controls:
        out.append(f"| {'yes' if r['mps'] else 'no'} | {r['lease_ms']} | "
                   f"{r['flip_to_effect_steps']}, {fmt(r['flip_to_effect_ms'], 2)} | "
                   f"{r['rollback_to_effect_steps']}, {fmt(r['rollback_to_effect_ms'], 2)} | "
                   f"{fmt(r['lease_fallback_ms'], 1)} | {fmt(r['step_ms_max_while_stopped'], 2)} |")
    errors = [r for r in rows if "error" in r] + [
        {"error": f} for r in rows for f in r.get("failures", [])]
    if errors:
        out += ["", "Failures:", ""] + [f"- {e.get('shape', '')} {e['error']}" for e in errors]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(report(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "unknown"))
