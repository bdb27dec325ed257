#!/usr/bin/env python3
"""Checks deploy/'s systemd unit and Kubernetes manifests against the real verifyd binary.

Every flag they pass, and every --flag their comments name, must be one verifyd knows; both
serve from the CUDA engine (--engine=cuda) on one set of sockets (data
unix:/run/verifyd/verifyd.sock, admin unix:/run/verifyd/admin.sock); the unit keeps /metrics on
loopback; the DaemonSet runs one image, the CUDA one (tag -cuda), reports why verifyd exited
(terminationMessagePolicy), and if it wraps verifyd in a shell, runs the image's verifyd with
the args; the probes, ports and volumes must agree with the flags; the PodMonitor and the
NetworkPolicy must select the DaemonSet's pods and name its ports; the alert rules' target label
must be one the pods carry. verifyd must start with each command line (paths moved into a temp
dir, ports made 0, CPU engine; the DaemonSet's through its command, the unit's under its UMask),
make the data socket 0660 and the admin socket 0600, answer the HTTP probes' paths, and exit 0
on SIGTERM, since Restart=on-failure relies on that; and with the command line as written
(--engine=cuda) and no GPU visible it must refuse to start, with the reason, instead of serving.
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
import stat
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


DATA_SOCKET = "unix:/run/verifyd/verifyd.sock"
ADMIN_SOCKET = "unix:/run/verifyd/admin.sock"
IMAGE_VERIFYD = "/usr/bin/verifyd"
# --flags the comments may name that are not verifyd's: verifyctl's admin address,
# `cmake --install [--prefix]` and `systemctl enable --now`.
OTHER_TOOLS_FLAGS = {"admin", "install", "now", "prefix"}


def moved_args(args, tmp, engine="cpu"):
    """`args` with paths moved under `tmp`, TCP ports made 0 and --engine made `engine`
    (None: kept)."""
    moved = []
    for a in args:
        name, _, value = a.partition("=")
        if value.startswith("unix:"):
            value = "unix:" + tmp + value[5:]
        elif name in ("--state_dir", "--capture_dir"):
            value = tmp + value
        elif name in ("--listen", "--metrics_address") and tcp_port(value) is not None:
            value = "127.0.0.1:0"
        elif name == "--engine" and engine is not None:
            value = engine
        moved.append(f"{name}={value}")
    for a in moved:
        if a.startswith("--listen=unix:") or a.startswith("--admin_listen=unix:"):
            os.makedirs(os.path.dirname(a.split("unix:", 1)[1]), exist_ok=True)
    return moved


def socket_mode(path):
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None


def runs_and_stops(where, verifyd, args, tmp, http_paths=(), argv=None, umask=None):
    """Starts verifyd with `args` moved under `tmp` (through `argv(verifyd, args)` when given,
    under `umask` when given); checks that it serves, that each of `http_paths` answers 200 on
    its metrics port, that the data socket is 0660 and the admin socket 0600, and that it stops
    cleanly."""
    moved = moved_args(args, tmp) + ["--cpu_threads=1"]
    command = argv(verifyd, moved) if argv else [verifyd, *moved]
    log_path = os.path.join(tmp, "log")
    with open(log_path, "wb") as log:
        p = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                             preexec_fn=(lambda: os.umask(umask)) if umask is not None else None)
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
        if ready:
            for flag, want in (("listen", 0o660), ("admin_listen", 0o600)):
                for a in flag_values(moved, flag):
                    if a.startswith("unix:") and socket_mode(a[5:]) != want:
                        mode = socket_mode(a[5:])
                        fail(f"{where}: socket {a} has mode "
                             f"{oct(mode) if mode is not None else '(none)'}, not {oct(want)}")
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    text = open(log_path, encoding="utf-8", errors="replace").read()
    if not ready:
        fail(f"{where}: verifyd did not start with {shlex.join(command)}:\n{text}")
    elif p.returncode != 0:
        fail(f"{where}: verifyd exited {p.returncode} on SIGTERM (Restart=on-failure would "
             f"restart a clean stop):\n{text}")
    else:
        print(f"{where}: started and stopped cleanly with {shlex.join(command)}")


def refuses_without_gpu(where, verifyd, args, tmp, argv=None):
    """With the command line as written (its --engine) and no GPU visible, verifyd must exit
    non-zero with the engine's reason before it serves: a GPU node whose GPU does not come up
    never turns ready, and says why."""
    moved = moved_args(args, tmp, engine=None)
    command = argv(verifyd, moved) if argv else [verifyd, *moved]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    try:
        r = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120,
                           check=False)
    except subprocess.TimeoutExpired:
        fail(f"{where}: with no GPU visible, verifyd {shlex.join(moved)} did not exit in 120 s")
        return
    out = r.stdout + r.stderr
    if r.returncode == 0 or "data plane on" in out:
        fail(f"{where}: with no GPU visible, verifyd served (exit {r.returncode}):\n{out}")
    elif not re.search(r"engine: .*(no GPU is visible|no CUDA engine)", out):
        fail(f"{where}: with no GPU visible, verifyd exited {r.returncode} without the "
             f"engine's reason:\n{out}")
    else:
        reason = re.search(r"engine: .*", out).group(0)
        print(f"{where}: with no GPU visible, verifyd exits {r.returncode}: {reason}")


def check_comment_flags(path, flags):
    """Every --flag a comment names is a verifyd flag (or another tool's, named above)."""
    for n, line in enumerate(open(path, encoding="utf-8"), 1):
        comment = line.partition("#")[2] if line.lstrip().startswith("#") else ""
        for name in re.findall(r"(?<![\w-])--(\w+)", comment):
            if name not in flags and name not in OTHER_TOOLS_FLAGS:
                fail(f"{path}:{n}: a comment names --{name}, which is not a verifyd flag")


def same_sockets(where, listens, admin):
    if DATA_SOCKET not in listens:
        fail(f"{where}: the data plane does not listen on {DATA_SOCKET}")
    if admin != [ADMIN_SOCKET]:
        fail(f"{where}: --admin_listen is {admin}, not {ADMIN_SOCKET}")


def check_engine(where, args):
    if flag_values(args, "engine") != ["cuda"]:
        fail(f"{where}: --engine is {flag_values(args, 'engine')}, not cuda: a GPU node whose "
             f"GPU does not come up would serve from the CPU engine")


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
    if flag_values(args, "state_dir") != ["%S/verifyd"]:
        fail(f"{path}: --state_dir is not the StateDirectory (%S/verifyd)")
    for a in flag_values(args, "listen") + flag_values(args, "admin_listen"):
        if a.startswith("unix:") and not a.startswith("unix:%t/verifyd/"):
            fail(f"{path}: socket {a} is outside the RuntimeDirectory (%t/verifyd)")
    expanded = [a.replace("%t", "/run").replace("%S", "/var/lib") for a in args]
    same_sockets(path, flag_values(expanded, "listen"), flag_values(expanded, "admin_listen"))
    check_engine(path, expanded)
    for m in flag_values(expanded, "metrics_address"):
        host = m.rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "::1", "localhost"):
            fail(f"{path}: --metrics_address={m} exposes /metrics beyond loopback by default")
    check_comment_flags(path, flags)
    umask = int(keys["UMask"], 8) if "UMask" in keys else None
    runs_and_stops(path, verifyd, expanded, os.path.join(tmp, "unit"), umask=umask)
    refuses_without_gpu(path, verifyd, expanded, os.path.join(tmp, "unit-nogpu"))


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
    check_comment_flags(path, flags)
    check_engine(path, args)
    same_sockets(path, flag_values(args, "listen"), flag_values(args, "admin_listen"))
    images = {x.get("image") for x in spec.get("initContainers", []) + spec["containers"]}
    if len(images) != 1 or not next(iter(images)).endswith("-cuda"):
        fail(f"{path}: runs {sorted(map(str, images))}, not the one CUDA image (tag -cuda)")
    if c.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        fail(f"{path}: no terminationMessagePolicy FallbackToLogsOnError: a pod whose verifyd "
             f"refuses to start would not show why in `kubectl describe pod`")
    argv = None
    command = c.get("command")
    if command:
        # A shell around the image's verifyd: run it with the verifyd under test.
        script = command[2] if len(command) == 4 and command[:2] == ["/bin/sh", "-c"] else ""
        if f'exec {IMAGE_VERIFYD} "$@"' not in script:
            fail(f"{path}: command {command} is not /bin/sh -c '... exec {IMAGE_VERIFYD} \"$@\"' "
                 f"NAME (the image's verifyd with the args)")
        else:
            def argv(binary, moved, script=script, name=command[3]):
                return ["/bin/sh", "-c", script.replace(IMAGE_VERIFYD, binary), name, *moved]
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
    runs_and_stops(path, verifyd, args, os.path.join(tmp, "k8s"), http_paths, argv=argv)
    refuses_without_gpu(path, verifyd, args, os.path.join(tmp, "k8s-nogpu"), argv=argv)
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
