#!/usr/bin/env bash
# Installs the Debian packages verifyd builds with, if any is missing. nvcc is optional: with
# CUDA installed (/usr/local/cuda) the kernels and the CUDA engine build too. clang-14 builds the
# libFuzzer targets (tests/fuzz/run_fuzz.sh). etcd-server (/usr/bin/etcd, 3.4) is run by
# tests/fleet/test_etcd_source as an unprivileged process on loopback ports and a temporary data
# directory; its packaged systemd unit is not used.
# python3-torch (1.13, CPU) is not in the list: tests/python/test_adapters.py passes with it (13
# tests in 0.7 s) and skips without it, but on Debian 12 it adds 285 packages (OpenCV, GDAL, Qt,
# LLVM 15 among them) beside these: 205 MB to download (20.6 s here) and 844 MB installed, whose
# unpacking alone took 67 s; the quick lane's 20 minutes have no room for it.
set -euo pipefail
packages=(
  build-essential cmake git pkg-config curl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev prometheus-cpp-dev libcpp-httplib-dev
  libtbb-dev nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev libssl-dev libsystemd-dev openssl
  python3-numpy python3-grpcio python3-protobuf python3-yaml prometheus
  python3-pip python3-setuptools python3-wheel systemd
  clang-14 libclang-rt-14-dev clang-format
  etcd-server
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "installing: ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -q
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
