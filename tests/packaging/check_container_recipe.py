#!/usr/bin/env python3
"""Checks deploy/container/Dockerfile against the repository and the built binaries.

  check_container_recipe.py --root REPO [--binary PATH]...

- two stages on debian:12: `AS build`, then the runtime stage;
- every COPY source exists in the repository;
- the build stage installs its packages with scripts/install_deps.sh (the list the project
  builds with), and any package it names itself is in that list;
- the runtime stage installs no -dev package, and each package it names is a Debian package;
- with --binary: every shared library the binaries load comes from a runtime-stage package or
  from a package of priority `required` (in every debian:12 image), and every runtime-stage
  package provides one of them;
- the image name in the Dockerfile is the DaemonSet's image, at the project's version; the
  image's user and exposed ports are the DaemonSet's; the entrypoint is the installed verifyd.
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys

problems = []


def fail(msg):
    problems.append(msg)


def instructions(path):
    """[(KEYWORD, argument text)] with continuation lines joined and comments dropped."""
    out, cur = [], ""
    for line in open(path, encoding="utf-8"):
        s = line.rstrip("\n")
        if not cur and (not s.strip() or s.lstrip().startswith("#")):
            continue
        if s.rstrip().endswith("\\"):
            cur += s.rstrip()[:-1] + " "
            continue
        cur += s
        kw, _, rest = cur.strip().partition(" ")
        out.append((kw.upper(), rest.strip()))
        cur = ""
    return out


def stages(ins):
    result = []
    for kw, arg in ins:
        if kw == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", arg, re.I)
            result.append({"base": m.group(1), "name": m.group(2), "ins": []})
        elif result:
            result[-1]["ins"].append((kw, arg))
    return result


def apt_packages(run):
    pkgs = []
    for part in re.split(r"&&|;", run):
        words = shlex.split(part)
        if "apt-get" in words and "install" in words:
            pkgs += [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
    return pkgs


def install_deps_packages(root):
    text = open(os.path.join(root, "scripts", "install_deps.sh"), encoding="utf-8").read()
    m = re.search(r"packages=\((.*?)\)", text, re.S)
    return set(m.group(1).split()) if m else set()


def packages_of(libs):
    """{library path: the Debian package that ships it, or None}, with one dpkg -S."""
    def variants(lib):  # usrmerge: /lib/x86_64-linux-gnu/... may be packaged as /usr/lib/...
        real = os.path.realpath(lib)
        return {real, re.sub(r"^/usr/lib/", "/lib/", real), re.sub(r"^/lib/", "/usr/lib/", real)}

    paths = sorted(set().union(*(variants(lib) for lib in libs))) if libs else []
    r = subprocess.run(["dpkg", "-S", *paths], capture_output=True, text=True, check=False)
    owner = {}
    for line in r.stdout.splitlines():
        pkg, _, path = line.partition(": ")
        for p in path.split(", "):
            owner[p.strip()] = pkg.split(":")[0].split(",")[0].strip()
    return {lib: next((owner[v] for v in variants(lib) if v in owner), None) for lib in libs}


def installed_depends():
    """{package: [packages it depends on]} of the installed packages (first alternatives), and
    the packages every debian:12 image has: the essential and required ones."""
    r = subprocess.run(["dpkg-query", "-W",
                        "-f=${Package}\t${Essential}\t${Priority}\t${Pre-Depends}, ${Depends}\n"],
                       capture_output=True, text=True, check=True)
    deps, base = {}, set()
    for line in r.stdout.splitlines():
        name, essential, prio, rel = (line.split("\t") + ["", "", ""])[:4]
        deps[name] = [re.split(r"[\s(:]", alt.split("|")[0].strip())[0]
                      for alt in rel.split(",") if alt.strip()]
        if essential == "yes" or prio == "required":
            base.add(name)
    return deps, base


def closure(roots, deps):
    seen, todo = set(), list(roots)
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo += deps.get(p, [])
    return seen


def check_libraries(binaries, runtime):
    needed = {}
    for b in binaries:
        r = subprocess.run(["ldd", b], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            fail(f"ldd {b} failed: {r.stderr.strip()}")
            continue
        for line in r.stdout.splitlines():
            if "not found" in line:
                fail(f"{b}: {line.strip()}")
            m = re.search(r"=>\s+(/\S+)", line)
            if m:
                needed.setdefault(m.group(1), set()).add(os.path.basename(b))
    deps, base = installed_depends()
    base = closure(base, deps)
    pulled = closure(runtime, deps)  # what apt-get install brings along
    used = set()
    owners = packages_of(list(needed))
    for lib, users in sorted(needed.items()):
        pkg = owners[lib]
        if pkg is None:
            fail(f"{lib} (loaded by {', '.join(sorted(users))}) belongs to no Debian package")
        elif pkg in runtime:
            used.add(pkg)
        elif pkg not in base and pkg not in pulled:
            fail(f"{lib} (loaded by {', '.join(sorted(users))}) comes from {pkg}, which neither "
                 f"the base image has nor the runtime stage installs")
    for pkg in sorted(set(runtime) - used):
        fail(f"the runtime stage installs {pkg}, which no binary loads")
    print(f"{len(needed)} shared libraries, from the runtime packages {sorted(used)}, their "
          f"dependencies and the base image")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--binary", action="append", default=[])
    a = ap.parse_args()
    root = a.root
    dockerfile = os.path.join(root, "deploy", "container", "Dockerfile")
    ins = instructions(dockerfile)
    st = stages(ins)
    if len(st) < 2 or st[0]["name"] != "build":
        fail(f"{dockerfile}: not a multi-stage build with a first stage `AS build`")
        return report()
    for s in st:
        if s["base"] != "debian:12":
            fail(f"{dockerfile}: stage on {s['base']}, not debian:12")
    build, runtime = st[0], st[-1]
    for s in st:
        for kw, arg in s["ins"]:
            if kw == "COPY" and "--from" not in arg:
                for src in shlex.split(arg)[:-1]:
                    if not os.path.exists(os.path.join(root, src)):
                        fail(f"{dockerfile}: COPY {src}: not in the repository")
    deps = install_deps_packages(root)
    build_runs = [arg for kw, arg in build["ins"] if kw == "RUN"]
    if not any(re.search(r"(^|\s|/)scripts/install_deps\.sh\b", r) for r in build_runs):
        fail(f"{dockerfile}: the build stage does not run scripts/install_deps.sh")
    for r in build_runs:
        for p in apt_packages(r):
            if p not in deps:
                fail(f"{dockerfile}: the build stage installs {p}, not in scripts/install_deps.sh")
    if not any("cmake --install" in r for r in build_runs):
        fail(f"{dockerfile}: the build stage does not `cmake --install`")
    prefix = re.search(r"-DCMAKE_INSTALL_PREFIX=(\S+)", " ".join(build_runs))
    prefix = prefix.group(1) if prefix else "/usr/local"
    rt_pkgs = [p for kw, arg in runtime["ins"] if kw == "RUN" for p in apt_packages(arg)]
    for p in rt_pkgs:
        if p.endswith("-dev"):
            fail(f"{dockerfile}: the runtime stage installs the -dev package {p}")
    if shutil.which("apt-cache") and os.listdir("/var/lib/apt/lists"):
        r = subprocess.run(["apt-cache", "policy", *rt_pkgs], capture_output=True, text=True,
                           check=False)
        known = {m for m in re.findall(r"^(\S+):$", r.stdout, re.M)}
        candidates = dict(re.findall(r"^(\S+):\n(?:.*\n)*?\s+Candidate: (\S+)", r.stdout, re.M))
        for p in rt_pkgs:
            if p not in known or candidates.get(p) in (None, "(none)"):
                fail(f"{dockerfile}: the runtime package {p} is not a Debian package")
    else:
        print("no apt package lists: runtime package names not looked up")
    if a.binary:
        check_libraries(a.binary, rt_pkgs)

    # The image the DaemonSet runs, its user, ports and entrypoint.
    text = open(dockerfile, encoding="utf-8").read()
    names = set(re.findall(r"-t\s+(\S+)", text))
    version = re.search(r"project\(verifyd VERSION (\S+)",
                        open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8").read())
    ds = open(os.path.join(root, "deploy", "kubernetes", "daemonset.yaml"), encoding="utf-8").read()
    images = set(re.findall(r"^\s*image:\s*(\S+)", ds, re.M))
    if len(names) != 1 or images != names:
        fail(f"{dockerfile}: builds {sorted(names)}, the DaemonSet runs {sorted(images)}")
    elif version and not next(iter(names)).endswith(":" + version.group(1)):
        fail(f"{dockerfile}: image {next(iter(names))} is not tagged with the project version "
             f"{version.group(1)}")
    user = [arg for kw, arg in runtime["ins"] if kw == "USER"]
    uids = set(re.findall(r"runAsUser:\s*(\d+)", ds)) - {"0"}
    if not user or user[-1].split(":")[0] not in uids:
        fail(f"{dockerfile}: USER {user[-1] if user else '(root)'} is not the DaemonSet's "
             f"runAsUser {sorted(uids)}")
    exposed = {int(p.split("/")[0]) for kw, arg in runtime["ins"] if kw == "EXPOSE"
               for p in arg.split()}
    ports = {int(p) for p in re.findall(r"containerPort:\s*(\d+)", ds)}
    if exposed != ports:
        fail(f"{dockerfile}: EXPOSE {sorted(exposed)} is not the DaemonSet's ports {sorted(ports)}")
    entry = [arg for kw, arg in runtime["ins"] if kw == "ENTRYPOINT"]
    want = f"{prefix}/bin/verifyd"
    if not entry or want not in entry[-1]:
        fail(f"{dockerfile}: ENTRYPOINT is not {want}, where the build stage installs verifyd")
    return report()


def report():
    for p in problems:
        print(f"FAIL: {p}")
    if not problems:
        print("the container recipe agrees with the repository")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
