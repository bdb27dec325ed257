#!/usr/bin/env python3
"""Two detection matrices of the same calls, judged by two tolerances, side by side.

run_mutants.sh or run_cuda_mutants.sh with the same seeds and sets, once per tolerance (`--
--max_lse_abs 1e-2`, then `-- --max_lse_abs 1e-4`), runs the same calls twice: the engines are
deterministic and every bundle comes from its seed. This reads the two matrices
(detection_matrix.py's NAME.json) and writes NAME.json and NAME.md under --out: per mutant and
group (traffic, prefix, batch), the breach fraction under each tolerance; the classes that no
call breached under the first and some call breached under the second; and the clean build's
largest figures, with its breaches under each (a false breach is a breach of the clean build).
"""

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from detection_matrix import class_key, fmt_batch, fmt_prefix, traffic_of  # noqa: E402


def groups(mutant):
    """(traffic, prefix, batch) -> [calls, breaches] over the mutant's classes."""
    out = collections.defaultdict(lambda: [0, 0])
    for c in mutant["classes"]:
        g = out[(traffic_of(c), c["prefix"], fmt_batch(c))]
        g[0] += c["calls"]
        g[1] += c["breaches"]
    return out


def tolerance_change(a, b):
    """The tolerance fields that differ: "max_lse_abs 0.01 -> 0.0001"."""
    keys = sorted(set(a) | set(b))
    return ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in keys if a.get(k) != b.get(k))


def compare(base, new, base_name="", new_name=""):
    # A matrix may run more mutants than the other (a full matrix against a subset run under the
    # old tolerance): the mutants both ran are compared, and the others are named.
    common = set(base["mutants"]) & set(new["mutants"])
    if "clean" not in common:
        raise SystemExit("limit_comparison.py: both matrices must run the clean build")
    only = {"base": sorted(set(base["mutants"]) - common), "new": sorted(set(new["mutants"]) - common)}
    rows, newly = [], []
    for name in sorted(common, key=lambda n: (n != "clean", n)):
        mb, mn = base["mutants"][name], new["mutants"][name]
        calls_b = {class_key(c): c["calls"] for c in mb["classes"]}
        calls_n = {class_key(c): c["calls"] for c in mn["classes"]}
        if calls_b != calls_n:
            raise SystemExit(f"limit_comparison.py: {name} ran other classes or other numbers of "
                             "calls in the two matrices: not the same calls")
        gb, gn = groups(mb), groups(mn)
        for key in sorted(gb, key=lambda k: (k[0] != "realistic", k[0], k[1], k[2])):
            (calls, breaches_b), (_, breaches_n) = gb[key], gn[key]
            rows.append({"mutant": name, "traffic": key[0], "prefix": key[1], "batch": key[2],
                         "calls": calls, "breaches_base": breaches_b, "breaches_new": breaches_n})
        by_key = {class_key(c): c for c in mn["classes"]}
        for c in mb["classes"]:
            cn = by_key[class_key(c)]
            if c["breaches"] == 0 and cn["breaches"] > 0:
                newly.append({"mutant": name, "traffic": traffic_of(c), "prefix": c["prefix"],
                              "batch": fmt_batch(c), "page_size": c["page_size"],
                              "draft": c["draft"], "calls": c["calls"],
                              "breaches_new": cn["breaches"],
                              "lse_max_abs": c["max"].get("lse_max_abs")})
    clean = base["mutants"].get("clean")
    return {
        "commit": new["commit"], "device": new["device"], "engine": new.get("engine"),
        "matrices": [base_name, new_name],
        "tolerance_base": base["tolerance"], "tolerance_new": new["tolerance"],
        "change": tolerance_change(base["tolerance"], new["tolerance"]),
        "clean": None if clean is None else {
            "calls": clean["calls"], "breaches_base": clean["breaches"],
            "breaches_new": new["mutants"]["clean"]["breaches"],
            "max": {k: max((c["max"].get(k) or 0) for c in clean["classes"])
                    for k in ("lse_max_abs", "max_row_rel_l2", "rel_l2", "atol_rel_needed")}},
        "groups": rows, "newly_caught_classes": newly, "mutants_in_one_matrix_only": only}


def frac(b, n):
    return f"{b / n:.2f}" if n else "-"


def markdown(r):
    out = [f"# Detection under two tolerances: {r['change']}", "",
           f"commit `{r['commit']}`, device {r['device']}. The same calls (same seeds and sets) "
           "judged by each tolerance, for the mutants both matrices ran; breach fraction = breached calls / calls of the group. "
           "Matrices: " + ", ".join(f"[`{m}`]({m})" for m in r["matrices"] if m) + ".", ""]
    if r["clean"]:
        c = r["clean"]
        out += [f"Clean build: {c['calls']} calls, {c['breaches_base']} breaches before, "
                f"{c['breaches_new']} after. Its largest figures: "
                + ", ".join(f"{k} {v:.3g}" for k, v in c["max"].items()), ""]
    for side, names in r["mutants_in_one_matrix_only"].items():
        if names:
            out += [f"Run under the {'first' if side == 'base' else 'second'} tolerance only, "
                    "not compared: " + ", ".join(f"`{n}`" for n in names) + ".", ""]
    out += ["| mutant | traffic | prefix | B | calls | breached before | breached after |",
            "|---|---|---|---|---|---|---|"]
    for g in r["groups"]:
        mark = " **+**" if g["breaches_new"] > g["breaches_base"] else ""
        out.append(f"| {g['mutant']} | {g['traffic']} | {fmt_prefix(g['prefix'])} | {g['batch']} "
                   f"| {g['calls']} | {frac(g['breaches_base'], g['calls'])} | "
                   f"{frac(g['breaches_new'], g['calls'])}{mark} |")
    out += ["", f"## Classes no call breached before, caught after ({len(r['newly_caught_classes'])})",
            "", "| mutant | traffic | prefix | B | page | T | calls | breached after | lse diff |",
            "|---|---|---|---|---|---|---|---|---|"]
    for n in r["newly_caught_classes"]:
        lse = "-" if n["lse_max_abs"] is None else f"{n['lse_max_abs']:.3g}"
        out.append(f"| {n['mutant']} | {n['traffic']} | {fmt_prefix(n['prefix'])} | {n['batch']} "
                   f"| {n['page_size']} | {n['draft']} | {n['calls']} | {n['breaches_new']} "
                   f"| {lse} |")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="the matrix under the old tolerance (NAME.json)")
    ap.add_argument("new", help="the matrix of the same calls under the new tolerance")
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", required=True)
    a = ap.parse_args()
    with open(a.base) as f:
        base = json.load(f)
    with open(a.new) as f:
        new = json.load(f)
    md = [os.path.basename(p).removesuffix(".json") + ".md" for p in (a.base, a.new)]
    r = compare(base, new, *md)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, a.name + ".json"), "w") as f:
        json.dump(r, f, indent=1)
    with open(os.path.join(a.out, a.name + ".md"), "w") as f:
        f.write(markdown(r))
    print(f"wrote {os.path.join(a.out, a.name)}.{{md,json}}")


if __name__ == "__main__":
    main()
