#include "bundle/fingerprint.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/dtype.h"
#include "common/error.h"
#include "common/hash.h"
#include "format/untrusted.h"
#include "model/shard.h"

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

// An FP8 block scale (fp32 weight_scale_inv) multiplies every weight of its 128x128 block: NaN, an
// infinity, zero or a negative value would silently decode as garbage, so the bytes hashed for the
// bundle are checked as they stream by. `first` is the index of buf's first element in the tensor.
void check_block_scales(const st::Checkpoint& ckpt, const st::TensorInfo& t, const std::vector<uint8_t>& buf,
                        uint64_t first) {
  const int64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
  for (size_t i = 0; i + 4 <= buf.size(); i += 4) {
    float v;
    std::memcpy(&v, buf.data() + i, 4);
    if (std::isfinite(v) && v > 0.0f) continue;
    const uint64_t e = first + i / 4;
    fail(Errc::input, "{}: FP8 block scale {} [{}, {}] is {}: every weight_scale_inv must be finite and positive",
         ckpt.file_path(t.file).string(), t.name, e / static_cast<uint64_t>(cols), e % static_cast<uint64_t>(cols),
         std::isnan(v) ? std::string("NaN") : fmt::format("{}", v));
  }
}

}  // namespace

std::string fingerprint(const st::Checkpoint& ckpt, const ShardRef& s) {
  const st::TensorInfo& t = *s.tensor;
  const uint64_t elem = dtype_size(t.dtype);
  if (!model::can_convert(t.dtype, s.dtype))
    fail(Errc::input, "cannot convert {} to {} for fingerprinting", dtype_name(t.dtype), dtype_name(s.dtype));
  // Callers check the shard against the tensor's shape; shard_layout keeps a mistake there from reading
  // outside it.
  const model::ShardLayout l = model::shard_layout(t.shape, elem, {s.split_dim, s.begin, s.end}, t.name);

  Reader r(ckpt.file_path(t.file));
  const bool scales = t.dtype == DType::F32 && t.name.ends_with(".weight_scale_inv");
  Sha256 h;
  std::vector<uint8_t> buf, converted;
  for (uint64_t o = 0; o < l.outer; ++o) {
    uint64_t pos = t.offset + l.offset(o), left = l.run;
    while (left > 0) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(left, kChunk));
      n -= n % elem;
      if (n == 0) n = static_cast<size_t>(left);
      buf.resize(n);
      r.read(pos, n, buf.data());
      if (scales) check_block_scales(ckpt, t, buf, (pos - t.offset) / elem);
      if (t.dtype == s.dtype) {
        h.update(buf.data(), n);
      } else {
        model::convert_elements(buf, t.dtype, s.dtype, converted);  // the bytes the device binds
        h.update(converted.data(), converted.size());
      }
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
