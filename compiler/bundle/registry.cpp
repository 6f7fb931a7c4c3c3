#include "bundle/registry.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "bundle/bundle.h"
#include "bundle/verify.h"
#include "common/error.h"
#include "common/text.h"
#include "common/fs.h"
#include "common/hash.h"
#include "common/json.h"
#include "common/output.h"

namespace fs = std::filesystem;

namespace dp::bundle {
namespace {

// Response headers are small; a registry sending more than this is refused rather than buffered.
constexpr size_t kMaxHeaderBytes = size_t{256} << 10;

// Blob transfers get one more second of deadline per this many bytes (options.timeout_s).
constexpr uint64_t kDeadlineBytesPerSecond = uint64_t{1} << 20;

constexpr std::string_view kRefForms =
    "expected host[:port]/repository:tag or host[:port]/repository@sha256:<64 hex digits>";

// ---------------------------------------------------------------------------------------------------
// Text helpers

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_lower_alnum(char c) { return (c >= 'a' && c <= 'z') || is_digit(c); }

constexpr char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  for (size_t i = 0; i < in.size(); i += 3) {
    uint32_t v = static_cast<uint8_t>(in[i]) << 16;
    if (i + 1 < in.size()) v |= static_cast<uint8_t>(in[i + 1]) << 8;
    if (i + 2 < in.size()) v |= static_cast<uint8_t>(in[i + 2]);
    out += kB64[(v >> 18) & 63];
    out += kB64[(v >> 12) & 63];
    out += i + 1 < in.size() ? kB64[(v >> 6) & 63] : '=';
    out += i + 2 < in.size() ? kB64[v & 63] : '=';
  }
  return out;
}

std::optional<std::string> base64_decode(std::string_view in) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    if (c == '=') break;
    const char* p = std::strchr(kB64, c);
    if (!p || c == '\0') return std::nullopt;
    acc = (acc << 6) | static_cast<uint32_t>(p - kB64);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// References

[[noreturn]] void bad_ref(std::string_view text, std::string_view what) {
  fail(Errc::usage, "invalid registry reference \"{}\": {}; {}", text, what, kRefForms);
}

// OCI distribution: path-component = [a-z0-9]+ ( ( '.' | '_' | '__' | '-'+ ) [a-z0-9]+ )*
bool valid_repo_component(std::string_view c) {
  size_t i = 0;
  while (true) {
    size_t start = i;
    while (i < c.size() && is_lower_alnum(c[i])) ++i;
    if (i == start) return false;  // empty, or a separator not followed by a letter or digit
    if (i == c.size()) return true;
    if (c[i] == '.') {
      ++i;
    } else if (c[i] == '_') {
      ++i;
      if (i < c.size() && c[i] == '_') ++i;
    } else if (c[i] == '-') {
      while (i < c.size() && c[i] == '-') ++i;
    } else {
      return false;
    }
  }
}

// OCI distribution: tag = [A-Za-z0-9_][A-Za-z0-9._-]{0,127}
bool valid_tag(std::string_view t) {
  auto word = [](char c) { return is_lower_alnum(c) || (c >= 'A' && c <= 'Z') || c == '_'; };
  if (t.empty() || t.size() > 128 || !word(t[0])) return false;
  return std::all_of(t.begin() + 1, t.end(), [&](char c) { return word(c) || c == '.' || c == '-'; });
}

// Splits host[:port] into the bare host name (IPv6 without brackets) and the port text.
std::pair<std::string_view, std::string_view> split_host(std::string_view h) {
  if (!h.empty() && h.front() == '[') {
    size_t close = h.find(']');
    if (close == std::string_view::npos) return {h.substr(1), {}};
    std::string_view rest = h.substr(close + 1);
    return {h.substr(1, close - 1), rest.empty() ? rest : rest.substr(1)};
  }
  size_t colon = h.find(':');
  if (colon == std::string_view::npos) return {h, {}};
  return {h.substr(0, colon), h.substr(colon + 1)};
}

std::string host_problem(std::string_view h) {
  auto [name, port] = split_host(h);
  bool has_port_sep = false;
  if (!h.empty() && h.front() == '[') {
    size_t close = h.find(']');
    if (close == std::string_view::npos) return "unclosed '[' in the host";
    std::string_view rest = h.substr(close + 1);
    if (!rest.empty() && rest.front() != ':') return "unexpected text after ']' in the host";
    has_port_sep = !rest.empty();
    if (name.empty() || !std::all_of(name.begin(), name.end(), [](char c) {
          return is_digit(c) || (ascii_lower(c) >= 'a' && ascii_lower(c) <= 'f') || c == ':' || c == '.';
        }))
      return fmt::format("'{}' is not an IPv6 address", name);
  } else {
    has_port_sep = h.find(':') != std::string_view::npos;
    if (name.empty()) return "empty host";
    size_t start = 0;
    while (true) {
      size_t dot = name.find('.', start);
      std::string_view label = name.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start);
      bool ok = !label.empty() && label.front() != '-' && label.back() != '-' &&
                std::all_of(label.begin(), label.end(), [](char c) { return is_lower_alnum(ascii_lower(c)) || c == '-'; });
      if (!ok) return fmt::format("host '{}' is not a valid host name", name);
      if (dot == std::string_view::npos) break;
      start = dot + 1;
    }
  }
  if (has_port_sep) {
    if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), is_digit))
      return fmt::format("port '{}' is not a number", port);
    int p = std::stoi(std::string(port));
    if (p < 1 || p > 65535) return fmt::format("port {} is out of range (1-65535)", p);
  }
  return {};
}

// ---------------------------------------------------------------------------------------------------
// HTTP over libcurl

void init_curl_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) fail(Errc::internal, "libcurl: global initialisation failed");
  });
}

struct Request {
  std::string method;  // GET, HEAD, POST, PUT
  std::string url;     // absolute
  std::vector<std::string> headers;
  std::string_view body;           // PUT body held in memory...
  const fs::path* body_file = nullptr;  // ...or streamed from a file
  uint64_t body_size = 0;
  // A 2xx response body goes here instead of Response::body; it may throw to abort the transfer.
  std::function<void(const char*, size_t)> sink;
  bool follow_redirects = false;  // blob downloads may be redirected to storage
  // Sent instead of the session's credentials (token requests go to another origin).
  std::optional<std::string> authorization;
  size_t max_body = kMaxSmallBody;  // a larger body that is not streamed to `sink` is refused
  uint64_t blob_bytes = 0;          // bytes of blob carried, which extend the deadline
  // Called before a retry of a request whose `sink` has already received data; without it such a
  // request is not retried.
  std::function<void()> restart;
  std::string progress;  // when set (and options.progress is), this transfer's bytes are reported under it
};

struct Response {
  long status = 0;
  std::map<std::string, std::string> headers;  // lower-case names; the first value of a repeated header
  std::string body;                            // when not streamed to a sink
  int attempts = 1;                            // with retries
};

struct Transfer {
  const Request* req = nullptr;
  Response* resp = nullptr;
  int body_fd = -1;
  std::string_view body_left;
  std::exception_ptr error;
  bool too_large = false;
  size_t header_bytes = 0;
  bool headers_too_large = false;
  bool sink_used = false;
  // Progress reports (Request::progress).
  const std::function<void(const TransferProgress&)>* progress = nullptr;
  std::chrono::steady_clock::time_point started, last_report;
  uint64_t moved = 0;
};

constexpr auto kProgressInterval = std::chrono::milliseconds(250);

int on_progress(void* ud, curl_off_t, curl_off_t dlnow, curl_off_t, curl_off_t ulnow) {
  auto* t = static_cast<Transfer*>(ud);
  const auto now = std::chrono::steady_clock::now();
  t->moved = static_cast<uint64_t>(t->req->method == "PUT" ? ulnow : dlnow);
  if (now - t->last_report < kProgressInterval) return 0;
  t->last_report = now;
  try {
    (*t->progress)({t->req->progress, t->moved, t->req->blob_bytes,
                    std::chrono::duration<double>(now - t->started).count(), false});
  } catch (...) {
    t->error = std::current_exception();
    return 1;  // aborts the transfer
  }
  return 0;
}

size_t on_header(char* p, size_t size, size_t n, void* ud) {
  auto* t = static_cast<Transfer*>(ud);
  t->header_bytes += size * n;
  if (t->header_bytes > kMaxHeaderBytes) {
    t->headers_too_large = true;
    return 0;  // makes curl stop
  }
  std::string_view line = trim_space(std::string_view(p, size * n));
  // Each response (redirects, 100 Continue) starts with a status line: only the last one counts.
  if (line.substr(0, 5) == "HTTP/") {
    size_t sp = line.find(' ');
    t->resp->status = sp == std::string_view::npos ? 0 : std::atol(std::string(line.substr(sp + 1, 3)).c_str());
    t->resp->headers.clear();
  } else if (size_t colon = line.find(':'); colon != std::string_view::npos) {
    t->resp->headers.emplace(ascii_lower(trim_space(line.substr(0, colon))), std::string(trim_space(line.substr(colon + 1))));
  }
  return size * n;
}

size_t on_write(char* p, size_t size, size_t n, void* ud) {
  auto* t = static_cast<Transfer*>(ud);
  size_t len = size * n;
  try {
    if (t->req->sink && t->resp->status >= 200 && t->resp->status < 300) {
      t->sink_used = true;
      t->req->sink(p, len);
    } else {
      if (t->resp->body.size() + len > t->req->max_body) {
        t->too_large = true;
        return 0;
      }
      t->resp->body.append(p, len);
    }
  } catch (...) {
    t->error = std::current_exception();
    return 0;  // makes curl stop with CURLE_WRITE_ERROR
  }
  return len;
}

size_t on_read(char* buf, size_t size, size_t n, void* ud) {
  auto* t = static_cast<Transfer*>(ud);
  size_t want = size * n;
  if (t->body_fd >= 0) {
    while (true) {
      ssize_t got = ::read(t->body_fd, buf, want);
      if (got >= 0) return static_cast<size_t>(got);
      if (errno == EINTR) continue;
      t->error = std::make_exception_ptr(
          Error(Errc::io, fmt::format("{}: read failed: {}", t->req->body_file->string(), std::strerror(errno))));
      return CURL_READFUNC_ABORT;
    }
  }
  size_t k = std::min(want, t->body_left.size());
  std::memcpy(buf, t->body_left.data(), k);
  t->body_left.remove_prefix(k);
  return k;
}

std::string curl_escape(CURL* curl, std::string_view s) {
  char* e = curl_easy_escape(curl, s.data(), static_cast<int>(s.size()));
  if (!e) fail(Errc::internal, "libcurl: out of memory");
  std::string out(e);
  curl_free(e);
  return out;
}

// One registry session: base URL, credentials and the current Authorization value, which the token
// flow replaces as the registry asks for wider scopes (a push needs pull,push).
class Client {
 public:
  Client(const Reference& ref, const TransferOptions& options)
      : ref_(ref),
        base_(registry_base_url(ref, options.insecure)),
        allow_http_(options.insecure || ref.is_loopback()),
        options_(options),
        creds_(find_credentials(ref.host)) {
    if (options_.timeout_s < 0) fail(Errc::usage, "--timeout {}: expected a number of seconds >= 0", options_.timeout_s);
    if (options_.retries < 0 || options_.retries > 20)
      fail(Errc::usage, "--retries {}: expected 0 to 20", options_.retries);
    init_curl_once();
    curl_ = curl_easy_init();
    if (!curl_) fail(Errc::internal, "libcurl: cannot create a handle");
    if (!creds_.token.empty()) authorization_ = "Bearer " + creds_.token;
  }
  ~Client() { curl_easy_cleanup(curl_); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  std::string repo_url(std::string_view suffix) const {
    return fmt::format("{}/v2/{}/{}", base_, ref_.repository, suffix);
  }

  // Upload locations may be absolute or relative to the registry.
  std::string resolve(std::string_view location) const {
    if (location.substr(0, 7) == "http://" || location.substr(0, 8) == "https://") return std::string(location);
    if (!location.empty() && location.front() == '/') return base_ + std::string(location);
    return base_ + "/" + std::string(location);
  }

  CURL* handle() const { return curl_; }

  // Performs `r` (with retries); on 401, answers the registry's challenge once and performs it again.
  Response send(const Request& r) {
    Response resp = send_with_retries(r);
    if (resp.status == 401 && !r.authorization && authenticate(resp)) resp = send_with_retries(r);
    return resp;
  }

  [[noreturn]] void fail_response(const Response& r, std::string_view what) const {
    std::string detail = describe_registry_errors(r.body);
    std::string hint;
    if (r.status == 401 || r.status == 403)
      hint = creds_.source.empty()
                 ? fmt::format(" (no credentials for {}: set DECODEPACK_REGISTRY_USER and DECODEPACK_REGISTRY_PASSWORD, "
                               "or DECODEPACK_REGISTRY_TOKEN, or add \"{}\" to the \"auths\" of a docker config.json)",
                               ref_.host, ref_.host)
                 : fmt::format(" (credentials from {} were not accepted)", creds_.source);
    fail(Errc::registry, "{}: {}: HTTP {}{}{}{}", ref_.str(), what, r.status, detail.empty() ? "" : ", " + detail, hint,
         r.attempts > 1 ? fmt::format(" (after {} attempts)", r.attempts) : "");
  }

 private:
  // The outcome of one attempt: a response, or a transport failure (`rc`).
  struct Attempt {
    Response resp;
    CURLcode rc = CURLE_OK;
    std::string error;  // curl's description of a transport failure
    bool sink_used = false;
  };

  static bool retryable_status(long status) { return status == 500 || status == 502 || status == 503 || status == 504; }
  // The connection broke (reset, closed without or in the middle of an answer); a refused connection
  // or a deadline is final.
  static bool retryable_transport(CURLcode rc) {
    return rc == CURLE_RECV_ERROR || rc == CURLE_SEND_ERROR || rc == CURLE_GOT_NOTHING || rc == CURLE_PARTIAL_FILE ||
           rc == CURLE_HTTP2 || rc == CURLE_HTTP2_STREAM;
  }

  // Deadline of one attempt, in milliseconds (0: none).
  long deadline_ms(const Request& r) const {
    if (options_.timeout_s == 0) return 0;
    uint64_t s = static_cast<uint64_t>(options_.timeout_s) + r.blob_bytes / kDeadlineBytesPerSecond;
    return static_cast<long>(std::min<uint64_t>(s, 100'000'000) * 1000);
  }

  Response send_with_retries(const Request& r) {
    for (int attempt = 1;; ++attempt) {
      Attempt a = perform(r);
      const bool transient = a.rc != CURLE_OK ? retryable_transport(a.rc) : retryable_status(a.resp.status);
      const bool can_repeat = !a.sink_used || static_cast<bool>(r.restart);
      if (!transient || !can_repeat || attempt > options_.retries) {
        if (a.rc != CURLE_OK) fail_transport(r, a, attempt);
        a.resp.attempts = attempt;
        return std::move(a.resp);
      }
      const long delay = std::min<long>(options_.retry_delay_ms << (attempt - 1), 8000);
      if (options_.log)
        options_.log(fmt::format("{} {}: {}; retrying in {:.1f} s (attempt {} of {})", r.method, r.url,
                                 a.rc != CURLE_OK ? a.error : fmt::format("HTTP {}", a.resp.status), delay / 1000.0,
                                 attempt + 1, options_.retries + 1));
      std::this_thread::sleep_for(std::chrono::milliseconds(delay));
      if (a.sink_used) r.restart();
    }
  }

  [[noreturn]] void fail_transport(const Request& r, const Attempt& a, int attempts) const {
    std::string why = a.error;
    if (a.rc == CURLE_OPERATION_TIMEDOUT && options_.timeout_s > 0)
      why = fmt::format("no complete answer within the deadline of {} s{} ({}); a slow registry needs a larger "
                        "--timeout", deadline_ms(r) / 1000,
                        r.blob_bytes >= kDeadlineBytesPerSecond ? " (--timeout plus 1 s per MiB of blob)" : "", why);
    fail(Errc::registry, "{}: {} {}: {}{}", ref_.str(), r.method, r.url, why,
         attempts > 1 ? fmt::format(" (after {} attempts)", attempts) : "");
  }

  Attempt perform(const Request& r) {
    curl_easy_reset(curl_);  // keeps the connection cache
    Attempt out;
    Transfer t;
    t.req = &r;
    t.resp = &out.resp;
    char errbuf[CURL_ERROR_SIZE] = {};

    std::string protocols = allow_http_ ? "http,https" : "https";
    curl_easy_setopt(curl_, CURLOPT_URL, r.url.c_str());
    curl_easy_setopt(curl_, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(curl_, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl_, CURLOPT_USERAGENT, "decodepack/" DP_VERSION_STRING);
    curl_easy_setopt(curl_, CURLOPT_PROTOCOLS_STR, protocols.c_str());
    curl_easy_setopt(curl_, CURLOPT_REDIR_PROTOCOLS_STR, protocols.c_str());
    curl_easy_setopt(curl_, CURLOPT_CONNECTTIMEOUT, options_.connect_timeout_s);
    // The whole request has a deadline (a registry dripping bytes is abandoned), and a transfer that
    // stalls is abandoned sooner.
    curl_easy_setopt(curl_, CURLOPT_TIMEOUT_MS, deadline_ms(r));
    curl_easy_setopt(curl_, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(curl_, CURLOPT_LOW_SPEED_TIME, 120L);
    // A proxy from the environment must not intercept a registry on this machine.
    if (ref_.is_loopback()) curl_easy_setopt(curl_, CURLOPT_PROXY, "");
    curl_easy_setopt(curl_, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(curl_, CURLOPT_HEADERDATA, &t);
    curl_easy_setopt(curl_, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(curl_, CURLOPT_WRITEDATA, &t);
    if (r.follow_redirects) {
      curl_easy_setopt(curl_, CURLOPT_FOLLOWLOCATION, 1L);
      curl_easy_setopt(curl_, CURLOPT_MAXREDIRS, 5L);
    }

    struct curl_slist* headers = nullptr;
    std::vector<std::string> lines = r.headers;
    // Credentials go only to the registry's own origin: an upload Location or a redirect elsewhere
    // must not receive them (curl itself drops them on cross-host redirects).
    std::string auth = r.authorization ? *r.authorization
                                       : (r.url.compare(0, base_.size() + 1, base_ + "/") == 0 ? authorization_ : "");
    if (!auth.empty()) lines.push_back("Authorization: " + auth);
    for (const std::string& l : lines) headers = curl_slist_append(headers, l.c_str());
    std::unique_ptr<curl_slist, decltype(&curl_slist_free_all)> headers_guard(headers, curl_slist_free_all);
    curl_easy_setopt(curl_, CURLOPT_HTTPHEADER, headers);

    const bool report = !r.progress.empty() && options_.progress;
    if (report) {
      t.progress = &options_.progress;
      t.started = std::chrono::steady_clock::now();
      t.last_report = t.started;
      curl_easy_setopt(curl_, CURLOPT_NOPROGRESS, 0L);
      curl_easy_setopt(curl_, CURLOPT_XFERINFOFUNCTION, on_progress);
      curl_easy_setopt(curl_, CURLOPT_XFERINFODATA, &t);
    }

    int fd = -1;
    if (r.method == "HEAD") {
      curl_easy_setopt(curl_, CURLOPT_NOBODY, 1L);
    } else if (r.method == "GET") {
      curl_easy_setopt(curl_, CURLOPT_HTTPGET, 1L);
    } else if (r.method == "POST") {
      curl_easy_setopt(curl_, CURLOPT_POST, 1L);
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDS, "");
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(0));
    } else if (r.method == "PUT") {
      curl_easy_setopt(curl_, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(curl_, CURLOPT_READFUNCTION, on_read);
      curl_easy_setopt(curl_, CURLOPT_READDATA, &t);
      if (r.body_file) {
        fd = ::open(r.body_file->c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) fail(Errc::io, "{}: cannot open: {}", r.body_file->string(), std::strerror(errno));
        t.body_fd = fd;
        curl_easy_setopt(curl_, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(r.body_size));
      } else {
        t.body_left = r.body;
        curl_easy_setopt(curl_, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(r.body.size()));
      }
    } else {
      fail(Errc::internal, "registry client: unsupported method {}", r.method);
    }

    out.rc = curl_easy_perform(curl_);
    if (fd >= 0) ::close(fd);
    if (t.error) std::rethrow_exception(t.error);
    if (t.too_large)
      fail(Errc::registry, "{}: {} {}: the reply is larger than {} bytes; refused", ref_.str(), r.method, r.url,
           r.max_body);
    if (t.headers_too_large)
      fail(Errc::registry, "{}: {} {}: the reply's headers are larger than {} bytes; refused", ref_.str(), r.method,
           r.url, kMaxHeaderBytes);
    out.sink_used = t.sink_used;
    if (out.rc != CURLE_OK)
      out.error = fmt::format("{}{}{}", curl_easy_strerror(out.rc), errbuf[0] ? ": " : "", errbuf);
    else
      curl_easy_getinfo(curl_, CURLINFO_RESPONSE_CODE, &out.resp.status);
    if (report && out.rc == CURLE_OK && out.resp.status >= 200 && out.resp.status < 300)
      options_.progress({r.progress, r.blob_bytes, r.blob_bytes,
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - t.started).count(), true});
    return out;
  }

  // Answers a 401 challenge; false when there is nothing new to try (the caller reports the 401).
  bool authenticate(const Response& r) {
    auto it = r.headers.find("www-authenticate");
    if (it == r.headers.end()) return false;
    std::optional<AuthChallenge> ch = parse_auth_challenge(it->second);
    if (!ch) return false;
    std::string next;
    if (ch->scheme == "basic") {
      if (!creds_.has_basic()) return false;
      next = "Basic " + base64_encode(creds_.username + ":" + creds_.password);
    } else if (ch->scheme == "bearer") {
      if (ch->params["realm"].empty()) return false;
      next = "Bearer " + fetch_token(*ch);
    } else {
      return false;
    }
    if (next == authorization_) return false;  // already sent and refused
    authorization_ = std::move(next);
    return true;
  }

  // The docker token flow: GET <realm>?service=..&scope=.. (with basic credentials when we have them),
  // answered by {"token": ...} or {"access_token": ...}.
  std::string fetch_token(const AuthChallenge& ch) {
    const std::string& realm = ch.params.at("realm");
    bool https = realm.compare(0, 8, "https://") == 0;
    if (!https && !(allow_http_ && realm.compare(0, 7, "http://") == 0))
      fail(Errc::registry, "{}: the registry's token service '{}' is not an https URL (plain HTTP is used only for "
                           "loopback registries or with --insecure)", ref_.str(), printable_ascii(realm));
    if (std::any_of(realm.begin(), realm.end(), [](char c) { return static_cast<unsigned char>(c) <= 0x20 || c == 0x7f; }))
      fail(Errc::registry, "{}: the registry's token service '{}' is not a URL (it contains spaces or control "
                           "characters)", ref_.str(), printable_ascii(realm));
    std::string url = realm;
    char sep = realm.find('?') == std::string::npos ? '?' : '&';
    for (const char* key : {"service", "scope"}) {
      auto p = ch.params.find(key);
      if (p == ch.params.end()) continue;
      url += fmt::format("{}{}={}", sep, key, curl_escape(curl_, p->second));
      sep = '&';
    }
    Request req;
    req.method = "GET";
    req.url = url;
    req.follow_redirects = true;
    req.authorization = creds_.has_basic() ? "Basic " + base64_encode(creds_.username + ":" + creds_.password) : "";
    Response resp = send_with_retries(req);
    if (resp.status != 200) fail_response(resp, fmt::format("token request to {} refused", realm));
    try {
      return parse_token_reply(resp.body, realm);
    } catch (const Error& e) {
      throw Error(e.code(), fmt::format("{}: {}", ref_.str(), e.what()));
    }
  }

  Reference ref_;
  std::string base_;
  bool allow_http_;
  TransferOptions options_;
  Credentials creds_;
  std::string authorization_;
  CURL* curl_ = nullptr;
};

std::string getenv_str(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// A pulled archive (at `file`) must be a bundle whose manifest.json is the config blob and whose files
// are exactly what that manifest lists, and have `expect_digest` when one is given; its messages name
// the layer, not the staging file.
void check_pulled_bundle(const fs::path& file, const Reference& ref, PullResult& result,
                         const std::string& expect_digest) {
  auto rename_file = [&](std::string msg) {
    const std::string name = file.string(), layer = "layer blob " + result.layer_digest;
    for (size_t at = msg.find(name); at != std::string::npos; at = msg.find(name, at + layer.size()))
      msg.replace(at, name.size(), layer);
    return msg;
  };
  std::optional<Bundle> b;
  try {
    b.emplace(Bundle::open(file));
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("{}: the layer is not a valid bundle archive: {}", ref.str(), rename_file(e.what())));
  }
  if (b->manifest_bytes() != result.config_json)
    fail(Errc::verify, "{}: the layer's manifest.json (bundle {}) is not the manifest's config blob {}", ref.str(),
         b->digest(), "sha256:" + sha256_hex(result.config_json));
  VerifyReport report = verify_bundle(*b, {"", expect_digest, 1});
  if (!report.ok()) {
    std::string problems;
    for (size_t i = 0; i < report.problems.size() && i < 3; ++i)
      problems += (i ? "; " : "") + rename_file(report.problems[i].message);
    if (report.problems.size() > 3) problems += fmt::format("; and {} more", report.problems.size() - 3);
    fail(Errc::verify, "{}: the pulled bundle does not verify: {}", ref.str(), problems);
  }
  result.bundle_digest = b->digest();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------

std::string Reference::str() const {
  std::string s = host + "/" + repository;
  if (!tag.empty()) s += ":" + tag;
  if (!digest.empty()) s += "@" + digest;
  return s;
}

bool Reference::is_loopback() const {
  std::string name = ascii_lower(split_host(host).first);
  if (name == "localhost" || name == "::1" || name == "0:0:0:0:0:0:0:1") return true;
  // 127.0.0.0/8: four numeric octets, the first 127.
  if (name.rfind("127.", 0) != 0) return false;
  int dots = 0;
  for (char c : name) {
    if (c == '.') ++dots;
    else if (!is_digit(c)) return false;
  }
  return dots == 3;
}

Reference parse_reference(std::string_view text) {
  if (text.empty()) bad_ref(text, "empty");
  if (text.find("://") != std::string_view::npos)
    bad_ref(text, "has a URL scheme (plain HTTP is chosen for loopback hosts, or with --insecure)");
  if (std::any_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) <= 0x20 || c == 0x7f; }))
    bad_ref(text, "contains whitespace or control characters");
  size_t slash = text.find('/');
  if (slash == std::string_view::npos) bad_ref(text, "has no registry host");
  Reference ref;
  std::string_view host = text.substr(0, slash);
  bool hostlike = host.find('.') != std::string_view::npos || host.find(':') != std::string_view::npos ||
                  host == "localhost" || (!host.empty() && host.front() == '[');
  if (!hostlike)
    bad_ref(text, fmt::format("does not start with a registry host ('{}' has no '.' or ':' and is not localhost; "
                              "there is no default registry)", host));
  if (std::string why = host_problem(host); !why.empty()) bad_ref(text, why);
  ref.host = std::string(host);

  std::string_view rest = text.substr(slash + 1);
  if (size_t at = rest.find('@'); at != std::string_view::npos) {
    std::string_view d = rest.substr(at + 1);
    if (d.substr(0, 7) != "sha256:") bad_ref(text, fmt::format("digest '{}' is not sha256 (the only algorithm supported)", d));
    if (!is_sha256_digest(d)) bad_ref(text, fmt::format("digest '{}' is not sha256: followed by 64 lowercase hex digits", d));
    ref.digest = std::string(d);
    rest = rest.substr(0, at);
  }
  size_t last_slash = rest.rfind('/');
  size_t colon = rest.find(':', last_slash == std::string_view::npos ? 0 : last_slash + 1);
  if (colon != std::string_view::npos) {
    std::string_view tag = rest.substr(colon + 1);
    if (tag.empty()) bad_ref(text, "empty tag after ':'");
    if (!valid_tag(tag))
      bad_ref(text, fmt::format("tag '{}' is invalid (1-128 letters, digits, '_', '.' or '-', not starting with '.' "
                                "or '-')", tag));
    ref.tag = std::string(tag);
    rest = rest.substr(0, colon);
  }
  if (rest.empty()) bad_ref(text, "has no repository");
  if (rest.size() > 255) bad_ref(text, fmt::format("repository is {} characters, at most 255 allowed", rest.size()));
  for (size_t start = 0;;) {
    size_t end = rest.find('/', start);
    std::string_view c = rest.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
    if (!valid_repo_component(c))
      bad_ref(text, fmt::format("repository component '{}' is invalid (lower-case letters and digits, joined by single "
                                "'.', '_', '__' or '-' runs)", c));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  ref.repository = std::string(rest);
  if (ref.tag.empty() && ref.digest.empty()) bad_ref(text, "has no tag or digest");
  return ref;
}

std::string registry_base_url(const Reference& ref, bool insecure) {
  return (insecure || ref.is_loopback() ? "http://" : "https://") + ref.host;
}

std::string created_from_epoch(std::string_view seconds, std::string_view what) {
  if (seconds.empty() || seconds.size() > 12 || !std::all_of(seconds.begin(), seconds.end(), is_digit))
    fail(Errc::usage, "{} '{}' is not a number of seconds since 1970-01-01 (a non-negative integer)", what,
         printable_ascii(seconds));
  const time_t t = static_cast<time_t>(std::stoll(std::string(seconds)));
  struct tm tm {};
  if (!gmtime_r(&t, &tm)) fail(Errc::usage, "{} '{}' is out of range", what, seconds);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour,
                     tm.tm_min, tm.tm_sec);
}

bool is_rfc3339(std::string_view s) {
  // date-time = YYYY-MM-DD ("T" | "t" | " ") HH:MM:SS [.frac] ("Z" | "z" | ("+" | "-") HH:MM)
  auto digits = [&](size_t at, size_t n) {
    return at + n <= s.size() && std::all_of(s.begin() + at, s.begin() + at + n, is_digit);
  };
  if (!(digits(0, 4) && s.size() > 19 && s[4] == '-' && digits(5, 2) && s[7] == '-' && digits(8, 2) &&
        (s[10] == 'T' || s[10] == 't' || s[10] == ' ') && digits(11, 2) && s[13] == ':' && digits(14, 2) &&
        s[16] == ':' && digits(17, 2)))
    return false;
  size_t i = 19;
  if (s[i] == '.') {
    size_t start = ++i;
    while (i < s.size() && is_digit(s[i])) ++i;
    if (i == start) return false;
  }
  std::string_view zone = s.substr(i);
  if (zone == "Z" || zone == "z") return true;
  return zone.size() == 6 && (zone[0] == '+' || zone[0] == '-') && digits(i + 1, 2) && zone[3] == ':' && digits(i + 4, 2);
}

Credentials find_credentials(std::string_view host) {
  Credentials c;
  c.token = getenv_str("DECODEPACK_REGISTRY_TOKEN");
  if (!c.token.empty()) c.source = "DECODEPACK_REGISTRY_TOKEN";
  std::string user = getenv_str("DECODEPACK_REGISTRY_USER");
  std::string pass = getenv_str("DECODEPACK_REGISTRY_PASSWORD");
  if (user.empty() != pass.empty())
    fail(Errc::usage, "{} is set but {} is not: set both for basic authentication",
         user.empty() ? "DECODEPACK_REGISTRY_PASSWORD" : "DECODEPACK_REGISTRY_USER",
         user.empty() ? "DECODEPACK_REGISTRY_USER" : "DECODEPACK_REGISTRY_PASSWORD");
  if (!user.empty()) {
    c.username = user;
    c.password = pass;
    c.source = "DECODEPACK_REGISTRY_USER/DECODEPACK_REGISTRY_PASSWORD";
    return c;
  }

  fs::path config;
  if (std::string d = getenv_str("DOCKER_CONFIG"); !d.empty()) config = fs::path(d) / "config.json";
  else if (std::string home = getenv_str("HOME"); !home.empty()) config = fs::path(home) / ".docker" / "config.json";
  std::error_code ec;
  if (config.empty() || !fs::exists(config, ec)) return c;
  Json j = load_json_file(config);
  if (!j.is_object() || !j.contains("auths")) return c;
  if (!j["auths"].is_object()) fail(Errc::input, "{}: field auths is not an object", config.string());
  std::string want = ascii_lower(host);
  for (const auto& [key, entry] : j["auths"].items()) {
    // Keys are "host[:port]", sometimes written as a URL ("https://host/v1/").
    std::string_view k = key;
    if (size_t scheme = k.find("://"); scheme != std::string_view::npos) k = k.substr(scheme + 3);
    k = k.substr(0, k.find('/'));
    if (ascii_lower(k) != want || !entry.is_object()) continue;
    if (entry.contains("auth") && entry["auth"].is_string() && !entry["auth"].get<std::string>().empty()) {
      std::optional<std::string> decoded = base64_decode(entry["auth"].get<std::string>());
      size_t colon = decoded ? decoded->find(':') : std::string::npos;
      if (colon == std::string::npos || colon == 0)
        fail(Errc::input, "{}: auths.\"{}\".auth is not the base64 of user:password", config.string(), key);
      c.username = decoded->substr(0, colon);
      c.password = decoded->substr(colon + 1);
    } else if (entry.contains("username") && entry["username"].is_string()) {
      c.username = entry["username"].get<std::string>();
      c.password = entry.value("password", std::string());
    } else {
      continue;  // e.g. only an identitytoken: not supported, so no credentials from this entry
    }
    c.source = config.string();
    return c;
  }
  return c;
}

PushResult push(const fs::path& dpk_file, std::string_view manifest_json,
                const std::map<std::string, std::string>& annotations, const Reference& ref,
                const PushOptions& options) {
  if (ref.tag.empty() || !ref.digest.empty())
    fail(Errc::usage, "{}: push needs a reference with a tag and no digest (host[:port]/repository:tag)", ref.str());
  parse_json(manifest_json, "bundle manifest (config blob)");  // a registry should never hold a broken one

  std::error_code ec;
  uint64_t dpk_size = fs::file_size(dpk_file, ec);
  if (ec) fail(Errc::io, "{}: cannot stat: {}", dpk_file.string(), ec.message());
  // Hashing streams the file; so does the upload below.
  const Descriptor layer{"sha256:" + sha256_file(dpk_file), dpk_size};
  const Descriptor config{"sha256:" + sha256_hex(manifest_json), manifest_json.size()};

  Client client(ref, options);
  PushResult result;

  auto ensure_blob = [&](const Descriptor& blob, const Request& body) {
    Request head;
    head.method = "HEAD";
    head.url = client.repo_url("blobs/" + blob.digest);
    head.follow_redirects = true;
    Response h = client.send(head);
    if (h.status == 200) {
      ++result.skipped_blobs;
      return;
    }
    if (h.status != 404) client.fail_response(h, fmt::format("cannot check for blob {}", blob.digest));

    // Monolithic upload: POST opens an upload session, one PUT with ?digest= completes it.
    Request post;
    post.method = "POST";
    post.url = client.repo_url("blobs/uploads/");
    Response p = client.send(post);
    if (p.status != 202) client.fail_response(p, fmt::format("cannot start the upload of blob {}", blob.digest));
    auto loc = p.headers.find("location");
    if (loc == p.headers.end())
      fail(Errc::registry, "{}: the registry started an upload but sent no Location header", ref.str());
    Request put = body;
    put.method = "PUT";
    put.url = client.resolve(loc->second);
    put.url += fmt::format("{}digest={}", put.url.find('?') == std::string::npos ? '?' : '&',
                           curl_escape(client.handle(), blob.digest));
    put.headers.push_back("Content-Type: application/octet-stream");
    Response u = client.send(put);
    if (u.status != 201)
      client.fail_response(u, fmt::format("cannot upload blob {} ({} bytes)", blob.digest, blob.size));
    ++result.uploaded_blobs;
  };

  Request config_body;
  config_body.body = manifest_json;
  ensure_blob(config, config_body);
  Request layer_body;
  layer_body.body_file = &dpk_file;
  layer_body.body_size = dpk_size;
  layer_body.blob_bytes = dpk_size;
  layer_body.progress = "upload layer " + layer.digest;
  ensure_blob(layer, layer_body);

  std::string title = options.title.empty() ? dpk_file.filename().string() : options.title;
  if (!options.created.empty() && !is_rfc3339(options.created))
    fail(Errc::usage, "created '{}' is not an RFC 3339 date-time (e.g. 2026-12-01T10:00:00Z)",
         printable_ascii(options.created));
  // The caller's annotations win over the standard ones they name.
  std::map<std::string, std::string> all = {{std::string(kTitleAnnotation), title}};
  if (!options.created.empty()) all["org.opencontainers.image.created"] = options.created;
  if (!options.version.empty()) all["org.opencontainers.image.version"] = options.version;
  if (!options.source.empty()) all["org.opencontainers.image.source"] = options.source;
  for (const auto& [k, v] : annotations) all[k] = v;
  Json manifest = {
      {"schemaVersion", 2},
      {"mediaType", kOciManifestMediaType},
      {"artifactType", kBundleArtifactType},
      {"config", {{"mediaType", kBundleConfigMediaType}, {"digest", config.digest}, {"size", config.size}}},
      {"layers", Json::array({{{"mediaType", kBundleLayerMediaType},
                               {"digest", layer.digest},
                               {"size", layer.size},
                               {"annotations", {{std::string(kTitleAnnotation), title}}}}})},
  };
  manifest["annotations"] = all;
  const std::string bytes = canonical_json(manifest);
  const std::string digest = "sha256:" + sha256_hex(bytes);

  Request put;
  put.method = "PUT";
  put.url = client.repo_url("manifests/" + ref.tag);
  put.headers.push_back(fmt::format("Content-Type: {}", kOciManifestMediaType));
  put.body = bytes;
  Response m = client.send(put);
  if (m.status != 201) client.fail_response(m, fmt::format("cannot put the manifest under tag {}", ref.tag));
  if (auto d = m.headers.find("docker-content-digest"); d != m.headers.end() && d->second != digest)
    fail(Errc::registry, "{}: the registry stored the manifest as {}, but the bytes sent hash to {}", ref.str(),
         d->second, digest);
  result.manifest_digest = digest;
  return result;
}

PullResult pull(const Reference& ref, const fs::path& out_dpk, const PullOptions& options) {
  // Before anything is fetched: what is at the output may be replaced only if it is a bundle.
  plan_output(out_dpk, OutputKind::file, options.force, "a bundle archive", bundle_own_files);
  remove_stale_staging(out_dpk);
  Client client(ref, options);
  const std::string target = ref.digest.empty() ? ref.tag : ref.digest;

  // 1. The manifest, checked against the pinned digest and the registry's own claim.
  Request get;
  get.method = "GET";
  get.url = client.repo_url("manifests/" + target);
  get.headers.push_back(fmt::format("Accept: {}", kOciManifestMediaType));
  get.follow_redirects = true;
  get.max_body = kMaxManifestBytes;
  Response m = client.send(get);
  if (m.status != 200) client.fail_response(m, fmt::format("cannot get manifest {}", target));
  PullResult result;
  result.manifest_digest = "sha256:" + sha256_hex(m.body);
  if (!ref.digest.empty() && result.manifest_digest != ref.digest)
    fail(Errc::verify, "{}: manifest digest mismatch: expected {}, got {}", ref.str(), ref.digest,
         result.manifest_digest);
  if (auto d = m.headers.find("docker-content-digest"); d != m.headers.end() && d->second != result.manifest_digest)
    fail(Errc::verify, "{}: manifest digest mismatch: the registry says {}, its bytes hash to {}", ref.str(),
         printable_ascii(d->second), result.manifest_digest);

  // 2. Is it a decodepack bundle?
  auto ct = m.headers.find("content-type");
  BundleArtifact art;
  try {
    art = parse_bundle_manifest(m.body, ct == m.headers.end() ? "" : ct->second, get.url);
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("{}: {}", ref.str(), e.what()));
  }
  result.annotations = art.annotations;
  result.layer_digest = art.layer.digest;
  result.size = art.layer.size;

  // 3. The config blob (the bundle manifest): small, read into memory and verified.
  Request cg;
  cg.method = "GET";
  cg.url = client.repo_url("blobs/" + art.config.digest);
  cg.follow_redirects = true;
  // Bounded by what the manifest promises (its size is checked below), but never so tightly that an
  // error document cannot be read.
  cg.max_body = std::max<size_t>(static_cast<size_t>(art.config.size), size_t{64} << 10);
  Response c = client.send(cg);
  if (c.status != 200) client.fail_response(c, fmt::format("cannot get config blob {}", art.config.digest));
  std::string config_actual = "sha256:" + sha256_hex(c.body);
  if (c.body.size() != art.config.size || config_actual != art.config.digest)
    fail(Errc::verify, "{}: config blob digest mismatch: expected {} ({} bytes), got {} ({} bytes)", ref.str(),
         art.config.digest, art.config.size, config_actual, c.body.size());
  result.config_json = std::move(c.body);

  // 4. The layer, streamed to a staging file beside the output while hashing, then checked as a bundle:
  // only a complete, verified bundle whose manifest is the config blob replaces the output.
  const fs::path tmp = staging_path(out_dpk, "tmp");
  int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0)
    fail(Errc::io, "{}: cannot create a staging file in {}: {}", out_dpk.string(), tmp.parent_path().string(),
         std::strerror(errno));
  try {
    std::optional<Sha256> hash;
    hash.emplace();
    uint64_t got = 0;
    Request lg;
    lg.method = "GET";
    lg.url = client.repo_url("blobs/" + art.layer.digest);
    lg.follow_redirects = true;
    lg.blob_bytes = art.layer.size;
    lg.progress = "download layer " + art.layer.digest;
    lg.sink = [&](const char* p, size_t n) {
      got += n;
      if (got > art.layer.size)
        fail(Errc::verify, "{}: layer blob {}: the registry sent more than the {} bytes the manifest gives",
             ref.str(), art.layer.digest, art.layer.size);
      hash->update(p, n);
      for (size_t done = 0; done < n;) {
        ssize_t w = ::write(fd, p + done, n - done);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0)
          fail(Errc::io, "{}: write failed after {} bytes of the layer: {}", out_dpk.string(), got - n + done,
               std::strerror(errno));
        done += static_cast<size_t>(w);
      }
    };
    lg.restart = [&] {  // a retry after a broken transfer starts the file over
      if (::ftruncate(fd, 0) != 0 || ::lseek(fd, 0, SEEK_SET) != 0)
        fail(Errc::io, "{}: cannot truncate the staging file {}: {}", out_dpk.string(), tmp.string(),
             std::strerror(errno));
      hash.emplace();
      got = 0;
    };
    Response l = client.send(lg);
    if (l.status != 200) client.fail_response(l, fmt::format("cannot get layer blob {}", art.layer.digest));
    std::string actual = "sha256:" + hash->hex();
    if (got != art.layer.size || actual != art.layer.digest)
      fail(Errc::verify, "{}: layer blob digest mismatch: expected {} ({} bytes), got {} ({} bytes)", ref.str(),
           art.layer.digest, art.layer.size, actual, got);
    if (::fsync(fd) != 0) fail(Errc::io, "{}: cannot flush to disk: {}", out_dpk.string(), std::strerror(errno));
    int rc = ::close(fd);
    fd = -1;
    if (rc != 0) fail(Errc::io, "{}: cannot close: {}", out_dpk.string(), std::strerror(errno));

    check_pulled_bundle(tmp, ref, result, options.expect_digest);
    // The output may have changed during the download: checked again just before the rename.
    plan_output(out_dpk, OutputKind::file, options.force, "a bundle archive", bundle_own_files);
    if (::rename(tmp.c_str(), out_dpk.c_str()) != 0)
      fail(Errc::io, "{}: cannot rename into place: {}", out_dpk.string(), std::strerror(errno));
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  return result;
}

}  // namespace dp::bundle
