#!/usr/bin/env python3
"""Detection matrix of the mutation suite: mutant x shape class x traffic model.

Reads the JSON files mutant_driver wrote (one per mutant, "clean" being the unmutated build) and
writes NAME.json and NAME.md under --out: calls to the first breach, breach fraction and the
criteria that tripped, per class; a summary per mutant; the surviving (mutant, class) pairs.
With --check FILE it fails when the clean build breached, or when a mutant not named in FILE
went undetected in a realistic-traffic group (all calls of one prefix) by the per-call check,
and neither the oracle drift test on realistic traffic, the probe suite, the determinism probe
nor the invariance probes caught it; and when the clean build's determinism probe saw a
difference or it failed an invariance check. Undetected
random-traffic classes are reported as survivors but do not fail: with diffuse attention one key
carries about 1/kv_len of a row, below bf16 resolution at long prefixes.

A driver run with --drift carries "drift" (per traffic model: oracle samples, the sample of the
first drift breach), one with --probe_max_prefix carries "probe" (probes run, failed) and one
with --determinism_prefix carries "determinism" (custom-path runs of one long random-valued
bundle, and how many differed from the first bit for bit), one with --invariance_max_prefix
carries "invariance" (the invariance probes' checks run and failed, and each check's figures).
A class run on e4m3 pools (--kv_dtype e4m3) carries its kv_dtype and kv_scale: it is a class and
a traffic of its own ("realistic e4m3x0.37"), never merged with the bf16 class of its shape, and
--check holds its realistic groups to the same rule.
"""

import argparse
import collections
import json
import os
import sys


def description(patches, label):
    if label == "clean":
        return "no planted bug"
    path = os.path.join(patches, label + ".patch")
    try:
        with open(path) as f:
            first = f.readline().strip()
    except OSError:
        return ""
    return first.removeprefix("Planted bug: ")


def kv_of(c):
    """A class's KV pool: "bf16", or "e4m3x0.37" for an e4m3 pool at that kv_scale (mutant_driver
    --kv_dtype); a run from before e4m3 pools is bf16."""
    if c.get("kv_dtype", "bf16") == "bf16":
        return "bf16"
    return f"{c['kv_dtype']}x{c.get('kv_scale', 1.0):g}"


def traffic_of(c):
    """The traffic model, and the pool when it is not bf16: "realistic e4m3x0.37"."""
    kv = kv_of(c)
    return c["traffic"] if kv == "bf16" else f"{c['traffic']} {kv}"


def traffic_order(label):
    """bf16 pools first, realistic before random."""
    traffic, _, kv = label.partition(" ")
    return (kv != "", kv, traffic != "realistic", traffic)


def class_key(c):
    return (c["traffic"], kv_of(c), c["prefix"], c.get("batch", 1), c.get("ragged", False),
            c["page_size"], c["draft"])


def fmt_batch(c):
    """B, with "r" when each request had its own prefix (mutant_driver --ragged)."""
    return f"{c.get('batch', 1)}{'r' if c.get('ragged') else ''}"


def fmt_prefix(p):
    return f"{p // 1024}K" if p >= 1024 and p % 1024 == 0 else str(p)


def larger(a, b):
    """The larger of two figures from the drivers' JSON, where null is a NaN a driver saw (its
    JSON writer has no NaN): a non-finite figure is larger than any finite one."""
    if a is None or b is None:
        return None
    return max(a, b)


def fmt_figure(x):
    return "non-finite" if x is None else f"{x:.3g}"


def merge_classes(into, more):
    """Adds a run's classes; a class another run also ran (same traffic, prefix, B, page, T) is one
    class with the calls of both, the later run's calls counted after the earlier's."""
    by_key = {class_key(c): c for c in into}
    for c in more:
        m = by_key.get(class_key(c))
        if m is None:
            into.append(c)
            by_key[class_key(c)] = c
            continue
        if m["first_breach_call"] is None and c["first_breach_call"] is not None:
            m["first_breach_call"] = m["calls"] + c["first_breach_call"]
            m["first_reason"] = c["first_reason"]
        m["calls"] += c["calls"]
        m["breaches"] += c["breaches"]
        m["breach_fraction"] = m["breaches"] / m["calls"] if m["calls"] else 0.0
        for k, v in c["criteria"].items():
            m["criteria"][k] = m["criteria"].get(k, 0) + v
        for k, v in c["max"].items():
            m["max"][k] = larger(m["max"].get(k, v), v)


def merge_drift(into, r):
    """Adds a run's drift streams to `into`'s: samples add up; the first breach is the earliest
    sample of the run it happened in, counted after the samples of the runs before it."""
    for traffic, d in r.get("drift", {}).items():
        m = into.setdefault("drift", {}).get(traffic)
        if m is None:
            into["drift"][traffic] = dict(d)
            continue
        if m["first_breach_sample"] is None and d["first_breach_sample"] is not None:
            m["first_breach_sample"] = m["samples"] + d["first_breach_sample"]
        m["samples"] += d["samples"]
        m["breach_samples"] += d["breach_samples"]
        m["max_ratio"] = larger(m["max_ratio"], d["max_ratio"])


def drift_cell(r, traffic):
    d = r.get("drift", {}).get(traffic)
    if d is None:
        return "n/a"
    first = d["first_breach_sample"]
    return (f"{first} of {d['samples']}" if first else f"- ({d['samples']})") + \
        f" x{fmt_figure(d['max_ratio'])}"


def probe_cell(r):
    p = r.get("probe")
    if p is None:
        return "n/a"
    return f"{p['failures']}/{p['probes']} failed" if p["failures"] else f"0/{p['probes']}"


def determinism_cell(r):
    d = r.get("determinism")
    if d is None:
        return "n/a"
    compared = d["runs"] - 1
    if not d["differing_runs"]:
        return f"0/{compared}"
    return f"{d['differing_runs']}/{compared} differ ({d['max_differing_o']} o)"


def invariance_cell(r):
    v = r.get("invariance")
    if v is None:
        return "n/a"
    return f"{v['failures']}/{v['checks']} failed" if v["failures"] else f"0/{v['checks']}"


def caught_by(r, crit):
    ways = []
    if crit:
        ways.append("per-call")
    if any(d["first_breach_sample"] for d in r.get("drift", {}).values()):
        ways.append("drift")
    if r.get("probe", {}).get("failures"):
        ways.append("probe")
    if (r.get("determinism") or {}).get("differing_runs"):
        ways.append("determinism")
    if (r.get("invariance") or {}).get("failures"):
        ways.append("invariance")
    return ", ".join(ways) or "-"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--mode", default="full")
    ap.add_argument("--check")
    ap.add_argument("--patches", default=os.path.join(os.path.dirname(__file__), "patches"))
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()

    runs = []
    by_label = {}
    for path in a.files:  # several driver runs (sets of classes) per mutant merge into one
        with open(path) as f:
            r = json.load(f)
        if r["label"] in by_label:
            m = by_label[r["label"]]
            merge_classes(m["classes"], r["classes"])
            m["calls"] += r["calls"]
            m["breaches"] += r["breaches"]
            merge_drift(m, r)
            if "probe" not in m and "probe" in r:
                m["probe"] = r["probe"]
            if "determinism" not in m and "determinism" in r:
                m["determinism"] = r["determinism"]
            if "invariance" not in m and "invariance" in r:
                m["invariance"] = r["invariance"]
        else:
            by_label[r["label"]] = r
            runs.append(r)
    order = {"clean": -1}
    runs.sort(key=lambda r: (order.get(r["label"], 0), r["label"]))
    first = runs[0]
    engine = first.get("engine", "cpu")
    device = first.get("device", "cpu")
    doc = {
        "commit": first["commit"], "engine": engine, "device": device, "mode": a.mode,
        "heads": first["heads"], "batch": first["batch"], "tolerance": first["tolerance"],
        "mutants": {r["label"]: {"description": description(a.patches, r["label"]),
                                 "calls": r["calls"], "breaches": r["breaches"],
                                 "drift": r.get("drift"), "probe": r.get("probe"),
                                 "determinism": r.get("determinism"),
                                 "invariance": r.get("invariance"),
                                 "classes": r["classes"]} for r in runs},
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, a.name + ".json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")

    # One column per traffic (and pool) and prefix that some run has classes of.
    columns = sorted({(traffic_of(c), c["prefix"]) for r in runs for c in r["classes"]},
                     key=lambda g: (traffic_order(g[0]), g[1]))
    drift_traffics = sorted({c["traffic"] for r in runs for c in r["classes"]}, reverse=True)
    tol = first["tolerance"]
    only_clean = all(r["label"] == "clean" for r in runs)
    title = "clean calls: false breaches" if only_clean else "mutation suite: detection matrix"
    md = [f"# {engine.upper()} {title} ({a.mode})", "",
          f"commit `{first['commit']}`, device {device} ({engine.upper()} engine: reference vs "
          f"custom, judged by `Judge()`), B={first['batch']} unless a class says otherwise, "
          f"H={first['heads']}, a fresh random bundle per call; calls per class shrink with "
          f"T x kv_len (see the table of every class).", "",
          "Tolerance: " + ", ".join(f"{k} {v:g}" for k, v in tol.items()), "",
          "## Summary", "",
          "Breach fraction over all calls of the (page, T) classes of each traffic model and "
          "prefix; `*` marks a group in which at least one class never breached. "
          "drift: the oracle drift test fed every call of a traffic model in order (the sample "
          "of its first breach, of the samples run, and the largest geometric-mean ratio of "
          "custom's error over the reference's against the oracle). probe: the probe suite "
          "(src/probe/) run once. determinism: the custom path run several times on one long "
          "random-valued bundle, the runs that differ from the first bit for bit. invariance: "
          "the invariance probes (src/probe/invariance.h) run once, the custom path against "
          "itself with no reference: checks failed of checks run. caught by: which of these "
          "tripped. A batch written `32r` is ragged: each request its own prefix. A traffic "
          "written `realistic e4m3x0.37` ran on e4m3 KV pools at that kv_scale.", ""]
    head = ["mutant"] + [f"{t} {fmt_prefix(p)}" for t, p in columns] + \
        [f"drift {t}" for t in drift_traffics] + ["probe", "determinism", "invariance", "caught by",
                                            "criteria (breached calls)"]
    md += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    survivors = []
    for r in runs:
        groups = collections.defaultdict(lambda: [0, 0, False])
        crit = collections.Counter()
        for c in r["classes"]:
            g = groups[(traffic_of(c), c["prefix"])]
            g[0] += c["calls"]
            g[1] += c["breaches"]
            if c["breaches"] == 0:
                g[2] = True
                if r["label"] != "clean":
                    survivors.append((r["label"], c))
            crit.update(c["criteria"])
        cells = []
        for t, p in columns:
            calls, br, surv = groups[(t, p)]
            cells.append(f"{br / calls:.2f}{'*' if surv and r['label'] != 'clean' else ''}"
                         if calls else "-")
        cells += [drift_cell(r, t) for t in drift_traffics] + \
            [probe_cell(r), determinism_cell(r), invariance_cell(r), caught_by(r, crit)]
        crit_s = ", ".join(f"{k} {v}" for k, v in crit.most_common()) or "-"
        md.append(f"| {r['label']} | " + " | ".join(cells) + f" | {crit_s} |")
    md += ["", "## Planted bugs", ""]
    for r in runs:
        md.append(f"- `{r['label']}`: {doc['mutants'][r['label']]['description']}")
    failed_probes = [(r["label"], r["probe"]) for r in runs if r.get("probe", {}).get("failures")]
    if failed_probes:
        md += ["", "## Probes that failed", "",
               "| mutant | failed probes | first reason |", "|---|---|---|"]
        for label, p in failed_probes:
            md.append(f"| {label} | {', '.join(p['failed'])} | {p['first_reason']} |")
    failed_inv = [(r["label"], r["invariance"]) for r in runs
                  if (r.get("invariance") or {}).get("failures")]
    if failed_inv:
        md += ["", "## Invariance checks that failed", "",
               "| mutant | failed checks | first reason |", "|---|---|---|"]
        for label, v in failed_inv:
            md.append(f"| {label} | {', '.join(v['failed'])} | {v['first_reason']} |")
    inv_clean = (by_label.get("clean") or {}).get("invariance")
    if inv_clean:
        md += ["", "## Invariance checks on the clean kernel", "",
               "Largest differences seen per check, against the limits (row rel-L2 2^-7 = "
               "0.0078, lse 1e-4; page_size and page_order bit for bit).", "",
               "| check | runs | rows | bit-identical | max row rel-L2 | max lse diff | s |",
               "|---|---|---|---|---|---|---|"]
        for d in inv_clean.get("detail", []):
            md.append(f"| {d['name']} | {d['runs']} | {d['rows']} | "
                      f"{'yes' if d['bit_identical'] else 'no'} | "
                      f"{fmt_figure(d['max_row_rel_l2'])} | {fmt_figure(d['max_lse_abs'])} | "
                      f"{d['seconds']:.3f} |")
    md += ["", "## Survivors", "",
           "Classes in which a mutant never breached (calls run, largest per-row rel-L2 seen "
           f"against the limit {tol['max_row_rel_l2']:g}, and the largest atol_rel the element "
           f"check would have needed against {tol['atol_rel']:g}).", ""]
    if survivors:
        md += ["| mutant | traffic | prefix | B | page | T | calls | max row rel-L2 "
               "| atol_rel needed |",
               "|---|---|---|---|---|---|---|---|---|"]
        for label, c in survivors:
            mx = c["max"]
            md.append(f"| {label} | {traffic_of(c)} | {fmt_prefix(c['prefix'])} | "
                      f"{fmt_batch(c)} | {c['page_size']} "
                      f"| {c['draft']} | {c['calls']} | {fmt_figure(mx.get('max_row_rel_l2', 0))} | "
                      f"{fmt_figure(mx.get('atol_rel_needed', 0))} |")
    else:
        md.append("None.")
    md += ["", "## Every class", "",
           "first: the call of the first breach (1-based; - none). frac: breach fraction.", "",
           "| mutant | traffic | prefix | B | page | T | calls | first | frac | criteria |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for c in sorted(r["classes"], key=class_key):
            crit = ", ".join(f"{k} {v}" for k, v in sorted(c["criteria"].items())) or "-"
            md.append(f"| {r['label']} | {traffic_of(c)} | {fmt_prefix(c['prefix'])} | "
                      f"{fmt_batch(c)} | {c['page_size']} | {c['draft']} | {c['calls']} | "
                      f"{c['first_breach_call'] or '-'} | {c['breach_fraction']:.2f} | {crit} |")
    with open(os.path.join(a.out, a.name + ".md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {os.path.join(a.out, a.name)}.{{md,json}}")

    if a.check:
        allowed = set()
        with open(a.check) as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if line:
                    allowed.add(line)
        bad = []
        clean = doc["mutants"].get("clean")
        if clean is None:
            bad.append("the clean build did not run")
        elif clean["breaches"]:
            bad.append(f"the clean build breached {clean['breaches']} of {clean['calls']} calls")
        if clean is not None:
            for traffic, d in (clean.get("drift") or {}).items():
                if d["first_breach_sample"]:
                    bad.append(f"the clean build tripped the drift test on {traffic} traffic")
            if (clean.get("probe") or {}).get("failures"):
                bad.append(f"the clean build failed probes: {clean['probe']['failed']}")
            if (clean.get("determinism") or {}).get("differing_runs"):
                bad.append("the clean build's custom path was not bit-identical from run to run")
            if (clean.get("invariance") or {}).get("failures"):
                bad.append(f"the clean build failed invariance checks: "
                           f"{clean['invariance']['failed']}")
        for r in runs:
            if r["label"] == "clean" or r["label"] in allowed:
                continue
            realistic_drift = (r.get("drift") or {}).get("realistic") or {}
            caught = (realistic_drift.get("first_breach_sample")
                      or (r.get("probe") or {}).get("failures")
                      or (r.get("determinism") or {}).get("differing_runs")
                      or (r.get("invariance") or {}).get("failures"))
            if caught:
                continue  # by the drift test on realistic traffic, a probe, determinism or invariance
            groups = collections.defaultdict(lambda: [0, 0])
            for c in r["classes"]:
                if c["traffic"] == "realistic":
                    groups[(traffic_of(c), c["prefix"])][0] += c["calls"]
                    groups[(traffic_of(c), c["prefix"])][1] += c["breaches"]
            for (traffic, prefix), (calls, br) in sorted(groups.items(),
                                                         key=lambda g: (traffic_order(g[0][0]),
                                                                        g[0][1])):
                if br == 0:
                    bad.append(f"{r['label']} undetected on {traffic} traffic at prefix {prefix} "
                               f"({calls} calls)")
        for b in bad:
            print("FAIL: " + b)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
