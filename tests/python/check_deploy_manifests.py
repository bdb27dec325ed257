#!/usr/bin/env python3
"""Checks deploy/'s systemd unit and Kubernetes DaemonSet against the real verifyd binary.

Every flag they pass must be one verifyd knows; the probes, ports and volumes must agree with
the flags; and verifyd must start with each command line (paths moved into a temp dir, ports
made 0, CPU engine) and exit 0 on SIGTERM, since Restart=on-failure relies on that.
  check_deploy_manifests.py VERIFYD --unit FILE --daemonset FILE
Exits 77 (skipped) without python3-yaml.
"""

import argparse
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


def runs_and_stops(where, verifyd, args, tmp):
    """Starts verifyd with `args` moved under `tmp`; True when it serves and stops cleanly."""
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
        deadline = time.monotonic() + 20
        ready = False
        while time.monotonic() < deadline and p.poll() is None:
            text = open(log_path, encoding="utf-8", errors="replace").read()
            if "data plane on" in text and "mode " in text:
                ready = True
                break
            time.sleep(0.05)
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
                    ("RuntimeDirectory", "verifyd")):
        if keys.get(k) != want:
            fail(f"{path}: {k}={keys.get(k)}, expected {want}")
    if "DynamicUser" not in keys and "User" not in keys:
        fail(f"{path}: runs as root (no User= or DynamicUser=)")
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
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        g = c.get(probe, {}).get("grpc")
        if not g:
            fail(f"{path}: {probe} is not a grpc probe")
        elif g["port"] not in tcp:
            fail(f"{path}: {probe} port {g['port']} is not a TCP --listen port {sorted(tcp)}")
    if c.get("readinessProbe", {}).get("grpc", {}).get("service") != "verifyd.v1.VerifyService":
        fail(f"{path}: readinessProbe does not check the verifyd.v1.VerifyService health")
    metrics = flag_values(args, "metrics_address")
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
    runs_and_stops(path, verifyd, args, os.path.join(tmp, "k8s"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("verifyd")
    ap.add_argument("--unit", required=True)
    ap.add_argument("--daemonset", required=True)
    a = ap.parse_args()
    try:
        import yaml  # noqa: F401, PLC0415
    except ImportError:
        print(f"SKIP: {sys.executable} has no yaml (apt-get install python3-yaml)")
        return 77
    flags = known_flags(a.verifyd)
    with tempfile.TemporaryDirectory(prefix="verifyd-deploy-") as tmp:
        check_unit(a.unit, a.verifyd, flags, tmp)
        check_daemonset(a.daemonset, a.verifyd, flags, tmp)
    for p in problems:
        print(f"FAIL: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
