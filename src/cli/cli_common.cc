#include "src/cli/cli_common.h"

#include <chrono>
#include <iostream>

#include "absl/status/status.h"

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
  if (admin && !g.admin_token.empty()) ctx->AddMetadata("authorization", "Bearer " + g.admin_token);
  return ctx;
}

std::string CodeName(int code) {
  // gRPC and absl share the canonical codes.
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

namespace {

int FailWith(const GlobalOptions& g, const std::string& what, const std::string& code,
             const std::string& message) {
  const std::string line = code.empty() ? message : code + ": " + message;
  if (g.json) {
    nlohmann::json j = {{"error", what + ": " + line}};
    if (!code.empty()) j["code"] = code;
    PrintJson(j);
  } else {
    std::cerr << "verifyctl: " << what << ": " << line << "\n";
  }
  return 1;
}

}  // namespace

int Fail(const GlobalOptions& g, const std::string& what, const std::string& message) {
  return FailWith(g, what, "", message);
}

int Fail(const GlobalOptions& g, const std::string& what, const grpc::Status& st) {
  return FailWith(g, what, CodeName(st.error_code()), st.error_message());
}

void PrintJson(const nlohmann::json& j) { std::cout << j.dump(2) << "\n"; }

}  // namespace verifyd::cli
