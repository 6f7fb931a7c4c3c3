// A real OCI registry for tests: Debian's docker-registry (CNCF Distribution) serving from a temporary
// directory on a free loopback port, started by the test and stopped (SIGTERM, then SIGKILL) when the
// object is destroyed. No mock: push and pull talk to the same server a user would run.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dp::test {

class RegistryServer {
 public:
  struct Options {
    // Contents of an htpasswd file (bcrypt entries); empty: no basic authentication.
    std::string htpasswd;
    // Bearer-token authentication (the docker token flow) when `realm` is set: the registry sends
    // clients to `realm` and accepts JWTs from `issuer` for `service` signed by a key of `root_cert_pem`.
    struct Token {
      std::string realm, service, issuer, root_cert_pem;
    } token;
  };

  // The docker-registry binary on PATH or at /usr/bin/docker-registry; empty when not installed
  // (tests then GTEST_SKIP, naming the Debian package).
  static std::filesystem::path find_binary();

  // Starts the server and waits until GET /v2/ answers; throws std::runtime_error with the server's
  // log on failure.
  explicit RegistryServer(Options options = {});
  ~RegistryServer();
  RegistryServer(const RegistryServer&) = delete;
  RegistryServer& operator=(const RegistryServer&) = delete;

  std::string host() const;  // "127.0.0.1:<port>"
  int port() const { return port_; }
  // The registry's storage root and where it keeps a blob (for corruption tests).
  const std::filesystem::path& storage() const { return storage_; }
  std::filesystem::path blob_path(std::string_view digest) const;

  // A minimal HTTP/1.1 exchange over a socket, for setting up cases the client under test refuses to
  // create (foreign manifests). Throws std::runtime_error on transport failure.
  struct Response {
    int status = 0;
    std::string headers;
    std::string body;
  };
  Response http(std::string_view method, std::string_view target, const std::vector<std::string>& headers = {},
                std::string_view body = {}) const;

  std::string log() const;

 private:
  bool start(const std::filesystem::path& binary, std::string& why);
  void stop();

  std::filesystem::path root_;
  std::filesystem::path storage_;
  std::filesystem::path log_;
  Options options_;
  int port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace dp::test
