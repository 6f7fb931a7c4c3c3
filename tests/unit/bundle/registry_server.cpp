#include "registry_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace fs = std::filesystem;

namespace dp::test {
namespace {

// A port the kernel considers free right now. Another process could take it before the registry binds
// it; start() notices ("address already in use") and tries another.
int free_port() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) throw std::runtime_error("socket: " + std::string(std::strerror(errno)));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(s);
    throw std::runtime_error("cannot bind a loopback port: " + std::string(std::strerror(errno)));
  }
  int port = ntohs(a.sin_port);
  ::close(s);
  return port;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

fs::path RegistryServer::find_binary() {
  if (const char* path = std::getenv("PATH")) {
    std::string_view rest = path;
    while (!rest.empty()) {
      size_t colon = rest.find(':');
      fs::path candidate = fs::path(std::string(rest.substr(0, colon))) / "docker-registry";
      if (!candidate.parent_path().empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate;
      if (colon == std::string_view::npos) break;
      rest.remove_prefix(colon + 1);
    }
  }
  if (::access("/usr/bin/docker-registry", X_OK) == 0) return "/usr/bin/docker-registry";
  return {};
}

RegistryServer::RegistryServer(Options options) : options_(std::move(options)) {
  fs::path binary = find_binary();
  if (binary.empty()) throw std::runtime_error("docker-registry not found on PATH or at /usr/bin/docker-registry");
  std::random_device rd;
  root_ = fs::temp_directory_path() / ("dp-registry-" + std::to_string(rd()) + std::to_string(rd()));
  storage_ = root_ / "storage";
  log_ = root_ / "registry.log";
  fs::create_directories(storage_);
  std::string why;
  for (int attempt = 0; attempt < 5; ++attempt) {
    if (start(binary, why)) return;
    if (why.find("address already in use") == std::string::npos) break;
  }
  std::error_code ec;
  fs::remove_all(root_, ec);
  throw std::runtime_error("docker-registry did not start: " + why);
}

RegistryServer::~RegistryServer() {
  stop();
  std::error_code ec;
  fs::remove_all(root_, ec);
}

bool RegistryServer::start(const fs::path& binary, std::string& why) {
  port_ = free_port();
  std::ostringstream cfg;
  cfg << "version: 0.1\n"
      << "log:\n  level: info\n  accesslog:\n    disabled: true\n"
      << "storage:\n  filesystem:\n    rootdirectory: " << storage_.string() << "\n"
      << "  delete:\n    enabled: true\n"
      << "http:\n  addr: 127.0.0.1:" << port_ << "\n";
  if (!options_.htpasswd.empty()) {
    std::ofstream(root_ / "htpasswd") << options_.htpasswd;
    cfg << "auth:\n  htpasswd:\n    realm: decodepack-test\n    path: " << (root_ / "htpasswd").string() << "\n";
  } else if (!options_.token.realm.empty()) {
    std::ofstream(root_ / "token-root.pem") << options_.token.root_cert_pem;
    cfg << "auth:\n  token:\n    realm: " << options_.token.realm << "\n    service: " << options_.token.service
        << "\n    issuer: " << options_.token.issuer << "\n    rootcertbundle: " << (root_ / "token-root.pem").string()
        << "\n";
  }
  std::ofstream(root_ / "config.yml") << cfg.str();

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::string bin = binary.string(), serve = "serve", conf = (root_ / "config.yml").string();
  char* argv[] = {bin.data(), serve.data(), conf.data(), nullptr};
  int rc = posix_spawn(&pid_, bin.c_str(), &fa, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    pid_ = -1;
    why = "posix_spawn " + bin + ": " + std::strerror(rc);
    return false;
  }

  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      why = "it exited; log:\n" + log();
      return false;
    }
    try {
      int code = http("GET", "/v2/").status;
      if (code == 200 || code == 401) return true;  // 401: up, with authentication
    } catch (const std::runtime_error&) {
      // not listening yet
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  why = "GET /v2/ did not answer within 20 s; log:\n" + log();
  stop();
  return false;
}

void RegistryServer::stop() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGTERM);
  for (int i = 0; i < 100; ++i) {  // up to 5 s for a clean exit
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

std::string RegistryServer::host() const { return "127.0.0.1:" + std::to_string(port_); }

fs::path RegistryServer::blob_path(std::string_view digest) const {
  std::string_view hex = digest.substr(digest.find(':') + 1);
  return storage_ / "docker/registry/v2/blobs/sha256" / std::string(hex.substr(0, 2)) / std::string(hex) / "data";
}

std::string RegistryServer::log() const { return read_file(log_); }

RegistryServer::Response RegistryServer::http(std::string_view method, std::string_view target,
                                              const std::vector<std::string>& headers, std::string_view body) const {
  int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0) throw std::runtime_error("socket: " + std::string(std::strerror(errno)));
  timeval tv{10, 0};
  ::setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port_));
  if (::connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(s);
    throw std::runtime_error("connect: " + std::string(std::strerror(errno)));
  }
  std::string req = std::string(method) + " " + std::string(target) + " HTTP/1.1\r\nHost: " + host() +
                    "\r\nConnection: close\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  for (const std::string& h : headers) req += h + "\r\n";
  req += "\r\n";
  req += body;
  for (size_t done = 0; done < req.size();) {
    ssize_t n = ::send(s, req.data() + done, req.size() - done, MSG_NOSIGNAL);
    if (n <= 0) {
      ::close(s);
      throw std::runtime_error("send failed");
    }
    done += static_cast<size_t>(n);
  }
  std::string raw;
  char buf[65536];
  while (true) {
    ssize_t n = ::recv(s, buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    raw.append(buf, static_cast<size_t>(n));
  }
  ::close(s);
  size_t head_end = raw.find("\r\n\r\n");
  if (raw.compare(0, 5, "HTTP/") != 0 || head_end == std::string::npos)
    throw std::runtime_error("no HTTP response");
  Response r;
  r.status = std::atoi(raw.c_str() + raw.find(' ') + 1);
  r.headers = raw.substr(0, head_end);
  r.body = raw.substr(head_end + 4);
  return r;
}

}  // namespace dp::test
