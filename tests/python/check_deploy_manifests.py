#!/usr/bin/env python3
"""Checks deploy/'s systemd unit and Kubernetes manifests against the real verifyd binary.

Every flag they pass must be one verifyd knows; the probes, ports and volumes must agree with
the flags; the PodMonitor and the NetworkPolicy must select the DaemonSet's pods and name its
ports; the alert rules' target label must be one the pods carry; and verifyd must start with
each command line (paths moved into a temp dir, ports made 0, CPU engine), answer the HTTP
probes' paths, and exit 0 on SIGTERM, since Restart=on-failure relies on that.
  check_deploy_manifests.py VERIFYD --unit FILE --daemonset FILE --podmonitor FILE
                            --networkpolicy FILE --alerts FILE
Exits 77 (skipped) without python3-yaml.
"""

import argparse
import urllib.error
import urllib.request
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

problems = []


def fail(msg):
    problems.append(msg)


def known_flags(verifyd):
    out = subprocess.run([verifyd, "--helpfull"], capture_output=True, text=True,
                         check=False).stdout
    flags = set(re.findall(r"^\s+--(\w+) \(", out, re.M))
    if "listen" not in flags:
        sys.exit(f"{verifyd} --helpfull lists no --listen flag:\n{out}")
    return flags


def flag_values(args, name):
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


def check_flags(where, args, flags):
    for a in args:
        m = re.match(r"--(\w+)", a)
        if not m:
            fail(f"{where}: argument '{a}' is not --flag=value")
        elif m.group(1) not in flags:
            fail(f"{where}: --{m.group(1)} is not a verifyd flag")


def tcp_port(addr):
    return None if addr.startswith("unix:") else int(addr.rsplit(":", 1)[1])


def http_status(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return str(e)


def runs_and_stops(where, verifyd, args, tmp, http_paths=()):
    """Starts verifyd with `args` moved under `tmp`; checks that it serves, that each of
    `http_paths` answers 200 on its metrics port, and that it stops cleanly."""
    moved = []
    for a in args:
        name, _, value = a.partition("=")
        if value.startswith("unix:"):
            value = "unix:" + tmp + value[5:]
        elif name in ("--state_dir", "--capture_dir"):
            value = tmp + value
        elif name in ("--listen", "--metrics_address") and tcp_port(value) is not None:
            value = "127.0.0.1:0"
        elif name == "--engine":
            value = "cpu"
        moved.append(f"{name}={value}")
    for a in moved:
        if a.startswith("--listen=unix:") or a.startswith("--admin_listen=unix:"):
            os.makedirs(os.path.dirname(a.split("unix:", 1)[1]), exist_ok=True)
    log_path = os.path.join(tmp, "log")
    with open(log_path, "wb") as log:
        p = subprocess.Popen([verifyd, *moved, "--cpu_threads=1"], stdout=log,
                             stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120  # after the start-up probe (slow under ASan)
        ready = False
        while time.monotonic() < deadline and p.poll() is None:
            text = open(log_path, encoding="utf-8", errors="replace").read()
            if "data plane on" in text and "mode " in text:
                ready = True
                break
            time.sleep(0.05)
        m = re.search(r"metrics on (http://[^/\s]+)/", text) if ready else None
        for path in http_paths:
            got = http_status(m.group(1) + path) if m else "no metrics address in the log"
            if got != 200:
                fail(f"{where}: GET {path} on the metrics port answered {got}, not 200")
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    text = open(log_path, encoding="utf-8", errors="replace").read()
    if not ready:
        fail(f"{where}: verifyd did not start with {shlex.join(moved)}:\n{text}")
    elif p.returncode != 0:
        fail(f"{where}: verifyd exited {p.returncode} on SIGTERM (Restart=on-failure would "
             f"restart a clean stop):\n{text}")
    else:
        print(f"{where}: started and stopped cleanly with {shlex.join(moved)}")


def unit_exec_start(path):
    """The [Service] keys of a unit file (continuation lines joined; last value wins)."""
    keys = {}
    joined = re.sub(r"\\\n", " ", open(path, encoding="utf-8").read())
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        k, _, v = line.partition("=")
        keys[k.strip()] = v.strip()
    return keys


def check_unit(path, verifyd, flags, tmp):
    keys = unit_exec_start(path)
    argv = shlex.split(keys.get("ExecStart", ""))
    if not argv or os.path.basename(argv[0]) != "verifyd":
        fail(f"{path}: ExecStart does not run verifyd")
        return
    args = argv[1:]
    check_flags(path, args, flags)
    for k, want in (("Restart", "on-failure"), ("StateDirectory", "verifyd"),
                    ("RuntimeDirectory", "verifyd"), ("Type", "notify")):
        if keys.get(k) != want:
            fail(f"{path}: {k}={keys.get(k)}, expected {want}")
    if "DynamicUser" not in keys and "User" not in keys:
        fail(f"{path}: runs as root (no User= or DynamicUser=)")
    for k in ("MemoryMax", "CPUQuota"):
        if k not in keys:
            fail(f"{path}: no {k}: nothing keeps verifyd from starving the serving stack")
    if flag_values(args, "admin_listen") != ["unix:%t/verifyd/admin.sock"]:
        fail(f"{path}: --admin_listen is not the default unix:/run/verifyd/admin.sock")
    if flag_values(args, "state_dir") != ["%S/verifyd"]:
        fail(f"{path}: --state_dir is not the StateDirectory (%S/verifyd)")
    for a in flag_values(args, "listen") + flag_values(args, "admin_listen"):
        if a.startswith("unix:") and not a.startswith("unix:%t/verifyd/"):
            fail(f"{path}: socket {a} is outside the RuntimeDirectory (%t/verifyd)")
    expanded = [a.replace("%t", "/run").replace("%S", "/var/lib") for a in args]
    runs_and_stops(path, verifyd, expanded, os.path.join(tmp, "unit"))


def check_daemonset(path, verifyd, flags, tmp):
    import yaml  # noqa: PLC0415 - checked by main()

    docs = [d for d in yaml.safe_load_all(open(path, encoding="utf-8")) if d]
    ds = [d for d in docs if d.get("kind") == "DaemonSet"]
    if len(ds) != 1:
        fail(f"{path}: expected one DaemonSet, found {len(ds)}")
        return
    spec = ds[0]["spec"]["template"]["spec"]
    meta = ds[0]["spec"]["template"]["metadata"]
    c = [c for c in spec["containers"] if c["name"] == "verifyd"]
    if not c:
        fail(f"{path}: no container named verifyd")
        return
    c = c[0]
    args = c.get("args", [])
    check_flags(path, args, flags)
    listens = flag_values(args, "listen")
    tcp = {tcp_port(a) for a in listens} - {None}
    ports = {p["containerPort"] for p in c.get("ports", [])}
    metrics = flag_values(args, "metrics_address")
    metrics_port = tcp_port(metrics[0]) if metrics else None
    named = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    http_paths = []
    for probe in ("startupProbe", "readinessProbe"):
        g = c.get(probe, {}).get("httpGet")
        if not g:
            fail(f"{path}: {probe} is not an HTTP probe of /readyz")
            continue
        port = named.get(g["port"], g["port"])
        if port != metrics_port:
            fail(f"{path}: {probe} port {g['port']} is not the --metrics_address port")
        if g.get("path") != "/readyz":
            fail(f"{path}: {probe} checks {g.get('path')}, not /readyz")
        http_paths.append(g.get("path"))
    g = c.get("livenessProbe", {}).get("grpc")
    if not g or g["port"] not in tcp:
        fail(f"{path}: livenessProbe is not a grpc probe on a TCP --listen port {sorted(tcp)}")
    elif g.get("service") != "verifyd.v1.VerifyService":
        fail(f"{path}: livenessProbe does not check the verifyd.v1.VerifyService health")
    if not flag_values(args, "cuda_pool_mb"):
        fail(f"{path}: --cuda_pool_mb (GPU memory) is not set next to the resources")
    ann = meta.get("annotations", {})
    if ann.get("prometheus.io/scrape") != "true":
        fail(f"{path}: pods are not annotated prometheus.io/scrape")
    if not metrics or str(tcp_port(metrics[0])) != ann.get("prometheus.io/port"):
        fail(f"{path}: prometheus.io/port {ann.get('prometheus.io/port')} is not the "
             f"--metrics_address port")
    for port in tcp | {tcp_port(m) for m in metrics}:
        if port not in ports:
            fail(f"{path}: port {port} is not a containerPort")
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for a in listens + flag_values(args, "admin_listen"):
        if a.startswith("unix:") and os.path.dirname(a[5:]) not in mounts:
            fail(f"{path}: socket {a} is not in a mounted volume")
    for d in flag_values(args, "state_dir"):
        v = volumes.get(mounts.get(d, ""), {})
        if "hostPath" not in v:
            fail(f"{path}: --state_dir {d} is not on a hostPath volume")
    sock = [a for a in listens if a.startswith("unix:")]
    if not sock or "hostPath" not in volumes.get(mounts.get(os.path.dirname(sock[0][5:])), {}):
        fail(f"{path}: the data-plane socket is not on a hostPath volume shared with the node")
    gpu = str(spec.get("tolerations", [])) + str(spec.get("affinity", {})) + str(c)
    if "nvidia.com/gpu" not in gpu:
        fail(f"{path}: nothing places the pods on GPU nodes (nvidia.com/gpu)")
    runs_and_stops(path, verifyd, args, os.path.join(tmp, "k8s"), http_paths)
    return {"namespace": ds[0]["metadata"].get("namespace"), "labels": meta.get("labels", {}),
            "tcp": tcp, "metrics_port": metrics_port, "named_ports": named}


def load_one(path, kind):
    import yaml  # noqa: PLC0415 - checked by main()

    docs = [d for d in yaml.safe_load_all(open(path, encoding="utf-8")) if d]
    found = [d for d in docs if d.get("kind") == kind]
    if len(found) != 1:
        fail(f"{path}: expected one {kind}, found {len(found)}")
        return None
    return found[0]


def selects(where, selector, pod):
    want = (selector or {}).get("matchLabels", {})
    if not want:
        fail(f"{where}: selects every pod (no matchLabels)")
    for k, v in want.items():
        if pod["labels"].get(k) != v:
            fail(f"{where}: selects {k}={v}, which the DaemonSet's pods do not carry")


def check_podmonitor(path, pod):
    pm = load_one(path, "PodMonitor")
    if not pm:
        return
    spec = pm["spec"]
    if pm["metadata"].get("namespace") != pod["namespace"] and \
            pod["namespace"] not in spec.get("namespaceSelector", {}).get("matchNames", []):
        fail(f"{path}: does not look in the DaemonSet's namespace {pod['namespace']}")
    selects(path, spec.get("selector"), pod)
    eps = spec.get("podMetricsEndpoints", [])
    if not eps:
        fail(f"{path}: no podMetricsEndpoints")
    for ep in eps:
        port = pod["named_ports"].get(ep.get("port"))
        if port != pod["metrics_port"]:
            fail(f"{path}: endpoint port {ep.get('port')!r} is not the container port of "
                 f"--metrics_address ({pod['metrics_port']})")
        if ep.get("path", "/metrics") != "/metrics":
            fail(f"{path}: scrapes {ep.get('path')}, not /metrics")
    for label in pod["alert_labels"]:
        if label not in spec.get("podTargetLabels", []):
            fail(f"{path}: the alerts select targets by '{label}', but podTargetLabels does not "
                 f"copy it from the pods")


def check_networkpolicy(path, pod):
    np_ = load_one(path, "NetworkPolicy")
    if not np_:
        return
    spec = np_["spec"]
    if np_["metadata"].get("namespace") != pod["namespace"]:
        fail(f"{path}: namespace {np_['metadata'].get('namespace')} is not the DaemonSet's")
    selects(path, spec.get("podSelector"), pod)
    if "Ingress" not in spec.get("policyTypes", ["Ingress"]):
        fail(f"{path}: does not restrict ingress")
    admitted = set()
    for rule in spec.get("ingress", []):
        ports = {p.get("port") for p in rule.get("ports", [])}
        if not ports:
            fail(f"{path}: an ingress rule admits every port")
        if not rule.get("from"):
            fail(f"{path}: an ingress rule to {sorted(ports, key=str)} admits every source")
        for peer in rule.get("from", []):
            if not peer.get("podSelector", {}).get("matchLabels"):
                fail(f"{path}: a source of {sorted(ports, key=str)} is not narrowed to "
                     f"labelled pods")
        unknown = ports - pod["tcp"] - {pod["metrics_port"]}
        if unknown:
            fail(f"{path}: admits ports {sorted(unknown, key=str)} verifyd does not listen on")
        if pod["tcp"] & ports and pod["metrics_port"] in ports:
            fail(f"{path}: one rule admits the same sources to the data plane and the metrics")
        admitted |= ports
    for port in sorted(pod["tcp"] | {pod["metrics_port"]}):
        if port not in admitted:
            fail(f"{path}: port {port} (a --listen or --metrics_address port) is not admitted "
                 f"to anyone")


def alert_target_labels(path, pod):
    """The label=value matchers of VerifydDown's `up` selector; each must be on the pods."""
    import yaml  # noqa: PLC0415 - checked by main()

    doc = yaml.safe_load(open(path, encoding="utf-8"))
    rules = {r.get("alert"): r for g in doc["groups"] for r in g["rules"]}
    down = rules.get("VerifydDown", {}).get("expr", "")
    m = re.search(r"\bup\{([^}]*)\}", down)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) if m else {}
    if not labels:
        fail(f"{path}: VerifydDown does not select `up` by a label")
    for k, v in labels.items():
        if pod["labels"].get(k) != v:
            fail(f"{path}: VerifydDown selects {k}=\"{v}\", which the DaemonSet's pods do not "
                 f"carry")
    absent = rules.get("VerifydAbsent", {}).get("expr", "")
    if not re.search(r"\babsent\(\s*up\{" + re.escape(m.group(1) if m else "") + r"\}", absent):
        fail(f"{path}: no VerifydAbsent rule over the same `up` selector as VerifydDown")
    return list(labels)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("verifyd")
    ap.add_argument("--unit", required=True)
    ap.add_argument("--daemonset", required=True)
    ap.add_argument("--podmonitor", required=True)
    ap.add_argument("--networkpolicy", required=True)
    ap.add_argument("--alerts", required=True)
    a = ap.parse_args()
    try:
        import yaml  # noqa: F401, PLC0415
    except ImportError:
        print(f"SKIP: {sys.executable} has no yaml (apt-get install python3-yaml)")
        return 77
    flags = known_flags(a.verifyd)
    with tempfile.TemporaryDirectory(prefix="verifyd-deploy-") as tmp:
        check_unit(a.unit, a.verifyd, flags, tmp)
        pod = check_daemonset(a.daemonset, a.verifyd, flags, tmp)
    if pod:
        pod["alert_labels"] = alert_target_labels(a.alerts, pod)
        check_podmonitor(a.podmonitor, pod)
        check_networkpolicy(a.networkpolicy, pod)
    for p in problems:
        print(f"FAIL: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
