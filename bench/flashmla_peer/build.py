#!/usr/bin/env python3
"""Builds FlashMLA's dense decode (bf16, sm_90a) as a torch extension on the GPU machine, from
the folder prepare.sh laid out, and copies the module to OUT_DIR (flashmla_dense.so, a few MB;
carry it into later device calls instead of rebuilding):

    python3 build.py PEER_DIR OUT_DIR      (MAX_JOBS: parallel compiles, default 16)
"""

import os
import shutil
import sys
import time

from torch.utils.cpp_extension import CUDA_HOME, load


def main():
    peer, out = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    csrc = os.path.join(peer, "src", "csrc")
    os.environ.setdefault("MAX_JOBS", "16")
    build = os.path.join(peer, "build")
    os.makedirs(build, exist_ok=True)
    flags = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-DFLASH_MLA_DISABLE_FP16",
             "-Wno-deprecated-declarations", "-U__CUDA_NO_HALF_OPERATORS__",
             "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
             "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr",
             "--expt-extended-lambda", "--use_fast_math", "-lineinfo",
             "-gencode", "arch=compute_90a,code=sm_90a"]
    includes = [csrc, os.path.join(csrc, "kerutils", "include"), os.path.join(csrc, "sm90"),
                os.path.join(csrc, "cutlass", "include"),
                os.path.join(csrc, "cutlass", "tools", "util", "include")]
    # CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl, which nvcc finds by itself and the
    # host compiler of the module's C++ file does not.
    cccl = os.path.join(CUDA_HOME or "/usr/local/cuda", "include", "cccl")
    if os.path.isdir(cccl):
        includes.append(cccl)
    t0 = time.monotonic()
    mod = load(name="flashmla_dense",
               sources=[os.path.join(peer, "flashmla_dense_decode.cpp"),
                        os.path.join(csrc, "smxx/decode/get_decoding_sched_meta/"
                                     "get_decoding_sched_meta.cu"),
                        os.path.join(csrc, "smxx/decode/combine/combine.cu"),
                        os.path.join(csrc, "sm90/decode/dense/instantiations/bf16.cu")],
               extra_include_paths=includes,
               extra_cflags=["-O3", "-std=c++20", "-DNDEBUG", "-DFLASH_MLA_DISABLE_FP16",
                             "-Wno-deprecated-declarations"],
               extra_cuda_cflags=flags, build_directory=build, verbose=False)
    os.makedirs(out, exist_ok=True)
    shutil.copy(mod.__file__, os.path.join(out, "flashmla_dense.so"))
    shutil.copy(os.path.join(peer, "SOURCES"), os.path.join(out, "SOURCES"))
    print(f"flashmla peer built in {time.monotonic() - t0:.0f} s: {out}/flashmla_dense.so")


if __name__ == "__main__":
    main()
