#!/usr/bin/env python3
"""bench/inprocess_report.py on a real run's rows (bench/results, H100): one table row per shape and
MPS setting, the control table, and the redo switch's table only where the rows measured it. No
GPU needed.

    inprocess_report_test.py
"""

import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import inprocess_report  # noqa: E402

RUN = os.path.join(ROOT, "bench", "results", "2026-12-08-6aa91a5f9c11-h100-inprocess.json")
failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures.append(what)


def main():
    rows = [json.loads(line) for line in open(RUN) if line.strip()]
    md = inprocess_report.report(RUN, "abc123")
    lines = md.splitlines()
    shape_rows = [x for x in lines if x.startswith("| no | ") or x.startswith("| yes | ")]
    n_shapes = sum("step_ms_op" in r for r in rows)
    n_controls = sum(bool(r.get("control")) for r in rows)
    check(n_shapes == 8, f"the run has 8 shape rows (4 shapes, MPS off and on): {n_shapes}")
    check(len(shape_rows) == n_shapes + n_controls,
          f"one table row per shape row and control row: {len(shape_rows)}")
    check("`abc123`" in md, "the commit is named")
    check("redo" not in md, "no redo table for rows that did not measure it")
    first = next(r for r in rows if "step_ms_op" in r)
    want = f"| {'yes' if first['mps'] else 'no'} | {','.join(map(str, first['shape']))} | " \
           f"{first['step_ms_without']:.3f} | {first['step_ms_stack']:.3f} |"
    check(any(x.startswith(want) for x in lines), f"the first shape's cells: {want}")
    for r in rows:
        if "step_ms_op" in r:
            r.update(step_ms_inprocess_redo=r["step_ms_op_kernel_checks"] * 1.01,
                     step_ms_switch_stack_redo=r["step_ms_stack"] + 0.03,
                     switch_cost_us_redo=0.49, switch_cost_us_mode_op_redo=0.73,
                     custom_over_direct_redo=1.01)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    try:
        md = inprocess_report.report(f.name, "abc123")
    finally:
        os.unlink(f.name)
    redo_rows = [x for x in md.splitlines() if x.endswith("| 0.49 | 0.73 | 1.010 |")]
    check("redo: mode stack" in md, "rows that measured the redo switch get its table")
    check(len(redo_rows) == n_shapes, f"one redo row per shape row: {len(redo_rows)}")
    print("all checks passed" if not failures else f"{len(failures)} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
