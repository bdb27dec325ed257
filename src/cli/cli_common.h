#pragma once
// What every verifyctl subcommand shares: addresses, TLS, output format, channels, failure exits.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "src/common/admin_address.h"

namespace verifyd::cli {

struct GlobalOptions {
  std::string target = kDefaultDataAddress;  // data plane
  std::string admin = kDefaultAdminAddress;
  std::string admin_token_file;
  std::string admin_token;  // read from admin_token_file before any call
  // TLS for TCP addresses (Unix sockets stay plaintext): the CA that signed verifyd's
  // certificate, and this client's certificate and key where verifyd asks for one (mutual TLS).
  std::string tls_ca_file, tls_cert_file, tls_key_file;
  std::string tls_ca, tls_cert, tls_key;  // their PEM text, read by LoadTls before any call
  bool json = false;
  double timeout_s = 30;
};

// Reads the TLS files named in `g`; the error names the flag and the file.
absl::Status LoadTls(GlobalOptions* g);
// An address verifyctl can dial: HOST:PORT or unix:PATH. A bare path ("/run/verifyd/x.sock", or
// a socket that exists) is refused with the form to write instead; `flag` names the option.
absl::Status CheckAddress(const char* flag, const std::string& address);
bool IsTcp(const std::string& address);

// A channel with large message limits (bundles can be ~1 GiB), over TLS for a TCP address when
// --tls_ca_file is given.
std::shared_ptr<grpc::Channel> MakeChannel(const GlobalOptions& g, const std::string& address);
// Client context with the deadline and, for admin calls, the bearer token.
std::unique_ptr<grpc::ClientContext> MakeContext(const GlobalOptions& g, bool admin);

// "FAILED_PRECONDITION" for grpc::StatusCode::FAILED_PRECONDITION.
std::string CodeName(int code);
// What the operator may have got wrong when a call failed with `code` and `message`: another
// service's socket, no socket, a plaintext client of a TLS port, a failed TLS handshake; empty
// when nothing is known. `admin` says which service was called: the admin API (--admin) or the
// data plane (--target).
std::string AddressHint(const GlobalOptions& g, bool admin, int code, const std::string& message);
// "message (hint)", or the one that is not empty.
std::string WithHint(const std::string& message, const std::string& hint);
// gRPC's own log lines (a failed handshake) off unless GRPC_VERBOSITY says otherwise: each
// failure is the one line Fail prints.
void QuietGrpcLog();

// Prints one line "verifyctl: <what>: <message>" (or {"error": ...} with --json); returns 1.
// A gRPC failure's message starts with its code name: "verifyctl: flip: FAILED_PRECONDITION: ...".
// The status's message carries AddressHint's hint; `admin` says which service was called.
int Fail(const GlobalOptions& g, const std::string& what, const grpc::Status& st,
         bool admin = true);
int Fail(const GlobalOptions& g, const std::string& what, const std::string& message);
void PrintJson(const nlohmann::json& j);

}  // namespace verifyd::cli
