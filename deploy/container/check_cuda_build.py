#!/usr/bin/env python3
"""Fails unless VERIFYD is a CUDA build with device code for every architecture asked for.

  check_cuda_build.py --archs "90a;120" VERIFYD [OTHER_BINARY]...   (or --archs 90a,120)

The CUDA image's build stage runs it on the staged binaries: CMake builds the CPU engine alone,
without a word, when it finds no nvcc, and such an image would serve from the CPU engine on a GPU
node. Two checks, neither needing a GPU:
- the .nv_fatbin section of each binary holds a cubin (SASS, not only PTX) for each architecture,
  with the arch-specific feature set (the `a` of sm_90a) where one is asked for; binaries that
  hold no device code at all (verifyctl) are reported, not failed;
- `VERIFYD --engine=cuda` with no GPU visible refuses to start with the CUDA build's message
  ("no GPU is visible"), not the CPU build's ("this build has no CUDA engine").
"""

import argparse
import os
import re
import struct
import subprocess
import sys
import tempfile

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
# In a fatbin entry's flags: the arch-specific (`a`) variant of the architecture, e.g. sm_90a.
FLAG_ARCH_SPECIFIC = 0x100000


def section(data, wanted):
    """(offset, size) of the ELF64 section named `wanted`, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    for name, _, _, _, off, size in headers:
        end = data.index(b"\0", names + name)
        if data[names + name:end].decode() == wanted:
            return off, size
    return None


def fatbin_entries(path):
    """{(kind, 'sm_NN' or 'sm_NNa')} of the device code a host binary embeds."""
    data = open(path, "rb").read()
    sec = section(data, ".nv_fatbin")
    if not sec:
        return set()
    off, size = sec
    entries, pos = set(), off
    while pos + 16 <= off + size:
        magic, _, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # containers are 8-byte aligned; padding between them
            pos += 8
            continue
        p, end = pos + header_size, pos + header_size + fat_size
        while p + 48 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, p)
            arch, = struct.unpack_from("<I", data, p + 28)
            flags, = struct.unpack_from("<Q", data, p + 40)
            suffix = "a" if flags & FLAG_ARCH_SPECIFIC else ""
            entries.add((kind, f"sm_{arch}{suffix}"))
            p += entry_header + payload
        pos = end
    return entries


def refuses_without_gpu(verifyd):
    """'' if `verifyd --engine=cuda` without a visible GPU exits with the CUDA build's message."""
    with tempfile.TemporaryDirectory(prefix="verifyd-cuda-check-") as tmp:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        args = [verifyd, "--engine=cuda", f"--listen=unix:{tmp}/verifyd.sock",
                f"--admin_listen=unix:{tmp}/admin.sock", "--metrics_address=",
                f"--state_dir={tmp}/state", "--probe=false"]
        try:
            r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60,
                               check=False)
        except subprocess.TimeoutExpired:
            return "--engine=cuda with no GPU visible did not exit within 60 s"
    out = r.stdout + r.stderr
    if r.returncode == 0:
        return f"--engine=cuda with no GPU visible exited 0:\n{out}"
    if "no CUDA engine" in out:
        return f"a CPU-only build (--engine=cuda: {out.strip()})"
    if "no GPU is visible" not in out:
        return f"--engine=cuda with no GPU visible exited {r.returncode} without saying why:\n{out}"
    return ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", required=True,
                    help='as VERIFYD_CUDA_ARCHS: "90a;120" (or comma-separated)')
    ap.add_argument("verifyd")
    ap.add_argument("others", nargs="*")
    a = ap.parse_args()
    want = [f"sm_{x}" for x in re.split(r"[;,]", a.archs) if x]
    problems = []
    for b in [a.verifyd, *a.others]:
        entries = fatbin_entries(b)
        cubins = sorted(arch for kind, arch in entries if kind == KIND_ELF)
        name = os.path.basename(b)
        if not entries and b != a.verifyd:
            print(f"{name}: no device code")
            continue
        missing = [w for w in want if w not in cubins]
        if missing:
            problems.append(f"{b}: no cubin for {', '.join(missing)} (has {cubins or 'none'})")
        else:
            print(f"{name}: cubins for {', '.join(sorted(set(cubins)))}")
    why = refuses_without_gpu(a.verifyd)
    if why:
        problems.append(f"{a.verifyd}: {why}")
    else:
        print(f"{os.path.basename(a.verifyd)}: --engine=cuda without a GPU refuses to start")
    for p in problems:
        print(f"FAIL: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
