#pragma once
// The size of a unary Verify call's request, declared by the client in its initial metadata
// before the message itself. verifyd checks it against --max_message_mb and admits it to the
// memory budget (--max_inflight_mb) before it receives the message: a call that does not fit is
// refused at once (RESOURCE_EXHAUSTED), without its bytes being read. A message larger than it
// declared is refused (INVALID_ARGUMENT naming the key). A call without the key is admitted
// after its message has arrived. Messages on VerifyStream are admitted one by one after they
// arrive, as before. verifyctl and the Python client (verifyd_client.client.REQUEST_BYTES_KEY)
// send it on every unary Verify call.

#include <cstddef>
#include <string>

#include "grpcpp/client_context.h"

namespace verifyd {

// The value is the serialized request's size in bytes, in decimal digits only.
inline constexpr char kRequestBytesKey[] = "verifyd-request-bytes";

// Declares, on a unary Verify call's context, the size of the request it will send.
inline void DeclareRequestBytes(grpc::ClientContext* ctx, size_t bytes) {
  ctx->AddMetadata(kRequestBytesKey, std::to_string(bytes));
}

}  // namespace verifyd
