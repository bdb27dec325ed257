#!/usr/bin/env python3
"""verifyd_client.kernel_op's and switch's ctypes structs have the C layout of kernels/op/verify_op_api.h
(every field's offset and each struct's size, as kernel_op_abi_layout prints them), every function
the header exports is bound by the client, and the client's ABI_VERSION is the library's, so that
the client and libverifyd_kernel.so agree without a GPU to find out.

    kernel_op_abi_test.py PATH_TO_kernel_op_abi_layout
"""

import ctypes
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..", "..", "clients", "python")))

from verifyd_client import kernel_op, switch  # noqa: E402


def main():
    c = json.loads(subprocess.run([sys.argv[1]], check=True, capture_output=True,
                                  text=True).stdout)
    bad = []
    for name, mirror in (("VerifydOpGeometry", kernel_op._Geometry),  # noqa: SLF001
                         ("VerifydOpCall", kernel_op._Call),  # noqa: SLF001
                         ("VerifydSwitchBlock", switch._Block)):  # noqa: SLF001
        want = dict(c[name])
        size = want.pop("sizeof")
        magic = want.pop("magic_value", None)
        if magic is not None and magic != switch.MAGIC:
            bad.append(f"{name}: C magic {magic:#x}, the client's {switch.MAGIC:#x}")
        got = {f: getattr(mirror, f).offset for f, _ in mirror._fields_}  # noqa: SLF001
        if got != want:
            bad.append(f"{name}: C offsets {want}, ctypes {got}")
        if ctypes.sizeof(mirror) != size:
            bad.append(f"{name}: C size {size}, ctypes {ctypes.sizeof(mirror)}")
    bad += bindings()
    for b in bad:
        print("FAIL", b)
    if not bad:
        print("ok: the ctypes mirror matches verify_op_api.h")
    return 1 if bad else 0


def bindings():
    """Every exported function of the header named in the client's sources, and one ABI version."""
    bad = []
    header = open(os.path.join(ROOT, "kernels", "op", "verify_op_api.h")).read()
    exported = re.findall(r"VERIFYD_OP_EXPORT[^;(]*?\b(verifyd_\w+)\s*\(", header)
    if len(exported) < 10:
        bad.append(f"found only {len(exported)} exported functions in verify_op_api.h")
    client = "".join(open(m.__file__).read() for m in (kernel_op, switch))
    for name in exported:
        if not re.search(rf"\b{name}\b", client):
            bad.append(f"{name}: exported by verify_op_api.h, bound by neither kernel_op.py nor "
                       f"switch.py")
    source = open(os.path.join(ROOT, "kernels", "op", "verify_op.cu")).read()
    m = re.search(r"kAbiVersion\s*=\s*(\d+)", source)
    if m is None:
        bad.append("verify_op.cu: no kAbiVersion")
    elif int(m.group(1)) != kernel_op.ABI_VERSION:
        bad.append(f"ABI version: the library's {m.group(1)}, the client's {kernel_op.ABI_VERSION}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
