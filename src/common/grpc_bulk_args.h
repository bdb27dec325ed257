#pragma once
// gRPC channel arguments for messages of tens of MB (inline bundles), used by verifyd's data
// plane and by verifyctl: 16 MiB HTTP/2 frames instead of 16 KiB, a 64 MiB initial flow-control
// window so that a bundle is not held back by window updates, and socket reads of up to 16 MiB.

#include <grpc/grpc.h>

namespace verifyd {

// `Args` is grpc::ChannelArguments or anything with SetInt(name, value).
template <typename Args>
void SetBulkTransferArgs(Args& args) {
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (1 << 24) - 1);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  args.SetInt(GRPC_ARG_TCP_READ_CHUNK_SIZE, 1 << 20);
  args.SetInt(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 64 << 10);
  args.SetInt(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 16 << 20);
}

}  // namespace verifyd
