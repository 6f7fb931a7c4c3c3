#include "bundle/bundle.h"

#include <algorithm>

#include "bundle/archive.h"
#include "common/error.h"
#include "common/hash.h"
#include "common/json.h"

namespace fs = std::filesystem;

namespace dp::bundle {

void rethrow_format_error(const format::FormatError& e) {
  throw Error(e.kind == format::FormatError::Kind::integrity ? Errc::verify : Errc::input, e.what());
}

Bundle Bundle::open(const fs::path& path) {
  Bundle b;
  b.path_ = path;
  std::error_code ec;
  const std::string where = (path / format::kManifestFile).string();
  if (fs::is_directory(path, ec)) {
    if (!fs::exists(path / format::kManifestFile, ec))
      fail(Errc::input, "{}: not a bundle: no {}", path.string(), format::kManifestFile);
    b.manifest_bytes_ = read_text_file(path / format::kManifestFile);
  } else if (fs::is_regular_file(path, ec)) {
    b.archive_ = true;
    for (const ArchiveEntry& e : list_archive(path)) b.members_[e.path] = {e.offset, e.size};
    b.map_ = MappedFile(path);
    auto it = b.members_.find(format::kManifestFile);
    if (it == b.members_.end()) fail(Errc::input, "{}: not a bundle: no {} member", path.string(), format::kManifestFile);
    b.manifest_bytes_.assign(reinterpret_cast<const char*>(b.map_.data() + it->second.first), it->second.second);
  } else {
    fail(Errc::io, "{}: no such bundle (expected a directory or a .dpk file)", path.string());
  }
  const std::string label = b.archive_ ? path.string() + ":" + format::kManifestFile : where;
  try {
    b.manifest_ = format::from_json(parse_json(b.manifest_bytes_, label), label);
  } catch (const format::FormatError& e) {
    rethrow_format_error(e);
  }
  return b;
}

std::string Bundle::digest() const { return "sha256:" + sha256_hex(manifest_bytes_); }

std::vector<std::string> Bundle::files() const {
  std::vector<std::string> out;
  if (archive_) {
    for (const auto& [p, _] : members_)
      if (p != format::kManifestFile) out.push_back(p);
  } else {
    for (const auto& e : fs::recursive_directory_iterator(path_)) {
      if (e.is_symlink())  // a link could point anywhere: bundles hold regular files only
        fail(Errc::verify, "{}: {} is a symbolic link; a bundle holds regular files only", path_.string(),
             fs::relative(e.path(), path_).generic_string());
      if (!e.is_regular_file()) continue;
      std::string rel = fs::relative(e.path(), path_).generic_string();
      if (rel != format::kManifestFile) out.push_back(rel);
    }
    std::sort(out.begin(), out.end());
  }
  return out;
}

bool Bundle::has(const std::string& rel) const {
  if (archive_) return members_.count(rel) > 0;
  std::error_code ec;
  return !fs::is_symlink(path_ / rel, ec) && fs::is_regular_file(path_ / rel, ec);
}

std::span<const uint8_t> Bundle::file(const std::string& rel) const {
  if (archive_) {
    auto it = members_.find(rel);
    if (it == members_.end()) fail(Errc::verify, "{}: missing file {}", path_.string(), rel);
    return {map_.data() + it->second.first, it->second.second};
  }
  auto it = dir_cache_.find(rel);
  if (it == dir_cache_.end()) {
    if (!has(rel)) fail(Errc::verify, "{}: missing file {}", path_.string(), rel);
    std::string s = read_text_file(path_ / rel);
    it = dir_cache_.emplace(rel, std::vector<uint8_t>(s.begin(), s.end())).first;
  }
  return it->second;
}

}  // namespace dp::bundle
