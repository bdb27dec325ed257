#pragma once
// What every verifyctl subcommand shares: addresses, output format, channels, failure exits.

#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "src/common/admin_address.h"

namespace verifyd::cli {

struct GlobalOptions {
  std::string target = "127.0.0.1:50051";  // data plane
  std::string admin = kDefaultAdminAddress;
  std::string admin_token_file;
  std::string admin_token;  // read from admin_token_file before any call
  bool json = false;
  double timeout_s = 30;
};

// A channel with large message limits (bundles can be ~1 GiB).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target);
// Client context with the deadline and, for admin calls, the bearer token.
std::unique_ptr<grpc::ClientContext> MakeContext(const GlobalOptions& g, bool admin);

// "FAILED_PRECONDITION" for grpc::StatusCode::FAILED_PRECONDITION.
std::string CodeName(int code);

// Prints one line "verifyctl: <what>: <message>" (or {"error": ...} with --json); returns 1.
// A gRPC failure's message starts with its code name: "verifyctl: flip: FAILED_PRECONDITION: ...".
int Fail(const GlobalOptions& g, const std::string& what, const grpc::Status& st);
int Fail(const GlobalOptions& g, const std::string& what, const std::string& message);
void PrintJson(const nlohmann::json& j);

}  // namespace verifyd::cli
