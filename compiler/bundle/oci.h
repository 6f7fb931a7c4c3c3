// What an OCI registry sends back, parsed without any network (the registry client, registry.h, feeds
// these the bytes it receives; the registry fuzzer feeds them anything).
//
// Every function takes untrusted input and either returns or throws dp::Error: Errc::registry for a
// reply that is malformed (not JSON, a field of the wrong type, a digest that is not one), naming the
// URL it came from and the field; Errc::input for a well-formed reply describing something that is not
// a decodepack bundle. No other exception escapes.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace dp::bundle {

inline constexpr std::string_view kOciManifestMediaType = "application/vnd.oci.image.manifest.v1+json";
inline constexpr std::string_view kBundleArtifactType = "application/vnd.decodepack.bundle.v1";
inline constexpr std::string_view kBundleConfigMediaType = "application/vnd.decodepack.bundle.config.v1+json";
inline constexpr std::string_view kBundleLayerMediaType = "application/vnd.decodepack.bundle.layer.v1.tar";
inline constexpr std::string_view kTitleAnnotation = "org.opencontainers.image.title";

// Largest reply bodies read into memory: an image manifest (the OCI distribution spec has registries
// accept manifests up to 4 MiB), and other small documents (config blob, token, error document).
inline constexpr size_t kMaxManifestBytes = size_t{4} << 20;
inline constexpr size_t kMaxSmallBody = size_t{16} << 20;

// A content descriptor: "sha256:<64 lowercase hex>" and a size in bytes.
struct Descriptor {
  std::string digest;
  uint64_t size = 0;
};

// The parts of an OCI image manifest that make a decodepack bundle (registry.h describes the layout).
struct BundleArtifact {
  Descriptor config;                               // the bundle's manifest.json
  Descriptor layer;                                // the .dpk archive
  std::map<std::string, std::string> annotations;  // of the manifest
};

// Parses an image manifest fetched from `url`. `content_type` (the reply's Content-Type header, may
// be empty) stands in for a missing mediaType field. Malformed: Errc::registry naming the field; an
// OCI manifest of another kind of artifact: Errc::input.
BundleArtifact parse_bundle_manifest(std::string_view body, std::string_view content_type, std::string_view url);

// "CODE: message; CODE: message" from an OCI error document, or the start of a body that is not one,
// for error messages. Never throws; the result is at most a few hundred printable characters.
std::string describe_registry_errors(std::string_view body);

// The token of a token service's reply, {"token": "..."} or {"access_token": "..."}, from `url`.
std::string parse_token_reply(std::string_view body, std::string_view url);

// One challenge of a WWW-Authenticate header: `Bearer realm="...",service="...",scope="..."`. Only the
// first challenge of a header is read; nullopt when it is not well formed.
struct AuthChallenge {
  std::string scheme;                         // lower-case: "basic", "bearer"
  std::map<std::string, std::string> params;  // lower-case names, unquoted values
};
std::optional<AuthChallenge> parse_auth_challenge(std::string_view header);

// "sha256:" followed by 64 lowercase hex digits.
bool is_sha256_digest(std::string_view d);

}  // namespace dp::bundle
