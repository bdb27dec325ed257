#include "src/cli/cli_common.h"

#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/strip.h"

namespace verifyd::cli {

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(INT32_MAX);
  args.SetMaxSendMessageSize(INT32_MAX);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

std::unique_ptr<grpc::ClientContext> MakeContext(const GlobalOptions& g, bool admin) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(g.timeout_s * 1000)));
  if (admin && !g.admin_token_file.empty()) {
    std::ifstream in(g.admin_token_file);
    std::stringstream ss;
    ss << in.rdbuf();
    ctx->AddMetadata("authorization",
                     "Bearer " + std::string(absl::StripAsciiWhitespace(ss.str())));
  }
  return ctx;
}

int Fail(const GlobalOptions& g, const std::string& what, const std::string& message) {
  if (g.json) {
    PrintJson({{"error", what + ": " + message}});
  } else {
    std::cerr << "verifyctl: " << what << ": " << message << "\n";
  }
  return 1;
}

int Fail(const GlobalOptions& g, const std::string& what, const grpc::Status& st) {
  static const char* kNames[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                                 "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                                 "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                 "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const int code = st.error_code();
  const std::string name = code >= 0 && code <= 16 ? kNames[code] : std::to_string(code);
  return Fail(g, what, name + ": " + st.error_message());
}

void PrintJson(const nlohmann::json& j) { std::cout << j.dump(2) << "\n"; }

}  // namespace verifyd::cli
