#!/usr/bin/env bash
# Installs what is missing, builds, and runs verifyd in the foreground for development: the CUDA
# engine when a GPU is visible, else the CPU engine; the data plane on TCP and on a Unix socket
# (regions and call channels need the socket); state under ./run/ (RUN_DIR overrides it).
#
# A development gate: the flip to canary/custom needs --gate_window clean comparisons in a row,
# 1000 by default. On the CPU engine a call takes about a second, so this script starts verifyd
# with --gate_window=20 (RUN_GATE_WINDOW overrides it). Production keeps the default (deploy/).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install_deps.sh"
"$root/scripts/build.sh" --target verifyd verifyctl verifyd-replay
build=${BUILD_DIR:-$root/build}
run=${RUN_DIR:-$root/run}
gate=${RUN_GATE_WINDOW:-20}
mkdir -p "$run"
cat <<EOT

verifyd is starting (Ctrl-C stops it), with a development gate of $gate clean comparisons.
In another shell:
  export VERIFYD_TARGET=unix:$run/verifyd.sock VERIFYD_ADMIN=unix:$run/admin.sock
  $build/src/cli/verifyctl status
  $build/src/cli/verifyctl send --shape 2,8,8,1024 --count $gate --compare_sync
  curl -s 127.0.0.1:9464/metrics | grep ^verifyd_requests
  $build/src/cli/verifyctl flip custom --reason "looks good"

EOT
exec "$build/src/main/verifyd" --listen=127.0.0.1:50051 --listen="unix:$run/verifyd.sock" \
  --admin_listen="unix:$run/admin.sock" --metrics_address=127.0.0.1:9464 \
  --state_dir="$run/state" --engine=auto --gate_window="$gate" "$@"
