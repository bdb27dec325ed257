#!/usr/bin/env bash
# Generates the Python stubs of proto/verifyd/v1/*.proto for verifyd_client, without CMake.
#   clients/python/generate.sh [OUT_DIR]     (default: clients/python/verifyd_client/_gen)
# Needs Debian's protobuf-compiler (protoc) and protobuf-compiler-grpc (grpc_python_plugin).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
proto_root=$(cd "$here/../../proto" && pwd)
out=${1:-$here/verifyd_client/_gen}
protoc=${PROTOC:-protoc}
plugin=${GRPC_PYTHON_PLUGIN:-$(command -v grpc_python_plugin || true)}
die() { echo "generate.sh: $*" >&2; exit 1; }
command -v "$protoc" >/dev/null || die "protoc not found (apt-get install protobuf-compiler)"
[ -n "$plugin" ] || die "grpc_python_plugin not found (apt-get install protobuf-compiler-grpc)"
mkdir -p "$out"
"$protoc" --proto_path="$proto_root" --python_out="$out" --grpc_python_out="$out" \
  --plugin=protoc-gen-grpc_python="$plugin" "$proto_root"/verifyd/v1/*.proto
echo "Python stubs in $out"
