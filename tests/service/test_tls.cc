// TLS on the TCP listeners: a throwaway CA and certificates made with the openssl CLI. A TLS
// client is served, a plaintext client is not; with a client CA, clients need a certificate;
// the admin token never travels in clear unless --insecure_admin_tcp says so.

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/service/daemon_fixture.h"

namespace verifyd {
namespace {

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A CA, a server certificate for localhost/127.0.0.1 and a client certificate, in `dir`.
struct Pki {
  std::string ca, server_cert, server_key, client_cert, client_key;
};

Pki MakePki(const std::string& dir) {
  const std::string script = R"(set -e
cd ")" + dir + R"("
key="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $key -keyout ca.key -out ca.pem -days 1 -subj /CN=verifyd-test-ca
openssl req $key -keyout server.key -out server.csr -subj /CN=localhost
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' >server.ext
openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \
  -extfile server.ext -out server.pem
openssl req $key -keyout client.key -out client.csr -subj /CN=verifyd-test-client
printf 'extendedKeyUsage=clientAuth\n' >client.ext
openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 \
  -extfile client.ext -out client.pem
)";
  std::ofstream(dir + "/pki.sh") << script;
  const int rc = std::system(("bash " + dir + "/pki.sh >" + dir + "/openssl.log 2>&1").c_str());
  EXPECT_EQ(rc, 0) << Read(dir + "/openssl.log");
  return {Read(dir + "/ca.pem"), Read(dir + "/server.pem"), Read(dir + "/server.key"),
          Read(dir + "/client.pem"), Read(dir + "/client.key")};
}

std::shared_ptr<grpc::Channel> TlsChannel(const std::string& target, const Pki& pki,
                                          bool client_cert) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = pki.ca;
  if (client_cert) {
    ssl.pem_private_key = pki.client_key;
    ssl.pem_cert_chain = pki.client_cert;
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(INT32_MAX);
  return grpc::CreateCustomChannel(target, grpc::SslCredentials(ssl), args);
}

// One Verify call on `channel` within 5 s.
grpc::Status Call(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = v1::VerifyService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::VerifyResponse resp;
  return stub->Verify(&ctx, testing::SmallRequest(3), &resp);
}

grpc::Status AdminStatus(const std::shared_ptr<grpc::Channel>& channel, const std::string& token,
                         v1::GetStatusResponse* s) {
  auto stub = v1::AdminService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  ctx.AddMetadata("authorization", "Bearer " + token);
  return stub->GetStatus(&ctx, v1::GetStatusRequest(), s);
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::TestDir("tls");
    pki_ = MakePki(dir_);
    ASSERT_FALSE(pki_.server_cert.empty());
  }
  DaemonOptions Options() {
    DaemonOptions o = testing::TestOptions(dir_);
    o.admin_listen = "127.0.0.1:0";
    o.admin_token = "t0ken";
    o.tls.cert_chain = pki_.server_cert;
    o.tls.private_key = pki_.server_key;
    return o;
  }
  std::unique_ptr<Daemon> Start(DaemonOptions o) {
    auto d = Daemon::Start(std::move(o));
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? std::move(*d) : nullptr;
  }
  std::string dir_;
  Pki pki_;
};

TEST_F(TlsTest, TcpListenersServeTlsAndRefusePlaintext) {
  auto d = Start(Options());
  ASSERT_TRUE(d);
  const std::string data = d->listen_addresses()[0], admin = d->admin_address();
  EXPECT_TRUE(Call(TlsChannel(data, pki_, false)).ok());
  const grpc::Status plain = Call(testing::Channel(data));
  EXPECT_FALSE(plain.ok());
  EXPECT_EQ(plain.error_code(), grpc::StatusCode::UNAVAILABLE) << plain.error_message();

  v1::GetStatusResponse s;
  EXPECT_TRUE(AdminStatus(TlsChannel(admin, pki_, false), "t0ken", &s).ok());
  EXPECT_EQ(s.mode(), v1::MODE_SHADOW);
  EXPECT_EQ(AdminStatus(testing::Channel(admin), "t0ken", &s).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // The unix socket stays plaintext: its file mode guards it.
  EXPECT_TRUE(Call(testing::Channel(d->listen_addresses()[1])).ok());
}

TEST_F(TlsTest, WithAClientCaClientsNeedACertificate) {
  DaemonOptions o = Options();
  o.tls.client_ca = pki_.ca;
  auto d = Start(o);
  ASSERT_TRUE(d);
  const std::string data = d->listen_addresses()[0];
  EXPECT_TRUE(Call(TlsChannel(data, pki_, true)).ok());
  EXPECT_EQ(Call(TlsChannel(data, pki_, false)).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Call(testing::Channel(data)).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, TheTokenIsRefusedOnPlaintextTcpUnlessAccepted) {
  DaemonOptions o = Options();
  o.tls = {};
  auto refused = Daemon::Start(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(
                "admin_listen: 127.0.0.1:0 is TCP without TLS and the admin token would travel "
                "in clear"),
            std::string::npos)
      << refused.status();
  o.insecure_admin_tcp = true;
  auto d = Start(o);
  ASSERT_TRUE(d);
  v1::GetStatusResponse s;
  EXPECT_TRUE(AdminStatus(testing::Channel(d->admin_address()), "t0ken", &s).ok());
}

// A bad pair is found before anything slow starts (the engine, the start-up probe suite): the
// state directory, the first thing a start touches, is not even created.
TEST_F(TlsTest, AKeyThatDoesNotMatchTheCertificateFailsTheStart) {
  DaemonOptions o = Options();
  o.tls.private_key = pki_.client_key;
  o.probe.at_start = true;
  auto d = Daemon::Start(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("tls_key_file: not the key of the certificate in "
                                      "--tls_cert_file (check that --tls_key_file is the key of "
                                      "--tls_cert_file)"),
            std::string::npos)
      << d.status();
  EXPECT_FALSE(std::filesystem::exists(o.state_dir));
}

TEST_F(TlsTest, ASwappedCertificateAndKeyAreNamedBeforeTheProbeSuiteRuns) {
  DaemonOptions o = Options();
  std::swap(o.tls.cert_chain, o.tls.private_key);
  o.probe.at_start = true;
  auto d = Daemon::Start(o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().message(),
            "tls_cert_file: holds no PEM certificate (--tls_cert_file and --tls_key_file are "
            "swapped)");
  EXPECT_FALSE(std::filesystem::exists(o.state_dir));
}

}  // namespace
}  // namespace verifyd
