#include "bundle/bundle.h"

#include <optional>

#include "common/error.h"

namespace dp::bundle {

void rethrow_format_error(const format::FormatError& e) {
  if (dynamic_cast<const format::BundleIoError*>(&e)) throw Error(Errc::io, e.what());
  throw Error(e.kind == format::FormatError::Kind::integrity ? Errc::verify : Errc::input, e.what());
}

Bundle Bundle::open(const std::filesystem::path& path) {
  std::optional<format::BundleReader> reader;
  try {
    reader.emplace(format::BundleReader::open(path));
  } catch (const format::FormatError& e) {
    rethrow_format_error(e);
  }
  // The format reader keeps `deploy` as opaque JSON; the tools read its fields, so it is checked here as
  // the deploy reader checks a deploy file (it is the canonical form of one).
  const std::string where =
      reader->is_archive() ? reader->label() + ":" + format::kManifestFile : (path / format::kManifestFile).string();
  deploy::Deploy d = deploy::parse_deploy(reader->manifest().deploy, where + ": deploy");
  return Bundle(path, std::move(*reader), std::move(d));
}

uint64_t Bundle::size(const std::string& rel) const {
  if (!reader_.has(rel)) fail(Errc::verify, "{}: missing file {}", path_.string(), rel);
  return reader_.size(rel);
}

std::string Bundle::sha256(const std::string& rel) const {
  if (!reader_.has(rel)) fail(Errc::verify, "{}: missing file {}", path_.string(), rel);
  try {
    return reader_.sha256(rel);
  } catch (const format::FormatError& e) {
    rethrow_format_error(e);
  }
}

std::span<const uint8_t> Bundle::file(const std::string& rel) const {
  if (!reader_.has(rel)) fail(Errc::verify, "{}: missing file {}", path_.string(), rel);
  try {
    return reader_.file(rel);
  } catch (const format::FormatError& e) {
    rethrow_format_error(e);
  }
}

}  // namespace dp::bundle
