// libFuzzer target: dp::st::parse_header on arbitrary bytes.
//
// Contract under test: for any input, parse_header either returns a header whose tensors tile the data
// section exactly, or throws dp::Error(Errc::input). Anything else (another exception, a crash, a
// sanitizer report, an accepted header that breaks the invariants, a round trip that changes the
// table) is a bug. A fixed crash input belongs in corpus/safetensors/ so that every run replays it.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "common/error.h"
#include "model/safetensors.h"

namespace {

// Aborting (rather than returning) makes libFuzzer save the input as a crash artifact.
void check(bool ok) {
  if (!ok) std::abort();
}

void check_accepted(const dp::st::Header& h, std::span<const uint8_t> file) {
  check(h.data_start >= 8 && h.data_start <= file.size());
  uint64_t next = h.data_start;
  for (const dp::st::TensorInfo& t : h.tensors) {
    // parse_header returns tensors in data order, contiguous, inside the file.
    check(t.offset == next);
    check(t.size == t.numel() * dp::dtype_size(t.dtype));
    check(t.size <= file.size() - t.offset);
    next = t.offset + t.size;
  }
  check(next == file.size());

  // What was accepted must survive a write and a re-read unchanged (same table, same bytes).
  std::vector<dp::st::TensorData> data;
  for (const dp::st::TensorInfo& t : h.tensors)
    data.push_back({t.name, t.dtype, t.shape, {file.begin() + t.offset, file.begin() + t.offset + t.size}});
  std::string again = dp::st::serialize(data, h.metadata);
  auto bytes = std::span(reinterpret_cast<const uint8_t*>(again.data()), again.size());
  dp::st::Header h2 = dp::st::parse_header(bytes, "round trip");
  check(h2.metadata == h.metadata && h2.tensors.size() == h.tensors.size());
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const auto &a = h.tensors[i], &b = h2.tensors[i];
    check(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.size == b.size);
    check(a.size == 0 || std::memcmp(file.data() + a.offset, bytes.data() + b.offset, a.size) == 0);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> file(data, size);
  dp::st::Header h;
  try {
    h = dp::st::parse_header(file, "fuzz.safetensors");
  } catch (const dp::Error& e) {
    check(e.code() == dp::Errc::input);
    return 0;
  }
  check_accepted(h, file);
  return 0;
}
