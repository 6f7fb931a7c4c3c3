#include "bundle/fingerprint.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/dtype.h"
#include "common/error.h"
#include "common/hash.h"
#include "format/untrusted.h"

namespace dp::bundle {
namespace {

constexpr size_t kChunk = 4 << 20;

class Reader {
 public:
  explicit Reader(const std::filesystem::path& p) : path_(p) {
    std::string why;
    uint64_t size = 0;
    fd_ = format::open_regular_file(p, &size, &why);  // never blocks on a FIFO swapped in meanwhile
    if (fd_ < 0) fail(Errc::io, "{}: {}", p.string(), why);
  }
  ~Reader() { ::close(fd_); }
  void read(uint64_t offset, size_t size, uint8_t* out) {
    while (size > 0) {
      ssize_t n = ::pread(fd_, out, size, static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail(Errc::io, "{}: short read at byte {}", path_.string(), offset);
      out += n, size -= static_cast<size_t>(n), offset += static_cast<uint64_t>(n);
    }
  }

 private:
  std::filesystem::path path_;
  int fd_;
};

// Feeds `n` bytes stored as `from` into the hash as `to`.
void hash_converted(Sha256& h, const uint8_t* p, size_t n, DType from, DType to, std::vector<uint8_t>& tmp) {
  const bool same_bytes = from == to || ((from == DType::U8 || from == DType::F8_E8M0) &&
                                         (to == DType::U8 || to == DType::F8_E8M0));  // E8M0 scales stored as U8
  if (same_bytes) {
    h.update(p, n);
    return;
  }
  if (from == DType::BF16 && to == DType::F32) {  // exact widening
    tmp.resize(n * 2);
    for (size_t i = 0; i < n / 2; ++i) {
      uint32_t u = static_cast<uint32_t>(p[2 * i] | (p[2 * i + 1] << 8)) << 16;
      std::memcpy(&tmp[4 * i], &u, 4);
    }
    h.update(tmp.data(), tmp.size());
    return;
  }
  if (from == DType::F32 && to == DType::BF16) {  // round to nearest even, as the device load does
    tmp.resize(n / 2);
    for (size_t i = 0; i < n / 4; ++i) {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      const uint16_t b = f32_to_bf16_bits(f);  // a NaN stays a (quiet) NaN, never rounds to Inf
      tmp[2 * i] = static_cast<uint8_t>(b);
      tmp[2 * i + 1] = static_cast<uint8_t>(b >> 8);
    }
    h.update(tmp.data(), tmp.size());
    return;
  }
  fail(Errc::input, "cannot convert {} to {} for fingerprinting", dtype_name(from), dtype_name(to));
}

}  // namespace

std::string fingerprint(const st::Checkpoint& ckpt, const ShardRef& s) {
  const st::TensorInfo& t = *s.tensor;
  const uint64_t elem = dtype_size(t.dtype);
  // Callers check the shard against the tensor's shape; this keeps a mistake there from reading outside it.
  if (s.split_dim >= static_cast<int>(t.shape.size()) ||
      (s.split_dim >= 0 && (s.begin < 0 || s.begin > s.end || s.end > t.shape[static_cast<size_t>(s.split_dim)])))
    fail(Errc::verify, "tensor {}: shape {} has no range [{}, {}) along dimension {}", t.name,
         st::shape_string(t.shape), s.begin, s.end, s.split_dim);
  // The shard is `outer` contiguous runs of `run` bytes, `stride` bytes apart.
  uint64_t outer = 1, inner = elem, dim_len = 1;
  if (s.split_dim >= 0) {
    for (int d = 0; d < s.split_dim; ++d) outer *= static_cast<uint64_t>(t.shape[d]);
    for (size_t d = static_cast<size_t>(s.split_dim) + 1; d < t.shape.size(); ++d) inner *= static_cast<uint64_t>(t.shape[d]);
    dim_len = static_cast<uint64_t>(t.shape[static_cast<size_t>(s.split_dim)]);
  } else {
    inner = t.size;
  }
  const uint64_t begin = s.split_dim >= 0 ? static_cast<uint64_t>(s.begin) : 0;
  const uint64_t run = s.split_dim >= 0 ? static_cast<uint64_t>(s.end - s.begin) * inner : t.size;
  const uint64_t stride = dim_len * inner;

  Reader r(ckpt.file_path(t.file));
  Sha256 h;
  std::vector<uint8_t> buf, tmp;
  for (uint64_t o = 0; o < outer; ++o) {
    uint64_t pos = t.offset + o * stride + begin * inner, left = run;
    while (left > 0) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(left, kChunk));
      n -= n % elem;
      if (n == 0) n = static_cast<size_t>(left);
      buf.resize(n);
      r.read(pos, n, buf.data());
      hash_converted(h, buf.data(), n, t.dtype, s.dtype, tmp);
      pos += n, left -= n;
    }
  }
  return h.hex();
}

std::vector<std::string> fingerprint_all(const st::Checkpoint& ckpt, const std::vector<ShardRef>& shards,
                                         unsigned jobs, Progress* progress) {
  std::vector<std::string> out(shards.size());
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < shards.size();) {
      try {
        out[i] = fingerprint(ckpt, shards[i]);
        if (progress) progress->advance();
      } catch (...) {
        std::lock_guard<std::mutex> g(error_mu);
        if (!error) error = std::current_exception();
        next = shards.size();
      }
    }
  };
  jobs = std::max(1u, std::min<unsigned>(jobs, static_cast<unsigned>(shards.size())));
  std::vector<std::thread> pool;
  for (unsigned j = 1; j < jobs; ++j) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  return out;
}

}  // namespace dp::bundle
