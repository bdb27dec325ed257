# Sourced by gpu_stack_bench.sh and gpu_stack_rounds.sh, with PACK set: a scratch folder `dir`;
# the Python client's stubs and the pack's libraries on their paths; MPS's pipe and log folders
# under `dir`, its control program `mps_ctl` and `quit_mps`; a trap that quits MPS and stops the
# script's jobs when it exits; and `status` 0.
dir=$(mktemp -d)
export VERIFYD_CLIENT_GEN=$PACK/py/gen
export LD_LIBRARY_PATH="$PACK/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export CUDA_MPS_PIPE_DIRECTORY=$dir/mps-pipe CUDA_MPS_LOG_DIRECTORY=$dir/mps-log
mps_ctl=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)
quit_mps() { echo quit | "$mps_ctl" > /dev/null 2>&1 || true; }
trap 'quit_mps; kill $(jobs -p) 2>/dev/null || true' EXIT
status=0
