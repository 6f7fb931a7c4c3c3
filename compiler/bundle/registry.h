// Pushing a bundle to, and pulling it from, an OCI registry (the OCI distribution API, over libcurl).
//
// A bundle is stored as an OCI image manifest (artifact type application/vnd.decodepack.bundle.v1) with
//   config  = the bundle's manifest.json bytes  (application/vnd.decodepack.bundle.config.v1+json)
//   layers  = [the .dpk archive]                 (application/vnd.decodepack.bundle.layer.v1.tar),
//             annotated with org.opencontainers.image.title = the archive's file name
// and the caller's annotations (model, targets, TP, widths) plus the standard org.opencontainers.image.*
// ones of PushOptions on the manifest. Any OCI registry stores it; tools such as oras can list and fetch
// it, and a manifest `oras push --config manifest.json:<config type>` writes without an artifactType is
// pulled too (the config's media type stands for the artifact type, as OCI image-spec 1.1 says).
// Layer transfers report their progress through TransferOptions::progress.
//
// Transport: plain HTTP only to loopback hosts (localhost, 127.0.0.0/8, ::1) unless `insecure` is set;
// HTTPS with certificate verification otherwise. Credentials, first match wins:
//   DECODEPACK_REGISTRY_TOKEN                                   bearer token, sent with every request
//   DECODEPACK_REGISTRY_USER + DECODEPACK_REGISTRY_PASSWORD     basic credentials
//   $DOCKER_CONFIG/config.json, else ~/.docker/config.json      "auths": {"<host>": {"auth": base64(user:pass)}}
// Basic credentials are sent only after the registry asks (401 + WWW-Authenticate: Basic), or are used
// to obtain a token from the realm a Bearer challenge names (the docker token flow).
//
// Every request has a deadline and transient failures are retried a bounded number of times
// (TransferOptions). Replies are parsed by bundle/oci.h and never trusted: sizes are bounded before
// anything is buffered.
//
// Errors (dp::Error): Errc::usage for a malformed reference or an output that is not a bundle,
// Errc::registry for transport failures, deadlines, refusals (the message has the HTTP status and the
// registry's error codes) and malformed replies (naming the URL and the field), Errc::verify for content
// whose digest or size differs from what the manifest promises, Errc::input for an artifact that is not
// a decodepack bundle, Errc::io for local files.
//
// Example:
//   auto ref = dp::bundle::parse_reference("127.0.0.1:5000/kimi/linear-48b:tp1-w8");
//   auto r = dp::bundle::push("tiny.dpk", manifest_json, {{"org.decodepack.model", "kimi_linear"}}, ref, {});
//   dp::bundle::pull(ref, "copy.dpk", {});    // byte-identical to tiny.dpk, digest verified
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "bundle/oci.h"

namespace dp::bundle {

// `host[:port]/repository[:tag][@sha256:<64 hex>]`. The host is mandatory (there is no default registry):
// the first path component is a host when it contains '.' or ':' or is "localhost", as for docker.
struct Reference {
  std::string host;        // "registry.example.com", "127.0.0.1:5000", "[::1]:5000"
  std::string repository;  // "kimi/linear-48b": lower-case components separated by '/'
  std::string tag;         // empty when only a digest was given
  std::string digest;      // "sha256:<64 lowercase hex>" or empty; when set, it is what is fetched

  std::string str() const;        // the reference as text, normalised
  bool is_loopback() const;       // localhost, 127.0.0.0/8 or ::1
};

// Throws dp::Error(usage) naming the reference and what is wrong with it.
Reference parse_reference(std::string_view text);

// "http://host" for loopback hosts or when insecure, else "https://host".
std::string registry_base_url(const Reference& ref, bool insecure);

// How far one blob transfer has got, for progress displays.
struct TransferProgress {
  std::string what;          // "upload layer sha256:..." or "download layer sha256:..."
  uint64_t bytes = 0;        // moved so far
  uint64_t total = 0;        // of the blob
  double seconds = 0;        // since this attempt started
  bool finished = false;
};

// Transport settings shared by push and pull.
struct TransferOptions {
  bool insecure = false;       // allow plain HTTP to a non-loopback host
  long connect_timeout_s = 30;
  // Deadline of each request, in seconds, plus one second per MiB of blob it carries (so a large bundle
  // over a slow link is not cut, but a registry that drips a manifest is abandoned); 0: none. A
  // transfer that moves no byte for 120 s is abandoned sooner.
  long timeout_s = 300;
  // A request answered with HTTP 500, 502, 503 or 504, or whose connection broke (reset, closed before
  // the answer was complete), is sent again up to `retries` times, after retry_delay_ms, then twice
  // that, and so on (at most 8 s). Other answers (4xx), refused connections and deadlines are final.
  int retries = 3;
  long retry_delay_ms = 500;
  std::function<void(const std::string&)> log;  // a line per retry (stderr in the CLI)
  // Called while a layer blob moves (upload or download): about 4 times a second, and once more with
  // `finished` set when the registry has accepted or sent it all. A retry starts its count over.
  std::function<void(const TransferProgress&)> progress;
};

// The standard annotations a push writes on the OCI manifest besides the caller's (OCI image-spec,
// annotations.md): org.opencontainers.image.title always (the layer carries it too), and created,
// version and source when set. A bundle records no clock time (the same inputs give the same bytes), so
// nothing here is taken from the clock: the same bundle and options give the same manifest digest.
struct PushOptions : TransferOptions {
  std::string title;    // empty: the .dpk's file name
  std::string created;  // RFC 3339 date-time, e.g. from SOURCE_DATE_EPOCH (see created_from_epoch())
  std::string version;  // the bundle's release name, e.g. "2026.12-tp1"
  std::string source;   // URL of what it was built from (a model or CI repository)
};

// "1733011200" (seconds since the epoch, as SOURCE_DATE_EPOCH holds them) -> "2024-12-01T00:00:00Z".
// Errc::usage naming `what` when the text is not a non-negative integer of at most 12 digits.
std::string created_from_epoch(std::string_view seconds, std::string_view what);

// Whether `text` is an RFC 3339 date-time ("2026-12-01T10:00:00Z", "...T10:00:00.5+01:00").
bool is_rfc3339(std::string_view text);

struct PushResult {
  std::string manifest_digest;  // "sha256:..." of the OCI manifest: pull by ref@digest to pin it
  int uploaded_blobs = 0;
  int skipped_blobs = 0;        // already present in the repository
};

// Uploads the config blob (`manifest_json`, verbatim) and the archive, each only if the repository
// lacks it, then puts the OCI manifest under ref.tag. The archive is streamed from disk, never held in
// memory. `ref` must have a tag and no digest. The OCI manifest is serialised canonically (sorted keys),
// so the same bundle, annotations and title always give the same manifest digest.
PushResult push(const std::filesystem::path& dpk_file, std::string_view manifest_json,
                const std::map<std::string, std::string>& annotations, const Reference& ref,
                const PushOptions& options = {});

struct PullOptions : TransferOptions {
  // Replace an output file that is not a bundle archive (without it, such a file is refused with
  // Errc::usage; a directory is always refused).
  bool force = false;
  std::string expect_digest;  // "sha256:..." the pulled bundle must have (its manifest.json), or empty
};

struct PullResult {
  std::string manifest_digest;
  std::string layer_digest;
  std::string bundle_digest;                       // sha256 of the bundle's manifest.json
  uint64_t size = 0;                               // of the .dpk
  std::string config_json;                         // the bundle manifest from the config blob (verified)
  std::map<std::string, std::string> annotations;  // of the OCI manifest
};

// Fetches the manifest (by digest when ref has one, and then checks it), checks that it is a decodepack
// bundle, and streams the layer into a staging file beside `out_dpk` while hashing it. Only a layer whose
// size and sha256 match the manifest, that opens as a bundle whose manifest.json is the config blob,
// whose files all verify (verify_bundle(), with expect_digest when given) is renamed to `out_dpk`; on
// any failure the previous `out_dpk` is left as it was and the staging file is removed. Staging files
// of killed pulls of the same output are removed first (common/output.h).
PullResult pull(const Reference& ref, const std::filesystem::path& out_dpk, const PullOptions& options = {});

// --- Pieces of the client, exposed for unit tests -------------------------------------------------

struct Credentials {
  std::string username, password;  // basic
  std::string token;               // bearer, sent unasked
  std::string source;              // where they came from, for messages ("DECODEPACK_REGISTRY_USER", a path)
  bool has_basic() const { return !username.empty(); }
};

// Looks up credentials for `host` (host[:port]) in the environment, then in the docker config file.
// An unreadable or malformed config file is an error (Errc::input) naming it; no match is not.
Credentials find_credentials(std::string_view host);

}  // namespace dp::bundle
