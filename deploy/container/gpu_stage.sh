#!/usr/bin/env bash
# Stages a CUDA build's install for gpu_golden_check.sh on a GPU machine that has the CUDA
# toolkit's libraries but not the project's other dependencies: the binaries the CUDA image
# ships, and the shared libraries its runtime stage installs from Ubuntu packages (those that
# tests/packaging/check_container_recipe.py's table does not place in ubuntu:24.04 itself, in
# the CUDA runtime image or in the driver), taken from this host.
#   deploy/container/gpu_stage.sh STAGE OUT
# STAGE: `DESTDIR=STAGE cmake --install` of a CUDA build, e.g. WORK/stage after
#   deploy/container/check_build_steps.sh --dockerfile deploy/container/Dockerfile.cuda WORK
# OUT gets bin/ (verifyd, verifyctl, verifyd-replay when built), lib/ and libraries.txt (each
# library with the Ubuntu 24.04 package the image has it from).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
stage=${1:?usage: gpu_stage.sh STAGE OUT}
out=${2:?usage: gpu_stage.sh STAGE OUT}
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for b in verifyd verifyctl verifyd-replay; do
  if [ -x "$stage/usr/bin/$b" ]; then
    cp "$stage/usr/bin/$b" "$out/bin/"
    strip --strip-debug "$out/bin/$b"
  fi
done
[ -x "$out/bin/verifyd" ] || { echo "gpu_stage: no $stage/usr/bin/verifyd" >&2; exit 1; }
python3 - "$root/tests/packaging" "$out" <<'PY'
import os, re, shutil, subprocess, sys
sys.path.insert(0, sys.argv[1])
import check_container_recipe as c  # noqa: E402 - the one soname -> package table
out = sys.argv[2]
provided = c.UBUNTU_BASE | c.CUDA_RUNTIME | c.DRIVER
rows = []
for b in sorted(os.listdir(os.path.join(out, "bin"))):
    r = subprocess.run(["ldd", os.path.join(out, "bin", b)], capture_output=True, text=True,
                       check=True)
    for soname, path in re.findall(r"^\s*(\S+)\s+=>\s+(/\S+)", r.stdout, re.M):
        pkg = c.ubuntu_package(soname)
        if pkg is None:
            sys.exit(f"gpu_stage: {soname} ({b}) has no Ubuntu 24.04 package in the table")
        if pkg not in provided and not os.path.exists(os.path.join(out, "lib", soname)):
            shutil.copy(os.path.realpath(path), os.path.join(out, "lib", soname))
            rows.append(f"{soname}\t{pkg}")
with open(os.path.join(out, "libraries.txt"), "w") as f:
    f.write("\n".join(sorted(rows)) + "\n")
PY
echo "gpu_stage: $out ($(du -sh "$out" | cut -f1)): $(ls "$out/bin" | tr '\n' ' ')+ $(ls "$out/lib" | wc -l) libraries"
