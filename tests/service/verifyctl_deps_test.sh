#!/usr/bin/env bash
# The kill switch must work on a node whose CUDA install is broken: verifyctl links no engine and
# loads no CUDA library at start (the static CUDA runtime inside it opens the driver only for
# `send --transport cuda_ipc`), and runs with nothing on LD_LIBRARY_PATH.
#   verifyctl_deps_test.sh VERIFYCTL
set -euo pipefail
verifyctl=$1
fail() { echo "FAIL: $*"; exit 1; }
if libs=$(ldd "$verifyctl" | grep -E "libcuda|libcudart|libcublas|libnvrtc"); then
  fail "verifyctl loads CUDA libraries at start: $libs"
fi
if engine=$(nm -C --defined-only "$verifyctl" | grep -E "verifyd::(CpuEngine|CudaEngine|MakeEngine|MakeCpuEngine)" | head -3); [ -n "$engine" ]; then
  fail "verifyctl links an engine: $engine"
fi
grep -q "^verifyctl " <(env -i "$verifyctl" --version) || fail "--version without an environment"
rc=0
env -i "$verifyctl" --admin=unix:/nonexistent/admin.sock --timeout 2 status >/dev/null 2>"${TMPDIR:-/tmp}/vctl.$$" || rc=$?
err=$(cat "${TMPDIR:-/tmp}/vctl.$$"); rm -f "${TMPDIR:-/tmp}/vctl.$$"
[ "$rc" = 1 ] || fail "status against no daemon: exit $rc: $err"
grep -q "UNAVAILABLE" <<<"$err" || fail "status against no daemon: $err"
echo "PASS: verifyctl links no engine and loads no CUDA library"
