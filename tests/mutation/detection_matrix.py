#!/usr/bin/env python3
"""Detection matrix of the mutation suite: mutant x shape class x traffic model.

Reads the JSON files mutant_driver wrote (one per mutant, "clean" being the unmutated build) and
writes NAME.json and NAME.md under --out: calls to the first breach, breach fraction and the
criteria that tripped, per class; a summary per mutant; the surviving (mutant, class) pairs.
With --check FILE it fails when the clean build breached, or when a mutant not named in FILE
went undetected in a realistic-traffic group (all calls of one prefix). Undetected random-traffic
classes are reported as survivors but do not fail: with diffuse attention one key carries about
1/kv_len of a row, below bf16 resolution at long prefixes.
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


def class_key(c):
    return (c["traffic"], c["prefix"], c["page_size"], c["draft"])


def fmt_prefix(p):
    return f"{p // 1024}K" if p >= 1024 and p % 1024 == 0 else str(p)


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
            m["classes"] += r["classes"]
            m["calls"] += r["calls"]
            m["breaches"] += r["breaches"]
        else:
            by_label[r["label"]] = r
            runs.append(r)
    order = {"clean": -1}
    runs.sort(key=lambda r: (order.get(r["label"], 0), r["label"]))
    first = runs[0]
    doc = {
        "commit": first["commit"], "device": "cpu", "mode": a.mode,
        "heads": first["heads"], "batch": first["batch"], "tolerance": first["tolerance"],
        "mutants": {r["label"]: {"description": description(a.patches, r["label"]),
                                 "calls": r["calls"], "breaches": r["breaches"],
                                 "classes": r["classes"]} for r in runs},
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, a.name + ".json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")

    traffics = sorted({c["traffic"] for r in runs for c in r["classes"]}, reverse=True)
    prefixes = sorted({c["prefix"] for r in runs for c in r["classes"]})
    tol = first["tolerance"]
    md = [f"# CPU mutation suite: detection matrix ({a.mode})", "",
          f"commit `{first['commit']}`, device cpu (CPU engine: reference vs custom, judged by "
          f"`Judge()`), B={first['batch']}, H={first['heads']}, a fresh random bundle per call; "
          f"calls per class shrink with T x kv_len (see the table of every class).", "",
          "Tolerance: " + ", ".join(f"{k} {v:g}" for k, v in tol.items()), "",
          "## Summary", "",
          "Breach fraction over all calls of the (page, T) classes of each traffic model and "
          "prefix; `*` marks a group in which at least one class never breached.", ""]
    head = ["mutant"] + [f"{t} {fmt_prefix(p)}" for t in traffics for p in prefixes] + \
        ["criteria (breached calls)"]
    md += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    survivors = []
    for r in runs:
        groups = collections.defaultdict(lambda: [0, 0, False])
        crit = collections.Counter()
        for c in r["classes"]:
            g = groups[(c["traffic"], c["prefix"])]
            g[0] += c["calls"]
            g[1] += c["breaches"]
            if c["breaches"] == 0:
                g[2] = True
                if r["label"] != "clean":
                    survivors.append((r["label"], c))
            crit.update(c["criteria"])
        cells = []
        for t in traffics:
            for p in prefixes:
                calls, br, surv = groups[(t, p)]
                cells.append(f"{br / calls:.2f}{'*' if surv and r['label'] != 'clean' else ''}"
                             if calls else "-")
        crit_s = ", ".join(f"{k} {v}" for k, v in crit.most_common()) or "-"
        md.append(f"| {r['label']} | " + " | ".join(cells) + f" | {crit_s} |")
    md += ["", "## Planted bugs", ""]
    for r in runs:
        md.append(f"- `{r['label']}`: {doc['mutants'][r['label']]['description']}")
    md += ["", "## Survivors", "",
           "Classes in which a mutant never breached (calls run, largest per-row rel-L2 seen "
           f"against the limit {tol['max_row_rel_l2']:g}, and the largest atol_rel the element "
           f"check would have needed against {tol['atol_rel']:g}).", ""]
    if survivors:
        md += ["| mutant | traffic | prefix | page | T | calls | max row rel-L2 "
               "| atol_rel needed |",
               "|---|---|---|---|---|---|---|---|"]
        for label, c in survivors:
            mx = c["max"]
            md.append(f"| {label} | {c['traffic']} | {fmt_prefix(c['prefix'])} | {c['page_size']} "
                      f"| {c['draft']} | {c['calls']} | {mx.get('max_row_rel_l2', 0):.3g} | "
                      f"{mx.get('atol_rel_needed', 0):.3g} |")
    else:
        md.append("None.")
    md += ["", "## Every class", "",
           "first: the call of the first breach (1-based; - none). frac: breach fraction.", "",
           "| mutant | traffic | prefix | page | T | calls | first | frac | criteria |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for c in sorted(r["classes"], key=class_key):
            crit = ", ".join(f"{k} {v}" for k, v in sorted(c["criteria"].items())) or "-"
            md.append(f"| {r['label']} | {c['traffic']} | {fmt_prefix(c['prefix'])} | "
                      f"{c['page_size']} | {c['draft']} | {c['calls']} | "
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
        for r in runs:
            if r["label"] == "clean" or r["label"] in allowed:
                continue
            groups = collections.defaultdict(lambda: [0, 0])
            for c in r["classes"]:
                if c["traffic"] == "realistic":
                    groups[c["prefix"]][0] += c["calls"]
                    groups[c["prefix"]][1] += c["breaches"]
            for prefix, (calls, br) in sorted(groups.items()):
                if br == 0:
                    bad.append(f"{r['label']} undetected on realistic traffic at prefix {prefix} "
                               f"({calls} calls)")
        for b in bad:
            print("FAIL: " + b)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
