#include "bundle/oci.h"

#include <algorithm>

#include "common/error.h"
#include "common/json.h"
#include "common/text.h"

namespace dp::bundle {
namespace {

// A JSON value for a message: strings quoted as they are, anything else as (cut) JSON text.
std::string show(const Json& j) {
  if (j.is_string()) return printable_ascii(j.get_ref<const std::string&>());
  return printable_ascii(j.dump(-1, ' ', false, Json::error_handler_t::replace));
}

Json parse_reply(std::string_view body, std::string_view what, std::string_view url) {
  try {
    return parse_json(body, what);
  } catch (const Error& e) {
    fail(Errc::registry, "{}: the registry's reply is not valid JSON ({})", url, printable_ascii(e.what()));
  }
}

// Field `key` of object `obj` (at `path` in the reply from `url`) when present: it must be a string.
std::optional<std::string> string_field(const Json& obj, std::string_view key, std::string_view path,
                                        std::string_view url) {
  auto it = obj.find(key);
  if (it == obj.end()) return std::nullopt;
  if (!it->is_string())
    fail(Errc::registry, "{}: field {}{} is {} ({}), expected a string", url, path, key, json_type_name(*it), show(*it));
  return it->get<std::string>();
}

Descriptor read_descriptor(const Json& d, std::string_view field, std::string_view media_type, std::string_view url) {
  if (!d.is_object()) fail(Errc::registry, "{}: field {} is {}, expected an object (a descriptor)", url, field, json_type_name(d));
  const std::string path = std::string(field) + ".";
  std::string mt = string_field(d, "mediaType", path, url).value_or("");
  if (mt != media_type)
    fail(Errc::input, "{}: not a decodepack bundle: {}.mediaType is '{}', expected '{}'", url, field, printable_ascii(mt),
         media_type);
  Descriptor out;
  std::optional<std::string> digest = string_field(d, "digest", path, url);
  if (!digest) fail(Errc::registry, "{}: field {}.digest is missing", url, field);
  if (!is_sha256_digest(*digest))
    fail(Errc::registry, "{}: field {}.digest '{}' is not sha256:<64 lowercase hex digits>", url, field, printable_ascii(*digest));
  out.digest = std::move(*digest);
  auto size = d.find("size");
  if (size == d.end()) fail(Errc::registry, "{}: field {}.size is missing", url, field);
  if (!size->is_number_unsigned())  // JSON's non-negative integers parse as unsigned
    fail(Errc::registry, "{}: field {}.size is {} ({}), expected a non-negative integer", url, field,
         json_type_name(*size), show(*size));
  out.size = size->get<uint64_t>();
  return out;
}

}  // namespace

bool is_sha256_digest(std::string_view d) {
  return d.size() == 7 + 64 && d.substr(0, 7) == "sha256:" &&
         std::all_of(d.begin() + 7, d.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

BundleArtifact parse_bundle_manifest(std::string_view body, std::string_view content_type, std::string_view url) {
  const Json j = parse_reply(body, "manifest", url);
  if (!j.is_object()) fail(Errc::registry, "{}: the manifest is {}, expected a JSON object", url, json_type_name(j));

  std::string media = string_field(j, "mediaType", "", url).value_or("");
  if (media.empty()) media = std::string(trim_space(content_type.substr(0, content_type.find(';'))));
  if (media != kOciManifestMediaType)
    fail(Errc::input, "{}: not an OCI image manifest: mediaType '{}', expected '{}'", url, printable_ascii(media),
         kOciManifestMediaType);
  if (auto v = j.find("schemaVersion"); v != j.end() && !(v->is_number_integer() && v->get<int64_t>() == 2))
    fail(Errc::registry, "{}: field schemaVersion is {} ({}), expected the integer 2", url, json_type_name(*v), show(*v));
  // OCI image-spec 1.1 (artifacts guidance; the distribution spec's referrers API does the same): a
  // manifest without artifactType is typed by its config's mediaType. `oras push --config
  // manifest.json:<config type>` without --artifact-type writes such a manifest.
  const std::string artifact = string_field(j, "artifactType", "", url).value_or("");
  auto config = j.find("config");
  if (config == j.end()) fail(Errc::registry, "{}: field config is missing", url);
  if (artifact.empty() && config->is_object()) {  // not an object: read_descriptor() says so below
    const std::string config_type = string_field(*config, "mediaType", "config.", url).value_or("");
    if (config_type != kBundleConfigMediaType)
      fail(Errc::input, "{}: not a decodepack bundle: no artifactType, and config.mediaType '{}' (which stands for it) "
           "is not '{}'", url, printable_ascii(config_type), kBundleConfigMediaType);
  } else if (artifact != kBundleArtifactType) {
    fail(Errc::input, "{}: not a decodepack bundle: artifactType '{}', expected '{}' (or none, with config.mediaType "
         "'{}')", url, printable_ascii(artifact), kBundleArtifactType, kBundleConfigMediaType);
  }

  BundleArtifact a;
  a.config = read_descriptor(*config, "config", kBundleConfigMediaType, url);
  if (a.config.size > kMaxSmallBody)
    fail(Errc::registry, "{}: field config.size is {} bytes; a bundle manifest of more than {} bytes is not read", url,
         a.config.size, kMaxSmallBody);
  auto layers = j.find("layers");
  if (layers == j.end()) fail(Errc::registry, "{}: field layers is missing", url);
  if (!layers->is_array())
    fail(Errc::registry, "{}: field layers is {}, expected an array", url, json_type_name(*layers));
  if (layers->size() != 1)
    fail(Errc::input, "{}: not a decodepack bundle: {} layers, expected exactly one", url, layers->size());
  a.layer = read_descriptor((*layers)[0], "layers[0]", kBundleLayerMediaType, url);
  if (auto ann = j.find("annotations"); ann != j.end()) {
    if (!ann->is_object())
      fail(Errc::registry, "{}: field annotations is {}, expected an object of strings", url, json_type_name(*ann));
    for (const auto& [k, v] : ann->items()) {
      if (!v.is_string())
        fail(Errc::registry, "{}: field annotations.{} is {} ({}), expected a string", url, printable_ascii(k),
             json_type_name(v), show(v));
      a.annotations[k] = v.get<std::string>();
    }
  }
  return a;
}

std::string describe_registry_errors(std::string_view body) {
  if (body.empty()) return {};
  Json j;
  try {
    j = parse_json(body, "error document");
  } catch (const Error&) {
  }
  if (j.is_object()) {
    auto errors = j.find("errors");
    if (errors != j.end() && errors->is_array()) {
      std::string out;
      size_t shown = 0;
      for (const Json& e : *errors) {
        if (!e.is_object()) continue;
        if (++shown > 5) {
          out += "; ...";
          break;
        }
        if (!out.empty()) out += "; ";
        auto code = e.find("code");
        out += code == e.end() ? "?" : show(*code);
        if (auto m = e.find("message"); m != e.end()) out += ": " + show(*m);
      }
      if (!out.empty()) return out;
    }
  }
  return fmt::format("\"{}\"", printable_ascii(trim_space(body)));
}

std::string parse_token_reply(std::string_view body, std::string_view url) {
  const Json j = parse_reply(body, "token reply", url);
  if (!j.is_object()) fail(Errc::registry, "{}: the token reply is {}, expected a JSON object", url, json_type_name(j));
  for (const char* key : {"token", "access_token"})
    if (std::optional<std::string> t = string_field(j, key, "", url); t && !t->empty()) {
      // The token goes into an HTTP header: a control character would end it early or start another.
      if (std::any_of(t->begin(), t->end(), [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; }))
        fail(Errc::registry, "{}: field {} holds a control character; a token is sent in an HTTP header", url, key);
      return *t;
    }
  fail(Errc::registry, "{}: the token reply has no \"token\" or \"access_token\" string", url);
}

std::optional<AuthChallenge> parse_auth_challenge(std::string_view header) {
  std::string_view s = trim_space(header);
  size_t sp = s.find(' ');
  AuthChallenge ch;
  ch.scheme = ascii_lower(s.substr(0, sp));
  if (ch.scheme.empty() || ch.scheme.find_first_of(",=\"") != std::string::npos) return std::nullopt;
  if (sp == std::string_view::npos) return ch;
  s = s.substr(sp + 1);
  while (true) {
    while (!s.empty() && (s.front() == ' ' || s.front() == ',')) s.remove_prefix(1);
    if (s.empty()) break;
    size_t eq = s.find('=');
    if (eq == std::string_view::npos) break;
    std::string_view key = trim_space(s.substr(0, eq));
    if (key.find(' ') != std::string_view::npos) break;  // the next challenge begins: only the first is used
    s.remove_prefix(eq + 1);
    std::string value;
    if (!s.empty() && s.front() == '"') {
      s.remove_prefix(1);
      bool closed = false;
      while (!s.empty()) {
        char c = s.front();
        s.remove_prefix(1);
        if (c == '\\' && !s.empty()) {
          value += s.front();
          s.remove_prefix(1);
        } else if (c == '"') {
          closed = true;
          break;
        } else {
          value += c;
        }
      }
      if (!closed) return std::nullopt;
    } else {
      size_t comma = s.find(',');
      value = std::string(trim_space(s.substr(0, comma)));
      s = comma == std::string_view::npos ? std::string_view() : s.substr(comma);
    }
    ch.params[ascii_lower(key)] = std::move(value);
  }
  return ch;
}

}  // namespace dp::bundle
