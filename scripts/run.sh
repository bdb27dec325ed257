#!/usr/bin/env bash
# Installs what is missing, builds, and runs verifyd in the foreground for development: the CUDA
# engine when a GPU is visible, else the CPU engine; the data plane on TCP and on a Unix socket
# (regions and call channels need the socket); state under ./run/.
#
# A development gate: the flip to canary/custom needs --gate_window clean comparisons in a row,
# 1000 by default. On the CPU engine a call takes a fraction of a second, so this script starts
# verifyd with --gate_window=20. Production keeps the default (deploy/).
#
# Every default below can be changed, so that two development daemons can run side by side:
#   RUN_DIR          sockets and state (default ./run)
#   RUN_TCP          the data plane's TCP address (default 127.0.0.1:50051; "off": none)
#   RUN_METRICS      /metrics, /healthz, /readyz (default 127.0.0.1:9464)
#   RUN_GATE_WINDOW  the development gate (default 20)
#   BUILD_DIR        where the binaries are built (default ./build)
#   RUN_NO_BUILD=1   run the binaries in BUILD_DIR as they are: no package check, no build
# Extra arguments go to verifyd and replace the script's own value of the same flag
# (scripts/run.sh --listen=unix:/tmp/v.sock --gate_window=100 listens only there, with a gate of
# 100); `verifyd --help` lists every flag.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
if [ "${RUN_NO_BUILD:-0}" != 1 ]; then
  "$root/scripts/install_deps.sh"
  BUILD_DIR=$build "$root/scripts/build.sh" --target verifyd verifyctl verifyd-replay
fi
run=${RUN_DIR:-$root/run}
tcp=${RUN_TCP:-127.0.0.1:50051}
metrics=${RUN_METRICS:-127.0.0.1:9464}
gate=${RUN_GATE_WINDOW:-20}
state=$run/state
engine=auto
admin=unix:$run/admin.sock
listen=(--listen="unix:$run/verifyd.sock")
[ "$tcp" = off ] || listen=(--listen="$tcp" "${listen[@]}")

# The flags given on the command line; each replaces the default of the same name. A --listen
# given replaces both default listeners (give each one wanted).
given=()
data=
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  a=${args[i]}
  case $a in
    --*=*) name=${a%%=*} value=${a#*=} ;;
    --*) name=$a value=${args[i + 1]:-} ;;
    *) continue ;;
  esac
  given+=("$name")
  case $name in
    --gate_window) gate=$value ;;
    --metrics_address) metrics=$value ;;
    --admin_listen) admin=$value ;;
    --state_dir) state=$value ;;
    --engine) engine=$value ;;
    --listen)
      listen=()
      # The banner's data address: the first Unix socket given, else the first address.
      for part in ${value//,/ }; do
        if [ -z "${data:-}" ] || { [[ $part == unix:* ]] && [[ $data != unix:* ]]; }; then
          data=$part
        fi
      done
      ;;
  esac
done
has() {
  local g
  for g in "${given[@]+"${given[@]}"}"; do [ "$g" = "$1" ] && return 0; done
  return 1
}
defaults=("${listen[@]}")
has --admin_listen || defaults+=(--admin_listen="$admin")
has --metrics_address || defaults+=(--metrics_address="$metrics")
has --state_dir || defaults+=(--state_dir="$state")
has --engine || defaults+=(--engine="$engine")
has --gate_window || defaults+=(--gate_window="$gate")

has --listen || data=unix:$run/verifyd.sock
shown=$metrics
note=
if [[ $metrics == *:0 ]]; then
  shown=${metrics%:0}:PORT
  note="(PORT: the one verifyd's 'metrics on' line names)"
fi
mkdir -p "$run"
cat <<EOT

verifyd is starting (Ctrl-C stops it), with a development gate of $gate clean comparisons.
In another shell:
  export VERIFYD_TARGET=$data VERIFYD_ADMIN=$admin
  $build/src/cli/verifyctl status
  $build/src/cli/verifyctl send --shape 2,8,8,1024 --count $gate --compare_sync
  curl -s $shown/metrics | grep ^verifyd_requests
  $build/src/cli/verifyctl flip custom --reason "looks good"
$note
EOT
exec "$build/src/main/verifyd" "${defaults[@]}" "$@"
