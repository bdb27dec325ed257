#pragma once
// A failed call on a transport that goes on after it (the stream, a call channel): the error in
// the response, in error_code and error_message, with the call's request id.

#include <string>

#include "absl/status/status.h"
#include "verifyd/v1/verify.pb.h"

namespace verifyd {

inline void ErrorInResponse(const absl::Status& st, const std::string& request_id,
                            v1::VerifyResponse* resp) {
  resp->Clear();
  resp->set_request_id(request_id);
  resp->set_error_code(static_cast<int>(st.code()));
  resp->set_error_message(std::string(st.message()));
}

}  // namespace verifyd
