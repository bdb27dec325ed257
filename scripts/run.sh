#!/usr/bin/env bash
# Installs what is missing, builds, and runs verifyd in the foreground on the embedded default:
# CUDA engine when a GPU is visible, else the CPU engine; local ports; state under ./run/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install_deps.sh"
"$root/scripts/build.sh" --target verifyd verifyctl
build=${BUILD_DIR:-$root/build}
mkdir -p "$root/run"
cat <<EOT

verifyd is starting (Ctrl-C stops it). In another shell:
  $build/src/cli/verifyctl --admin=unix:$root/run/admin.sock status
  $build/src/cli/verifyctl send --shape 4,16,8,4096 --count 20 --concurrency 2
  curl -s 127.0.0.1:9464/metrics | grep ^verifyd_
  $build/src/cli/verifyctl --admin=unix:$root/run/admin.sock flip custom --reason "looks good"

EOT
exec "$build/src/main/verifyd" --listen=127.0.0.1:50051 --admin_listen="unix:$root/run/admin.sock" \
  --metrics_address=127.0.0.1:9464 --state_dir="$root/run/state" --engine=auto "$@"
