#!/usr/bin/env python3
"""Checks that deploy/'s Grafana dashboard and Prometheus alerts name only real metrics.

The metric table is read from src/metrics/metrics.cc (`Build<Type>().Name("...")`); a histogram
is queried as NAME_bucket, NAME_sum and NAME_count. Every PromQL expression (dashboard targets
and template variables, alert exprs) may reference only those names and Prometheus' own `up`;
label values of `outcome`, `pair` and `action` must be ones the table declares.
  check_deploy_metrics.py --metrics_cc FILE --dashboard FILE --alerts FILE
"""

import argparse
import json
import re
import sys

BUILTIN_SERIES = {"up"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
            "unless", "bool", "offset", "inf", "nan", "le",
            # aggregations, which may stand before `by (...)` instead of their parenthesis
            "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
            "bottomk", "topk", "quantile"}
# Grafana's macros that may appear in expressions.
MACROS = re.compile(r"\$__\w+|\$\{[^}]*\}|\$\w+")


def metric_table(metrics_cc):
    """{exposed series name: metric name} from the Build<Type>().Name("...") declarations."""
    src = open(metrics_cc, encoding="utf-8").read()
    decls = re.findall(r"Build(Counter|Gauge|Histogram|Summary)\(\)\s*\.Name\(\"([^\"]+)\"\)",
                       src)
    if not decls:
        sys.exit(f"{metrics_cc}: no metric declarations found")
    series = {}
    for kind, name in decls:
        if kind in ("Histogram", "Summary"):
            for suffix in ("_bucket", "_sum", "_count") if kind == "Histogram" else ("", "_sum",
                                                                                    "_count"):
                series[name + suffix] = name
        else:
            series[name] = name
    literals = set(re.findall(r"\"([a-z_]+)\"", src))
    return series, literals


def strip_expr(expr):
    """The expression without strings, label matchers, grouping lists and durations."""
    e = MACROS.sub("1m", expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r" \1 ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'", " ", e)
    return e


def series_in(expr):
    e = strip_expr(expr)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)", e):
        name = m.group(1)
        rest = e[m.end():].lstrip()
        if rest.startswith("("):  # a function or aggregation
            continue
        if name.lower() in KEYWORDS or re.fullmatch(r"\d+[smhdwy]", name):
            continue
        names.add(name)
    return names


def matcher_values(expr, label):
    """Values (regex alternatives split) matched for `label` in the expression."""
    out = set()
    for op, val in re.findall(label + r"\s*(=~|!~|=|!=)\s*\"([^\"]*)\"", expr):
        out.update(v for v in val.split("|") if v and "$" not in v and op in ("=", "=~"))
    return out


def dashboard_exprs(path):
    d = json.load(open(path, encoding="utf-8"))
    exprs = []
    problems = []
    if d.get("schemaVersion", 0) < 36:
        problems.append(f"{path}: schemaVersion {d.get('schemaVersion')} is older than 36")

    def panels(ps):
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(d.get("panels", [])):
        if p.get("type") == "row":
            continue
        targets = p.get("targets", [])
        if not targets:
            problems.append(f"{path}: panel '{p.get('title')}' has no query")
        for t in targets:
            if "expr" not in t:
                problems.append(f"{path}: panel '{p.get('title')}' has a target without expr")
                continue
            exprs.append((f"panel '{p.get('title')}'", t["expr"]))
    for v in d.get("templating", {}).get("list", []):
        q = v.get("query")
        if v.get("type") == "custom" and v.get("name") in ("outcome", "pair"):
            values = "|".join(x.strip() for x in q.split(","))
            exprs.append((f"variable '{v['name']}'", f'up{{{v["name"]}=~"{values}"}}'))
        if v.get("type") == "query":
            text = q.get("query", "") if isinstance(q, dict) else q or ""
            m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", text)
            exprs.append((f"variable '{v.get('name')}'", m.group(1) if m else text))
    return exprs, problems


def alert_exprs(path):
    text = open(path, encoding="utf-8").read()
    try:
        import yaml  # noqa: PLC0415 - Debian's python3-yaml, optional

        doc = yaml.safe_load(text)
        return [(f"alert {r.get('alert') or r.get('record')}", r["expr"])
                for g in doc["groups"] for r in g["rules"]]
    except ImportError:
        return alert_exprs_minimal(text)


def alert_exprs_minimal(text):
    """`- alert: NAME` followed by `expr: ONE LINE` or `expr: >-` and an indented block."""
    out = []
    lines = text.splitlines()
    name = None
    i = 0
    while i < len(lines):
        m = re.match(r"\s*- alert:\s*(\S+)", lines[i])
        if m:
            name = m.group(1)
        m = re.match(r"(\s*)expr:\s*(.*)$", lines[i])
        if m:
            indent, rest = len(m.group(1)), m.group(2).strip()
            if rest in (">-", ">", "|", "|-"):
                block = []
                i += 1
                while i < len(lines) and (not lines[i].strip() or
                                          len(lines[i]) - len(lines[i].lstrip()) > indent):
                    block.append(lines[i].strip())
                    i += 1
                out.append((f"alert {name}", " ".join(block)))
                continue
            out.append((f"alert {name}", rest.strip("'\"")))
        i += 1
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--metrics_cc", required=True)
    ap.add_argument("--dashboard", required=True)
    ap.add_argument("--alerts", required=True)
    a = ap.parse_args()

    series, literals = metric_table(a.metrics_cc)
    known = set(series) | BUILTIN_SERIES
    dash, problems = dashboard_exprs(a.dashboard)
    alerts = alert_exprs(a.alerts)
    if not dash:
        problems.append(f"{a.dashboard}: no queries found")
    if not alerts:
        problems.append(f"{a.alerts}: no alert expressions found")
    used = set()
    for where, expr in [(f"{a.dashboard}: {w}", e) for w, e in dash] + \
                       [(f"{a.alerts}: {w}", e) for w, e in alerts]:
        names = series_in(expr)
        if not names:
            problems.append(f"{where}: no metric in '{expr}'")
        for n in sorted(names - known):
            hint = f" (did you mean {n}_bucket/_sum/_count?)" if n + "_bucket" in series else ""
            problems.append(f"{where}: '{n}' is not a verifyd metric{hint}")
        used |= {series[n] for n in names if n in series}
        for label in ("outcome", "pair", "action"):
            for v in sorted(matcher_values(expr, label) - literals):
                problems.append(f"{where}: {label}=\"{v}\" is not declared in the metric table")
    print(f"{len(dash)} dashboard queries, {len(alerts)} alert expressions; "
          f"metrics used: {len(used)} of {len(set(series.values()))}")
    unused = sorted(set(series.values()) - used)
    if unused:
        print(f"not on the dashboard or in an alert: {', '.join(unused)}")
    for p in problems:
        print(f"FAIL: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
