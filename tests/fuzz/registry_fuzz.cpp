// libFuzzer target: what a registry sends back, as arbitrary bytes, through the parsers of bundle/oci.h:
// an image manifest, an error document, a token reply, a WWW-Authenticate header (the first byte of
// the input picks one, so that every execution exercises one parser).
//
// Contract: each parser returns or throws dp::Error of category registry or input (any other exception
// is a crash); what they return is well formed: descriptors carry sha256 digests and bounded config
// sizes, a token is non-empty without control characters, a challenge's scheme is lower-case and
// non-empty, and the description of an error document stays short.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "bundle/oci.h"
#include "common/error.h"

namespace {

void expect_registry_or_input(const dp::Error& e) {
  if (e.code() != dp::Errc::registry && e.code() != dp::Errc::input) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  // The first byte picks the parser ('0' manifest, '1' error document, '2' token reply, '3' challenge,
  // modulo 4); the rest is the reply.
  const std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  constexpr std::string_view url = "http://127.0.0.1:5000/v2/fuzz/manifests/v1";
  switch (data[0] % 4) {
    case 0:
      try {
        // The first line doubles as the Content-Type header, which stands in for a missing mediaType.
        const dp::bundle::BundleArtifact a = dp::bundle::parse_bundle_manifest(in, in.substr(0, in.find('\n')), url);
        if (!dp::bundle::is_sha256_digest(a.config.digest) || !dp::bundle::is_sha256_digest(a.layer.digest) ||
            a.config.size > dp::bundle::kMaxSmallBody)
          std::abort();
      } catch (const dp::Error& e) {
        expect_registry_or_input(e);
      }
      break;
    case 1:
      if (dp::bundle::describe_registry_errors(in).size() > 2400) std::abort();
      break;
    case 2:
      try {
        const std::string token = dp::bundle::parse_token_reply(in, url);
        if (token.empty()) std::abort();
        for (char c : token)
          if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) std::abort();
      } catch (const dp::Error& e) {
        if (e.code() != dp::Errc::registry) std::abort();
      }
      break;
    default:
      if (auto ch = dp::bundle::parse_auth_challenge(in)) {
        if (ch->scheme.empty() || ch->scheme.find_first_of(",=\"") != std::string::npos) std::abort();
        for (char c : ch->scheme)
          if (c >= 'A' && c <= 'Z') std::abort();
        for (const auto& [k, v] : ch->params)
          for (char c : k)
            if (c >= 'A' && c <= 'Z') std::abort();
      }
  }
  return 0;
}
