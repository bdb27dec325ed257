#!/usr/bin/env python3
"""`cmake --install` puts everything where the unit and the Python path expect it.

  check_install.py BUILD_DIR [--bench] [--python PY]

Installs the build twice, each into a fresh temp directory:
  1. DESTDIR=TMP cmake --install BUILD      (the configured prefix, as a distribution package
                                            would stage it)
  2. cmake --install BUILD --prefix TMP     (a prefix chosen at install time)
and checks in each: the binaries (verifyd-bench too with --bench) are executable and run; the
systemd unit, its sysusers file and the deploy files are there; the unit's ExecStart is the
installed verifyd of that prefix; the Python package with its stubs imports from the install.
With systemd-analyze present, `systemd-analyze verify` accepts the unit of install 2.
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

problems = []


def fail(msg):
    problems.append(msg)


def cache(build, key):
    text = open(os.path.join(build, "CMakeCache.txt"), encoding="utf-8").read()
    m = re.search(rf"^{key}:\w+=(.*)$", text, re.M)
    if not m:
        sys.exit(f"{build}/CMakeCache.txt has no {key}")
    return m.group(1)


def unit_keys(path):
    keys = {}
    joined = re.sub(r"\\\n", " ", open(path, encoding="utf-8").read())
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            k, _, v = line.partition("=")
            keys[k.strip()] = v.strip()
    return keys


def check_tree(where, root, prefix, args):
    """root: the directory the prefix lies in on disk (DESTDIR+prefix, or the prefix itself)."""
    bins = ["verifyd", "verifyctl"] + (["verifyd-bench"] if args.bench else [])
    for b in bins:
        path = os.path.join(root, "bin", b)
        if not os.access(path, os.X_OK):
            fail(f"{where}: {path} is not installed executable")
            continue
        flag = "--helpfull" if b == "verifyd" else "--help"
        r = subprocess.run([path, flag], capture_output=True, text=True, check=False, timeout=60)
        if b != "verifyd-bench" and "--" not in r.stdout + r.stderr:
            fail(f"{where}: {path} {flag} printed no flags:\n{r.stdout}{r.stderr}")
    unit = os.path.join(root, args.unit_dir, "verifyd.service")
    if not os.path.isfile(unit):
        fail(f"{where}: no unit at {unit}")
    else:
        if re.search(r"@[A-Z_]+@", open(unit, encoding="utf-8").read()):
            fail(f"{where}: {unit} has an unreplaced @VARIABLE@")
        exec_start = shlex.split(unit_keys(unit).get("ExecStart", ""))
        want = os.path.join(prefix, "bin", "verifyd")
        if not exec_start or exec_start[0] != want:
            fail(f"{where}: ExecStart runs {exec_start[:1]}, not the installed {want}")
    sysusers = os.path.join(root, args.sysusers_dir, "verifyd.conf")
    if not os.path.isfile(sysusers) or not re.search(r"^u verifyd\b", open(sysusers).read(), re.M):
        fail(f"{where}: no sysusers file creating the verifyd user at {sysusers}")
    for f in ("prometheus/alerts.yaml", "grafana/verifyd-dashboard.json",
              "kubernetes/daemonset.yaml"):
        if not os.path.isfile(os.path.join(root, args.data_dir, "verifyd", f)):
            fail(f"{where}: {args.data_dir}/verifyd/{f} is not installed")
    site = os.path.join(root, args.python_dir)
    if not os.path.isfile(os.path.join(site, "verifyd_client", "_gen", "verifyd", "v1",
                                       "verify_pb2.py")):
        fail(f"{where}: no verifyd_client with its stubs in {site}")
    elif args.python:
        env = {k: v for k, v in os.environ.items() if k != "VERIFYD_CLIENT_GEN"}
        env["PYTHONPATH"] = site
        code = ("import os, sys, verifyd_client; from verifyd_client import _proto; "
                "site = os.path.realpath(sys.argv[1]) + os.sep; "
                "bad = [m.__file__ for m in (verifyd_client, _proto.verify_pb2) "
                "if not os.path.realpath(m.__file__).startswith(site)]; "
                "sys.exit(f'imported from {bad}' if bad else 0)")
        r = subprocess.run([args.python, "-c", code, site], env=env, cwd="/", capture_output=True,
                           text=True, check=False)
        if r.returncode != 0:
            fail(f"{where}: the installed verifyd_client does not import: {r.stdout}{r.stderr}")
    return unit


def install(build, env_extra, extra):
    env = dict(os.environ, **env_extra)
    r = subprocess.run(["cmake", "--install", build, *extra], env=env, capture_output=True,
                       text=True, check=False)
    if r.returncode != 0:
        sys.exit(f"cmake --install {' '.join(extra)} failed:\n{r.stdout}{r.stderr}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--python")
    args = ap.parse_args()
    build = args.build
    prefix = cache(build, "CMAKE_INSTALL_PREFIX")
    args.unit_dir = cache(build, "VERIFYD_SYSTEMD_UNIT_DIR")
    args.sysusers_dir = cache(build, "VERIFYD_SYSUSERS_DIR")
    args.python_dir = cache(build, "VERIFYD_PYTHON_INSTALL_DIR")
    # GNUInstallDirs leaves DATADIR empty in the cache when it is DATAROOTDIR.
    args.data_dir = cache(build, "CMAKE_INSTALL_DATADIR") or cache(build,
                                                                  "CMAKE_INSTALL_DATAROOTDIR")
    with tempfile.TemporaryDirectory(prefix="verifyd-install-") as tmp:
        destdir = os.path.join(tmp, "destdir")
        install(build, {"DESTDIR": destdir}, [])
        check_tree(f"DESTDIR install of {prefix}", destdir + prefix, prefix, args)
        chosen = os.path.join(tmp, "prefix")
        install(build, {}, ["--prefix", chosen])
        unit = check_tree(f"--prefix {chosen}", chosen, chosen, args)
        analyze = shutil.which("systemd-analyze")
        if not analyze:
            print("systemd-analyze not found (apt-get install systemd): unit not verified")
        elif os.path.isfile(unit):
            r = subprocess.run([analyze, "verify", unit], capture_output=True, text=True,
                               check=False)
            # verify also reports on unrelated units of the host; keep what names this one.
            mine = [l for l in (r.stdout + r.stderr).splitlines() if "verifyd" in l]
            if r.returncode != 0 or mine:
                fail("systemd-analyze verify " + unit + ":\n" + "\n".join(mine or [r.stderr]))
            else:
                print(f"systemd-analyze verify: {unit} OK")
    for p in problems:
        print(f"FAIL: {p}")
    if not problems:
        print(f"installed and checked under the prefix {prefix} (DESTDIR) and a chosen prefix")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
