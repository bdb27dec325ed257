#include "src/cli/cli_common.h"

#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "fmt/format.h"
#include "src/common/pem_file.h"

namespace verifyd::cli {
namespace {

// `path`'s PEM text into `out`; nothing for an empty path.
absl::Status ReadPem(const char* flag, const std::string& path, std::string* out) {
  if (path.empty()) return absl::OkStatus();
  absl::StatusOr<std::string> pem = ReadPemFile(flag, path);
  if (!pem.ok()) return pem.status();
  *out = *std::move(pem);
  return absl::OkStatus();
}

bool IsUnix(const std::string& address) { return absl::StartsWith(address, "unix:"); }

// The path of a unix:PATH or unix://PATH address.
std::string UnixPath(const std::string& address) {
  return address.substr(absl::StartsWith(address, "unix://") ? 7 : 5);
}

}  // namespace

absl::Status LoadTls(GlobalOptions* g) {
  if (g->tls_cert_file.empty() != g->tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_cert_file, --tls_key_file: give both (a client certificate and its key) or "
        "neither");
  }
  if (absl::Status st = ReadPem("--tls_ca_file", g->tls_ca_file, &g->tls_ca); !st.ok()) return st;
  if (absl::Status st = ReadPem("--tls_cert_file", g->tls_cert_file, &g->tls_cert); !st.ok()) {
    return st;
  }
  return ReadPem("--tls_key_file", g->tls_key_file, &g->tls_key);
}

bool IsTcp(const std::string& address) {
  return !IsUnix(address) && !absl::StartsWith(address, "unix-abstract:");
}

absl::Status CheckAddress(const char* flag, const std::string& address) {
  if (!IsTcp(address)) return absl::OkStatus();
  struct stat st {};
  const bool path = absl::StartsWith(address, "/") || absl::StartsWith(address, "./") ||
                    absl::StartsWith(address, "../") ||
                    (::stat(address.c_str(), &st) == 0 && S_ISSOCK(st.st_mode));
  if (!path) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(flag, ": '", address, "' is a path; a Unix socket is written unix:", address,
                   " (TCP is HOST:PORT)"));
}

void QuietGrpcLog() { setenv("GRPC_VERBOSITY", "NONE", 0); }

std::shared_ptr<grpc::Channel> MakeChannel(const GlobalOptions& g, const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(INT32_MAX);
  args.SetMaxSendMessageSize(INT32_MAX);
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (IsTcp(address) && (!g.tls_ca.empty() || !g.tls_cert.empty())) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = g.tls_ca;  // empty: the system's roots
    ssl.pem_cert_chain = g.tls_cert;
    ssl.pem_private_key = g.tls_key;
    creds = grpc::SslCredentials(ssl);
  }
  return grpc::CreateCustomChannel(address, creds, args);
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

std::string AddressHint(const GlobalOptions& g, bool admin, int code, const std::string& message) {
  const std::string& address = admin ? g.admin : g.target;
  const char* flags = admin ? "--admin or VERIFYD_ADMIN" : "--target or VERIFYD_TARGET";
  const char* service = admin ? "the admin API" : "the data plane";
  const auto c = static_cast<grpc::StatusCode>(code);
  if (c == grpc::StatusCode::UNIMPLEMENTED && absl::StripPrefix(message, "stream: ").empty()) {
    // gRPC's answer for a service the server does not have: the other socket was given.
    return fmt::format("{} does not serve {}: is it verifyd's {} socket? Give {}'s address with {}",
                       address, service, admin ? "data" : "admin", service, flags);
  }
  if (c != grpc::StatusCode::UNAVAILABLE) return "";
  if (!IsTcp(address)) {
    const std::string path = UnixPath(address);
    const bool is_default = address == (admin ? kDefaultAdminAddress : kDefaultDataAddress);
    if (absl::StrContains(message, "No such file or directory")) {
      return fmt::format("no socket at {}{}: is verifyd running? Give its {} socket with {}", path,
                         is_default ? ", the default" : "", admin ? "admin" : "data", flags);
    }
    if (absl::StrContains(message, "Permission denied")) {
      return fmt::format(
          "this user may not connect to {}: the data socket admits verifyd's user and the group "
          "of --data_socket_group, the admin socket verifyd's user only",
          path);
    }
    return "";
  }
  if (g.tls_ca.empty() && g.tls_cert.empty()) {
    // A TLS server closes a plaintext client's connection without a word.
    if (absl::StrContains(message, "Socket closed") ||
        absl::StrContains(message, "Connection reset") || absl::StrContains(message, "EOF")) {
      return fmt::format(
          "is {} serving TLS? pass --tls_ca_file (VERIFYD_TLS_CA_FILE) with the CA that signed "
          "its certificate",
          address);
    }
    return "";
  }
  if (g.tls_cert.empty() && absl::StrContains(message, "Socket closed")) {
    // Under TLS 1.3 a server that wants a client certificate closes the connection after the
    // handshake.
    return fmt::format(
        "does {} require a client certificate (--tls_client_ca_file)? pass --tls_cert_file and "
        "--tls_key_file (VERIFYD_TLS_CERT_FILE, VERIFYD_TLS_KEY_FILE)",
        address);
  }
  if (absl::StrContains(message, "andshake") || absl::StrContains(message, "SSL") ||
      absl::StrContains(message, "ssl") || absl::StrContains(message, "certificate")) {
    return fmt::format(
        "TLS with {} failed: does it serve TLS with a certificate that --tls_ca_file signed, for "
        "this host name? With --tls_client_ca_file, verifyd also needs --tls_cert_file and "
        "--tls_key_file from this client",
        address);
  }
  return "";
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

std::string WithHint(const std::string& message, const std::string& hint) {
  if (hint.empty()) return message;
  return message.empty() ? hint : message + " (" + hint + ")";
}

int Fail(const GlobalOptions& g, const std::string& what, const grpc::Status& st, bool admin) {
  return FailWith(
      g, what, CodeName(st.error_code()),
      WithHint(st.error_message(), AddressHint(g, admin, st.error_code(), st.error_message())));
}

void PrintJson(const nlohmann::json& j) { std::cout << j.dump(2) << "\n"; }

}  // namespace verifyd::cli
