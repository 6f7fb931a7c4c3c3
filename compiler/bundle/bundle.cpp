#include "bundle/bundle.h"

#include <optional>
#include <system_error>

#include "bundle/archive.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"
#include "common/output.h"

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

std::optional<std::vector<std::string>> bundle_own_files(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  // A manifest larger than the format allows is not one decodepack wrote; it is not read.
  constexpr uint64_t kMaxManifest = format::kMaxManifestBytes;
  try {
    std::error_code ec;
    const fs::file_status st = fs::symlink_status(path, ec);
    std::string text;
    if (fs::is_directory(st)) {
      const fs::path m = path / format::kManifestFile;
      if (!fs::is_regular_file(fs::symlink_status(m, ec)) || fs::file_size(m, ec) > kMaxManifest || ec) return std::nullopt;
      text = read_text_file(m, kMaxManifest);
    } else if (fs::is_regular_file(st)) {
      bool found = false;
      for (const ArchiveEntry& e : list_archive(path))
        if (e.path == format::kManifestFile) found = e.size <= kMaxManifest;
      if (!found) return std::nullopt;
      text = read_archive_member(path, format::kManifestFile);
    } else {
      return std::nullopt;
    }
    const Json j = parse_json(text, format::kManifestFile, kMaxManifest);
    if (!j.is_object() || !j.contains("format") || j["format"] != format::kFormatName) return std::nullopt;
    std::vector<std::string> own;
    if (!fs::is_directory(st)) return own;
    own.push_back(format::kManifestFile);
    if (j.contains("files") && j["files"].is_array())
      for (const Json& f : j["files"])
        if (f.is_object() && f.contains("path") && f["path"].is_string() &&
            format::bundle_path_problem(f["path"].get<std::string>()).empty())
          own.push_back(f["path"].get<std::string>());
    return own;
  } catch (const std::exception&) {
    return std::nullopt;
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
