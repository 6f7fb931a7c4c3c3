// SHA-256 through OpenSSL's libcrypto, streamed so that large files are never held in memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace dp {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t size);
  void update(std::string_view s) { update(s.data(), s.size()); }
  std::string hex();  // finishes the digest: 64 lowercase hex digits

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::string sha256_hex(std::string_view bytes);
std::string sha256_hex(std::span<const uint8_t> bytes);
// Reads the file in chunks; throws dp::Error(io) naming the path on failure.
std::string sha256_file(const std::filesystem::path& path);

}  // namespace dp
