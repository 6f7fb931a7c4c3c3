// tooling/weights: the bytes a rank binds are the bytes its fingerprint hashed at build time, for a
// checkpoint whose dtype differs from the bound one (F32 stored, BF16 bound), NaN included.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>

#include "bundle/fingerprint.h"
#include "common/hash.h"
#include "model/safetensors.h"
#include "../test_util.h"
#include "tooling/weights.h"

namespace dp::tools {
namespace {

TEST(Weights, RankBytesHashToTheFingerprints) {
  test::TempDir dir;
  const std::vector<int64_t> shape{4, 6};
  std::vector<float> v(24);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.37f * static_cast<float>(i) - 3.1f;
  v[7] = -std::numeric_limits<float>::quiet_NaN();
  std::vector<uint8_t> bytes(v.size() * 4);
  std::memcpy(bytes.data(), v.data(), bytes.size());
  st::write_file(dir / "model.safetensors", {{"model.w", DType::F32, shape, bytes}}, {});
  const st::Checkpoint ckpt = st::Checkpoint::open(dir.path());

  model::Model m;
  model::WeightSpec w;
  w.name = "model.w";
  w.dtype = DType::BF16;
  w.alt_dtypes = {DType::F32};
  w.shape = shape;
  const WeightSource src(m, &ckpt, 0);
  for (int dim = 0; dim < 2; ++dim)
    for (int64_t rank = 0; rank < 2; ++rank) {
      const int64_t part = shape[static_cast<size_t>(dim)] / 2;
      const std::vector<uint8_t> got = src.rank_bytes(w, dim, part, rank);
      ASSERT_EQ(got.size(), 12u * 2);
      Sha256 h;
      h.update(got.data(), got.size());
      const bundle::ShardRef ref{ckpt.find("model.w"), dim, part * rank, part * (rank + 1), DType::BF16};
      EXPECT_EQ(h.hex(), bundle::fingerprint(ckpt, ref)) << "dim " << dim << " rank " << rank;
    }
  EXPECT_EQ(src.rank_bytes(w, -1, 0, 0), src.full_bytes(w));
}

TEST(Weights, UnconvertibleCheckpointDtypeIsAnInputError) {
  test::TempDir dir;
  st::write_file(dir / "model.safetensors", {{"model.w", DType::I32, {2}, std::vector<uint8_t>(8, 0)}}, {});
  const st::Checkpoint ckpt = st::Checkpoint::open(dir.path());
  model::Model m;
  model::WeightSpec w;
  w.name = "model.w";
  w.shape = {2};
  const WeightSource src(m, &ckpt, 0);
  test::expect_error([&] { src.full_bytes(w); }, Errc::input, {"model.w", "I32", "BF16"});
}

}  // namespace
}  // namespace dp::tools
