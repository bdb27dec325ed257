#!/usr/bin/env python3
"""Checks the container recipes in deploy/container against the repository and the binaries.

  check_container_recipe.py --root REPO [--dockerfile FILE]... [--binary PATH]...

Without --dockerfile both recipes are checked: Dockerfile (the CPU image) and Dockerfile.cuda
(the CUDA image). --binary names binaries built the way the one recipe given builds them (a
CPU-engine build for Dockerfile, a CUDA build for Dockerfile.cuda).

Both recipes:
- two stages, the first `AS build`; every COPY source exists in the repository;
- the build stage installs its packages with scripts/install_deps.sh (the list the project
  builds with), names no package outside that list, and `cmake --install`s;
- the runtime stage installs no -dev package;
- the image is registry/verifyd:VERSION-cpu or VERSION-cuda at the project's version, so that
  neither can be taken for the other; the user and exposed ports are the DaemonSet's; the
  entrypoint is the installed verifyd.
Dockerfile (CPU engine, for CPU-only nodes and development):
- both stages on debian:12; each runtime package is a Debian package (apt-cache);
- with --binary: every shared library the binaries load comes from a runtime-stage package, its
  dependencies, or a package of priority `required` (in every debian:12 image), and every
  runtime-stage package provides one of them (dpkg -S on this Debian 12 host);
- the DaemonSet does not run it (its nodes have GPUs).
Dockerfile.cuda (CUDA engine, the image the DaemonSet runs):
- the build stage on nvidia/cuda:V-devel-ubuntu24.04 and the runtime stage on
  nvidia/cuda:V-runtime-ubuntu24.04, the same V, whose major.minor is this host's nvcc's (when
  /usr/local/cuda/bin/nvcc exists);
- the build stage turns CUDA on with an explicit nvcc, for the architectures of the top-level
  CMakeLists.txt, and runs check_cuda_build.py on the staged verifyd with the same list;
- Ubuntu 24.04 cannot be asked here, so UBUNTU_2404 below maps each shared library (soname)
  the binaries may load to its Ubuntu 24.04 package; each runtime package must be one of them;
- with --binary: every soname the binaries load (ldd) has an entry (a soname without one
  fails: add it after finding its package), and comes from ubuntu:24.04 itself, from the CUDA
  runtime image, from the driver, or from a package the runtime stage names; every package the
  runtime stage names provides one of them.
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys

problems = []

# Where a package comes from in the CUDA image, other than the runtime stage's apt-get.
IN_UBUNTU = "ubuntu:24.04"  # the base of every nvidia/cuda:*-ubuntu24.04 image
IN_CUDA_RUNTIME = "the CUDA runtime image"
FROM_DRIVER = "the driver (mounted by the NVIDIA container toolkit)"
# Packages every ubuntu:24.04 image has: libc6, libgcc-s1, libstdc++6 and zlib1g are required;
# libsystemd0 and its libraries are there for apt, which depends on it.
UBUNTU_BASE = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g", "libsystemd0", "libcap2",
               "libgcrypt20", "libgpg-error0", "liblz4-1", "liblzma5", "libzstd1"}
# nvidia/cuda:*-runtime-* adds the CUDA libraries (cuda-libraries-X-Y) to the base image's
# cudart; the image's CUDA release is the build stage's.
CUDA_RUNTIME = {"cuda-cudart-13-0", "libcublas-13-0"}
DRIVER = {"(the node's driver)"}

# soname (a regular expression over the whole name) -> the Ubuntu 24.04 (noble) package that
# ships it. The binaries checked here are built on Debian 12, whose sonames differ for a few
# libraries: those rows name the Debian 12 soname too and map it to the Ubuntu 24.04 package of
# the same library, which the image's own build (on Ubuntu 24.04) links instead.
UBUNTU_2404 = [
    (r"libgrpc(\+\+(_alts|_error_details|_reflection|_unsecure)?|pp_channelz)\.so\.1\.51",
     "libgrpc++1.51t64"),
    (r"lib(grpc|gpr|address_sorting|upb)\.so\.29", "libgrpc29t64"),
    (r"libprotobuf\.so\.32", "libprotobuf32t64"),
    (r"libabsl_\w+\.so\.20220623", "libabsl20220623t64"),
    (r"libspdlog\.so\.1\.(10|12)", "libspdlog1.12"),  # Debian 12: 1.10
    (r"libfmt\.so\.9", "libfmt9"),
    (r"libprometheus-cpp-core\.so\.1\.0", "libprometheus-cpp-core1.0"),
    (r"libtbb\.so\.12", "libtbb12"),
    (r"libcpp-httplib\.so\.0\.(11|14)", "libcpp-httplib0.14t64"),  # Debian 12: 0.11
    (r"libre2\.so\.(9|10)", "libre2-10"),  # Debian 12: re2 2022 (.so.9)
    (r"libcares\.so\.2", "libc-ares2"),
    (r"lib(ssl|crypto)\.so\.3", "libssl3t64"),
    (r"libbrotli(common|dec|enc)\.so\.1", "libbrotli1"),
    (r"lib(c|m|dl|pthread|rt)\.so\.[0-9]+", "libc6"),
    (r"libstdc\+\+\.so\.6", "libstdc++6"),
    (r"libgcc_s\.so\.1", "libgcc-s1"),
    (r"libz\.so\.1", "zlib1g"),
    (r"libsystemd\.so\.0", "libsystemd0"),
    (r"libcap\.so\.2", "libcap2"),
    (r"libgcrypt\.so\.20", "libgcrypt20"),
    (r"libgpg-error\.so\.0", "libgpg-error0"),
    (r"liblz4\.so\.1", "liblz4-1"),
    (r"liblzma\.so\.5", "liblzma5"),
    (r"libzstd\.so\.1", "libzstd1"),
    (r"libcudart\.so\.13", "cuda-cudart-13-0"),
    (r"libcublas(Lt)?\.so\.13", "libcublas-13-0"),
    (r"libcuda\.so\.1", "(the node's driver)"),
]


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
    lex = shlex.shlex(run, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    commands, words = [], []
    for tok in lex:  # one command per `&&`, `||`, `;` or `|` outside quotes
        if tok in ("&&", "||", ";", "|"):
            commands.append(words)
            words = []
        else:
            words.append(tok)
    commands.append(words)
    pkgs = []
    for words in commands:
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


def ldd_needed(binaries):
    """{(soname, resolved path): {binary basenames}} of what the binaries load."""
    needed = {}
    for b in binaries:
        r = subprocess.run(["ldd", b], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            fail(f"ldd {b} failed: {r.stderr.strip()}")
            continue
        for line in r.stdout.splitlines():
            if "not found" in line:
                fail(f"{b}: {line.strip()}")
            m = re.match(r"\s*(\S+)\s+=>\s+(/\S+)", line)
            if m:
                needed.setdefault((m.group(1), m.group(2)), set()).add(os.path.basename(b))
    return needed


def check_libraries_debian(binaries, runtime):
    needed = {path: users for (_, path), users in ldd_needed(binaries).items()}
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


def ubuntu_package(soname):
    for pattern, pkg in UBUNTU_2404:
        if re.fullmatch(pattern, soname):
            return pkg
    return None


def check_libraries_ubuntu(where, binaries, runtime):
    needed = ldd_needed(binaries)
    used, origin = set(), {}
    for (soname, path), users in sorted(needed.items()):
        pkg = ubuntu_package(soname)
        by = ", ".join(sorted(users))
        if pkg is None:
            fail(f"{where}: {soname} ({path}, loaded by {by}) has no Ubuntu 24.04 package in "
                 f"UBUNTU_2404 ({os.path.relpath(__file__)}): find its package and add it")
        elif pkg in runtime:
            used.add(pkg)
        elif pkg in UBUNTU_BASE:
            origin.setdefault(IN_UBUNTU, set()).add(pkg)
        elif pkg in CUDA_RUNTIME:
            origin.setdefault(IN_CUDA_RUNTIME, set()).add(pkg)
        elif pkg in DRIVER:
            origin.setdefault(FROM_DRIVER, set()).add(pkg)
        else:
            fail(f"{where}: {soname} (loaded by {by}) comes from {pkg}, which the runtime stage "
                 f"does not install")
    for pkg in sorted(set(runtime) - used):
        fail(f"{where}: the runtime stage installs {pkg}, which no binary loads")
    print(f"{where}: {len(needed)} shared libraries: runtime packages {sorted(used)}; " +
          "; ".join(f"{k}: {sorted(v)}" for k, v in sorted(origin.items())))


def cuda_release(text):
    m = re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else None


def check_cuda_recipe(dockerfile, build, runtime, root):
    m_build = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-devel-ubuntu24\.04", build["base"])
    m_run = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-runtime-ubuntu24\.04", runtime["base"])
    if not m_build:
        fail(f"{dockerfile}: build stage on {build['base']}, not nvidia/cuda:X.Y.Z-devel-ubuntu24.04")
    if not m_run:
        fail(f"{dockerfile}: runtime stage on {runtime['base']}, not "
             f"nvidia/cuda:X.Y.Z-runtime-ubuntu24.04 (the CUDA runtime with cuBLAS)")
    if m_build and m_run and m_build.group(1) != m_run.group(1):
        fail(f"{dockerfile}: the build stage has CUDA {m_build.group(1)}, the runtime stage "
             f"{m_run.group(1)}")
    nvcc = "/usr/local/cuda/bin/nvcc"
    if m_build and os.access(nvcc, os.X_OK):
        r = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
        have, want = cuda_release(r.stdout), ".".join(m_build.group(1).split(".")[:2])
        if have != want:
            fail(f"{dockerfile}: builds with CUDA {want}, the project with nvcc {have} ({nvcc})")
    runs = " ".join(arg for kw, arg in build["ins"] if kw == "RUN")
    top = open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8").read()
    default_archs = re.search(r'set\(VERIFYD_CUDA_ARCHS "([^"]*)"', top)
    archs = re.search(r'-DVERIFYD_CUDA_ARCHS="?([^"\s]+)"?', runs)
    if "-DVERIFYD_ENABLE_CUDA=ON" not in runs:
        fail(f"{dockerfile}: the build stage does not configure -DVERIFYD_ENABLE_CUDA=ON")
    if not re.search(r"-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc\b", runs):
        fail(f"{dockerfile}: the build stage does not name nvcc (-DCMAKE_CUDA_COMPILER): without "
             f"it a missing nvcc gives a CPU-only build")
    if not archs:
        fail(f"{dockerfile}: the build stage does not set -DVERIFYD_CUDA_ARCHS")
    elif default_archs and archs.group(1) != default_archs.group(1):
        fail(f"{dockerfile}: builds for {archs.group(1)}, the project for {default_archs.group(1)}")
    check = re.search(r"check_cuda_build\.py\s+--archs\s+\"?([^\"\s]+)\"?\s+(\S+)", runs)
    if not check:
        fail(f"{dockerfile}: the build stage does not run deploy/container/check_cuda_build.py")
    elif archs and check.group(1) != archs.group(1):
        fail(f"{dockerfile}: check_cuda_build.py checks {check.group(1)}, the build is for "
             f"{archs.group(1)}")
    elif not check.group(2).endswith("/bin/verifyd"):
        fail(f"{dockerfile}: check_cuda_build.py checks {check.group(2)}, not the staged verifyd")


def check_recipe(root, dockerfile, binaries, daemonset_images, daemonset_text):
    name = os.path.relpath(dockerfile, root)
    cuda = os.path.basename(dockerfile).endswith(".cuda")
    st = stages(instructions(dockerfile))
    if len(st) < 2 or st[0]["name"] != "build":
        fail(f"{name}: not a multi-stage build with a first stage `AS build`")
        return
    build, runtime = st[0], st[-1]
    if not cuda:
        for s in st:
            if s["base"] != "debian:12":
                fail(f"{name}: stage on {s['base']}, not debian:12")
    for s in st:
        for kw, arg in s["ins"]:
            if kw == "COPY" and "--from" not in arg:
                for src in shlex.split(arg)[:-1]:
                    if not os.path.exists(os.path.join(root, src)):
                        fail(f"{name}: COPY {src}: not in the repository")
    deps = install_deps_packages(root)
    build_runs = [arg for kw, arg in build["ins"] if kw == "RUN"]
    if not any(re.search(r"(^|\s|/)scripts/install_deps\.sh\b", r) for r in build_runs):
        fail(f"{name}: the build stage does not run scripts/install_deps.sh")
    for r in build_runs:
        for p in apt_packages(r):
            if p not in deps:
                fail(f"{name}: the build stage installs {p}, not in scripts/install_deps.sh")
    if not any("cmake --install" in r for r in build_runs):
        fail(f"{name}: the build stage does not `cmake --install`")
    prefix = re.search(r"-DCMAKE_INSTALL_PREFIX=(\S+)", " ".join(build_runs))
    prefix = prefix.group(1) if prefix else "/usr/local"
    rt_pkgs = [p for kw, arg in runtime["ins"] if kw == "RUN" for p in apt_packages(arg)]
    for p in rt_pkgs:
        if p.endswith("-dev"):
            fail(f"{name}: the runtime stage installs the -dev package {p}")
    if cuda:
        check_cuda_recipe(name, build, runtime, root)
        known = {pkg for _, pkg in UBUNTU_2404}
        for p in rt_pkgs:
            if p not in known:
                fail(f"{name}: the runtime package {p} is no Ubuntu 24.04 package of UBUNTU_2404")
        if binaries:
            check_libraries_ubuntu(name, binaries, rt_pkgs)
    else:
        if shutil.which("apt-cache") and os.listdir("/var/lib/apt/lists"):
            r = subprocess.run(["apt-cache", "policy", *rt_pkgs], capture_output=True,
                               text=True, check=False)
            known = set(re.findall(r"^(\S+):$", r.stdout, re.M))
            candidates = dict(re.findall(r"^(\S+):\n(?:.*\n)*?\s+Candidate: (\S+)", r.stdout,
                                         re.M))
            for p in rt_pkgs:
                if p not in known or candidates.get(p) in (None, "(none)"):
                    fail(f"{name}: the runtime package {p} is not a Debian package")
        else:
            print("no apt package lists: runtime package names not looked up")
        if binaries:
            check_libraries_debian(binaries, rt_pkgs)

    # The image's name, and for the CUDA image: the DaemonSet runs it.
    text = open(dockerfile, encoding="utf-8").read()
    names = set(re.findall(r"-t\s+(\S+)", text))
    version = re.search(r"project\(verifyd VERSION (\S+)",
                        open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8").read())
    flavour = "cuda" if cuda else "cpu"
    if len(names) != 1:
        fail(f"{name}: names {sorted(names) or 'no image'} (`-t NAME`), not one")
    else:
        image = next(iter(names))
        if version and not image.endswith(f":{version.group(1)}-{flavour}"):
            fail(f"{name}: image {image} is not tagged VERSION-{flavour} with the project "
                 f"version {version.group(1)}")
        if cuda and daemonset_images != names:
            fail(f"{name}: builds {image}, the DaemonSet runs {sorted(daemonset_images)}")
        if not cuda and image in daemonset_images:
            fail(f"{name}: the DaemonSet runs {image}, the CPU image, on GPU nodes")
    user = [arg for kw, arg in runtime["ins"] if kw == "USER"]
    uids = set(re.findall(r"runAsUser:\s*(\d+)", daemonset_text)) - {"0"}
    if not user or user[-1].split(":")[0] not in uids:
        fail(f"{name}: USER {user[-1] if user else '(root)'} is not the DaemonSet's "
             f"runAsUser {sorted(uids)}")
    exposed = {int(p.split("/")[0]) for kw, arg in runtime["ins"] if kw == "EXPOSE"
               for p in arg.split()}
    ports = {int(p) for p in re.findall(r"containerPort:\s*(\d+)", daemonset_text)}
    if exposed != ports:
        fail(f"{name}: EXPOSE {sorted(exposed)} is not the DaemonSet's ports {sorted(ports)}")
    entry = [arg for kw, arg in runtime["ins"] if kw == "ENTRYPOINT"]
    want = f"{prefix}/bin/verifyd"
    if not entry or want not in entry[-1]:
        fail(f"{name}: ENTRYPOINT is not {want}, where the build stage installs verifyd")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--dockerfile", action="append", default=[])
    ap.add_argument("--binary", action="append", default=[])
    a = ap.parse_args()
    root = a.root
    here = os.path.join(root, "deploy", "container")
    dockerfiles = a.dockerfile or [os.path.join(here, "Dockerfile"),
                                   os.path.join(here, "Dockerfile.cuda")]
    if a.binary and len(dockerfiles) != 1:
        sys.exit("--binary: name the one recipe that builds them with --dockerfile")
    ds = open(os.path.join(root, "deploy", "kubernetes", "daemonset.yaml"),
              encoding="utf-8").read()
    images = set(re.findall(r"^\s*image:\s*(\S+)", ds, re.M))
    for d in dockerfiles:
        check_recipe(root, os.path.abspath(d), a.binary, images, ds)
    return report()


def report():
    for p in problems:
        print(f"FAIL: {p}")
    if not problems:
        print("the container recipes agree with the repository")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
