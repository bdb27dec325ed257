#!/usr/bin/env python3
"""Checks deploy/fleet/'s analysis: the Argo Rollouts AnalysisTemplate and the Flagger
MetricTemplates carry the example rollout plan's queries, one for one and the same text, the Argo
thresholds are the plan's, and promtool parses every query (each written as a recording rule and
checked with `promtool check rules`). test_rollout_plan parses the plan itself.
  check_fleet_templates.py PLAN ANALYSISTEMPLATE METRICTEMPLATES
Exits 77 (skipped) without python3-yaml or promtool.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile


def main():
    try:
        import yaml
    except ImportError:
        print("SKIP: no python3-yaml")
        return 77
    if shutil.which("promtool") is None:
        print("SKIP: promtool not found (apt-get install prometheus)")
        return 77
    plan_path, argo_path, flagger_path = sys.argv[1:4]
    with open(plan_path) as f:
        plan = {q["name"].replace("_", "-"): q for q in json.load(f)["queries"]}
    with open(argo_path) as f:
        argo = yaml.safe_load(f)
    with open(flagger_path) as f:
        flagger = [d for d in yaml.safe_load_all(f) if d]
    errors = []
    if argo.get("kind") != "AnalysisTemplate":
        errors.append(f"{argo_path}: not an AnalysisTemplate")
    metrics = {m["name"]: m for m in argo["spec"]["metrics"]}
    if sorted(metrics) != sorted(plan):
        errors.append(f"{argo_path}: metrics {sorted(metrics)} are not the plan's {sorted(plan)}")
    for name, m in metrics.items():
        q = plan.get(name)
        if q is None:
            continue
        if m["provider"]["prometheus"]["query"].strip() != q["query"]:
            errors.append(f"{argo_path}: {name}: the query is not the plan's")
        if m["successCondition"] != f"result[0] <= {q['max']}":
            errors.append(f"{argo_path}: {name}: successCondition is not the plan's max")
    templates = {d["metadata"]["name"].removeprefix("verifyd-"): d for d in flagger
                 if d.get("kind") == "MetricTemplate"}
    if sorted(templates) != sorted(plan):
        errors.append(f"{flagger_path}: templates {sorted(templates)} are not the plan's")
    for name, d in templates.items():
        if name in plan and d["spec"]["query"].strip() != plan[name]["query"]:
            errors.append(f"{flagger_path}: {name}: the query is not the plan's")
    with tempfile.TemporaryDirectory() as tmp:
        rules = os.path.join(tmp, "queries.yaml")
        with open(rules, "w") as f:
            yaml.safe_dump({"groups": [{"name": "fleet", "rules": [
                {"record": f"verifyd_fleet_analysis_{n.replace('-', '_')}", "expr": q["query"]}
                for n, q in plan.items()]}]}, f)
        r = subprocess.run(["promtool", "check", "rules", rules], capture_output=True, text=True,
                           check=False)
        if r.returncode != 0:
            errors.append(f"promtool: {r.stdout}{r.stderr}")
    for e in errors:
        print(e)
    print("ok" if not errors else f"{len(errors)} error(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
