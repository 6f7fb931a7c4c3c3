#include "model/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <functional>
#include <sstream>

#include "common/error.h"
#include "common/json.h"

namespace fs = std::filesystem;
using namespace dp;
using namespace dp::st;

namespace {

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() / fmt::format("dp-safetensors-test-{}-{}-{}", ::getpid(), counter++,
                                                    ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::vector<uint8_t> iota_bytes(size_t n, uint8_t start) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(start + i * 7);
  return v;
}

TensorData tensor(std::string name, DType dt, std::vector<int64_t> shape, uint8_t seed = 1) {
  uint64_t n = dtype_size(dt);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return {std::move(name), dt, std::move(shape), iota_bytes(n, seed)};
}

// A hand-assembled file: the length prefix, `header` verbatim, then `data_size` bytes.
std::vector<uint8_t> raw_file(const std::string& header, size_t data_size, uint64_t length_override = UINT64_MAX) {
  uint64_t n = length_override == UINT64_MAX ? header.size() : length_override;
  std::vector<uint8_t> out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>((n >> (8 * i)) & 0xff));
  out.insert(out.end(), header.begin(), header.end());
  out.resize(out.size() + data_size, 0xab);
  return out;
}

std::vector<uint8_t> to_bytes(const std::string& s) { return {s.begin(), s.end()}; }

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Runs `f`, which must throw dp::Error with `code` and a message containing every fragment.
void expect_error(const std::function<void()>& f, std::vector<std::string> fragments, Errc code = Errc::input) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& frag : fragments)
      EXPECT_NE(std::string(e.what()).find(frag), std::string::npos)
          << "message: " << e.what() << "\nexpected fragment: " << frag;
    return;
  }
  ADD_FAILURE() << "no dp::Error thrown; expected one containing: " << fragments.at(0);
}

void expect_parse_error(const std::string& header, size_t data_size, std::vector<std::string> fragments) {
  std::vector<uint8_t> f = raw_file(header, data_size);
  expect_error([&] { parse_header(f, "t.safetensors"); }, std::move(fragments));
}

}  // namespace

// Round trip -----------------------------------------------------------------------------------------

TEST(Safetensors, RoundTripIsByteExact) {
  TempDir dir;
  std::vector<TensorData> ts = {
      tensor("model.embed_tokens.weight", DType::BF16, {3, 5}, 3),
      tensor("model.layers.0.A_log", DType::F32, {7}, 9),
      tensor("scalar", DType::I64, {}, 11),
      tensor("empty", DType::U8, {0, 4}),
      tensor("model.norm.weight", DType::F8_E4M3, {3}, 5),
  };
  write_file(dir.path() / "model.safetensors", ts, {{"format", "pt"}});
  ASSERT_TRUE(Checkpoint::present(dir.path()));

  Checkpoint cp = Checkpoint::open(dir.path());
  ASSERT_EQ(cp.tensors().size(), ts.size());
  EXPECT_EQ(cp.num_files(), 1u);
  EXPECT_EQ(cp.file_path(0), dir.path() / "model.safetensors");
  EXPECT_TRUE(cp.index_path().empty());
  for (const TensorData& want : ts) {
    const TensorInfo* t = cp.find(want.name);
    ASSERT_NE(t, nullptr) << want.name;
    EXPECT_EQ(t->dtype, want.dtype);
    EXPECT_EQ(t->shape, want.shape);
    EXPECT_EQ(t->size, want.bytes.size());
    auto got = cp.data(*t);
    EXPECT_EQ(std::vector<uint8_t>(got.begin(), got.end()), want.bytes) << want.name;
  }
  EXPECT_EQ(cp.find("model.embed_tokens.weight")->numel(), 15u);
  EXPECT_EQ(cp.find("scalar")->numel(), 1u);
  EXPECT_EQ(cp.find("missing"), nullptr);

  // Moving the checkpoint keeps the mappings (and spans taken before the move) valid.
  auto before = cp.data(*cp.find("model.layers.0.A_log"));
  Checkpoint moved = std::move(cp);
  auto after = moved.data(*moved.find("model.layers.0.A_log"));
  EXPECT_EQ(before.data(), after.data());
}

TEST(Safetensors, WriterLayoutFollowsTheSpec) {
  std::vector<TensorData> ts = {tensor("b", DType::F16, {3}), tensor("a", DType::U8, {5}, 40)};
  std::string file = serialize(ts, {{"format", "pt"}, {"note", "x"}});
  Header h = parse_header(to_bytes(file), "mem");
  // Padded with spaces so that the data section is 8-byte aligned.
  EXPECT_EQ(h.data_start % 8, 0u);
  std::string header = file.substr(8, h.data_start - 8);
  size_t close = header.rfind('}');
  EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos) << header;
  EXPECT_LT(header.size() - close - 1, 8u);
  EXPECT_EQ(h.metadata.at("format"), "pt");
  EXPECT_EQ(h.metadata.at("note"), "x");
  // Tensors in the given order, contiguous: "b" first even though JSON keys are sorted.
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "b");
  EXPECT_EQ(h.tensors[0].offset, h.data_start);
  EXPECT_EQ(h.tensors[1].name, "a");
  EXPECT_EQ(h.tensors[1].offset, h.data_start + 6);
  EXPECT_EQ(file.size(), h.data_start + 11);
  EXPECT_EQ(file.substr(h.data_start + 6), std::string(ts[1].bytes.begin(), ts[1].bytes.end()));
  // No metadata: no __metadata__ key at all.
  EXPECT_EQ(serialize(ts, {}).find("__metadata__"), std::string::npos);
  // An empty checkpoint is a valid file.
  EXPECT_TRUE(parse_header(to_bytes(serialize({}, {})), "mem").tensors.empty());
}

TEST(Safetensors, WriterRefusesInconsistentInput) {
  TensorData bad = tensor("w", DType::BF16, {2, 2});
  bad.bytes.pop_back();
  expect_error([&] { serialize({bad}, {}); }, {"tensor w", "7 bytes given, expected 8", "[2, 2] x BF16 2 bytes"},
               Errc::internal);
  expect_error(
      [&] {
        serialize({tensor("w", DType::U8, {1}), tensor("w", DType::U8, {1})}, {});
      },
      {"tensor w is given twice"}, Errc::internal);
  expect_error([&] { serialize({tensor("__metadata__", DType::U8, {1})}, {}); }, {"reserved"}, Errc::internal);
  TensorData neg{"n", DType::U8, {-1}, {}};
  expect_error([&] { serialize({neg}, {}); }, {"tensor n", "invalid shape [-1]"}, Errc::internal);
}

// Checkpoint directories ----------------------------------------------------------------------------

TEST(Safetensors, ShardedIndex) {
  TempDir dir;
  write_file(dir.path() / "model-00001-of-00002.safetensors",
             {tensor("model.layers.0.w", DType::BF16, {4, 2}), tensor("model.embed", DType::F32, {3})}, {});
  write_file(dir.path() / "model-00002-of-00002.safetensors", {tensor("model.layers.1.w", DType::BF16, {2, 2}, 77)},
             {});
  write_index(dir.path(),
              {{"model.layers.0.w", "model-00001-of-00002.safetensors"},
               {"model.embed", "model-00001-of-00002.safetensors"},
               {"model.layers.1.w", "model-00002-of-00002.safetensors"}},
              16 + 12 + 8);
  // A model.safetensors beside the index is ignored: the index wins.
  write_file(dir.path() / "model.safetensors", {tensor("stray", DType::U8, {1})}, {});

  Json index = load_json_file(dir.path() / "model.safetensors.index.json");
  EXPECT_EQ(index["metadata"]["total_size"], 36);
  EXPECT_EQ(index["weight_map"]["model.embed"], "model-00001-of-00002.safetensors");

  Checkpoint cp = Checkpoint::open(dir.path());
  EXPECT_EQ(cp.index_path(), dir.path() / "model.safetensors.index.json");
  EXPECT_EQ(cp.dir(), dir.path());
  ASSERT_EQ(cp.num_files(), 2u);
  ASSERT_EQ(cp.tensors().size(), 3u);
  EXPECT_EQ(cp.find("stray"), nullptr);
  const TensorInfo* t = cp.find("model.layers.1.w");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(cp.file_path(t->file).filename(), "model-00002-of-00002.safetensors");
  auto d = cp.data(*t);
  EXPECT_EQ(std::vector<uint8_t>(d.begin(), d.end()), iota_bytes(8, 77));
  EXPECT_EQ(cp.file_path(cp.find("model.embed")->file).filename(), "model-00001-of-00002.safetensors");
  expect_error([&] { cp.file_path(5); }, {"file #5"}, Errc::internal);
}

TEST(Safetensors, IndexEntryMissingFromShard) {
  TempDir dir;
  write_file(dir.path() / "s1.safetensors", {tensor("a", DType::U8, {1})}, {});
  write_index(dir.path(), {{"a", "s1.safetensors"}, {"b", "s1.safetensors"}}, 2);
  expect_error([&] { Checkpoint::open(dir.path()); },
               {"model.safetensors.index.json", "weight_map maps tensor b to s1.safetensors",
                (dir.path() / "s1.safetensors").string(), "has no tensor of that name"});
}

TEST(Safetensors, ShardTensorMissingFromIndex) {
  TempDir dir;
  write_file(dir.path() / "s1.safetensors", {tensor("a", DType::U8, {1}), tensor("extra", DType::U8, {2})}, {});
  write_index(dir.path(), {{"a", "s1.safetensors"}}, 1);
  expect_error([&] { Checkpoint::open(dir.path()); },
               {(dir.path() / "s1.safetensors").string(), "tensor extra is not listed in",
                "model.safetensors.index.json weight_map"});
}

TEST(Safetensors, IndexPointsAtTheWrongShard) {
  TempDir dir;
  write_file(dir.path() / "s1.safetensors", {tensor("a", DType::U8, {1})}, {});
  write_file(dir.path() / "s2.safetensors", {tensor("b", DType::U8, {1})}, {});
  write_index(dir.path(), {{"a", "s2.safetensors"}, {"b", "s2.safetensors"}, {"c", "s1.safetensors"}}, 2);
  expect_error([&] { Checkpoint::open(dir.path()); },
               {"weight_map maps tensor a to s2.safetensors, but it is in", "s1.safetensors"});
}

TEST(Safetensors, IndexNamesAMissingShard) {
  TempDir dir;
  write_index(dir.path(), {{"a", "gone.safetensors"}}, 1);
  expect_error([&] { Checkpoint::open(dir.path()); }, {"gone.safetensors", "cannot open"}, Errc::io);
}

TEST(Safetensors, IndexFormatErrors) {
  TempDir dir;
  const fs::path index = dir.path() / "model.safetensors.index.json";
  write_bytes(index, R"({"metadata": {}})");
  expect_error([&] { Checkpoint::open(dir.path()); }, {index.string(), "missing field weight_map"});
  write_bytes(index, R"({"weight_map": []})");
  expect_error([&] { Checkpoint::open(dir.path()); }, {"field weight_map is an array", "expected an object"});
  write_bytes(index, R"({"weight_map": {"a": 3}})");
  expect_error([&] { Checkpoint::open(dir.path()); }, {"weight_map.a is an integer (3)", "expected a shard file name"});
  write_bytes(index, R"({"weight_map": {"a": "../x.safetensors"}})");
  expect_error([&] { Checkpoint::open(dir.path()); },
               {"weight_map.a is \"../x.safetensors\"", "expected a file name inside"});
  write_bytes(index, R"({"weight_map": {"a": "s.safetensors", "a": "t.safetensors"}})");
  expect_error([&] { Checkpoint::open(dir.path()); }, {index.string(), "key weight_map.a appears more than once"});
  write_bytes(index, R"({"weight_map": )");
  expect_error([&] { Checkpoint::open(dir.path()); }, {index.string(), "index is not valid JSON"});
}

TEST(Safetensors, DuplicateTensorAcrossShards) {
  TempDir dir;
  write_file(dir.path() / "a.safetensors", {tensor("x", DType::U8, {1}), tensor("y", DType::U8, {1})}, {});
  write_file(dir.path() / "b.safetensors", {tensor("x", DType::U8, {1})}, {});
  expect_error([&] { Checkpoint::open(dir.path()); }, {(dir.path() / "b.safetensors").string(), "tensor x is also in",
                                                       (dir.path() / "a.safetensors").string()});
}

TEST(Safetensors, AllShardsInSortedOrderWithoutIndex) {
  TempDir dir;
  write_file(dir.path() / "b.safetensors", {tensor("from_b", DType::U8, {1})}, {});
  write_file(dir.path() / "a.safetensors", {tensor("from_a", DType::U8, {1})}, {});
  write_bytes(dir.path() / ".a.safetensors.tmp.safetensors", "garbage");  // dot files are not shards
  write_bytes(dir.path() / "config.json", "{}");
  Checkpoint cp = Checkpoint::open(dir.path());
  ASSERT_EQ(cp.num_files(), 2u);
  EXPECT_EQ(cp.file_path(0).filename(), "a.safetensors");
  EXPECT_EQ(cp.file_path(1).filename(), "b.safetensors");
  EXPECT_EQ(cp.tensors()[0].name, "from_a");
  EXPECT_EQ(cp.find("from_b")->file, 1u);
}

TEST(Safetensors, DirectoryWithoutWeights) {
  TempDir dir;
  write_bytes(dir.path() / "config.json", "{}");
  EXPECT_FALSE(Checkpoint::present(dir.path()));
  expect_error([&] { Checkpoint::open(dir.path()); }, {dir.path().string(), "no model.safetensors.index.json"});
  expect_error([&] { Checkpoint::open(dir.path() / "nope"); }, {"nope", "not a directory"}, Errc::io);
}

TEST(Safetensors, BrokenShardNamesTheFile) {
  TempDir dir;
  write_bytes(dir.path() / "model.safetensors", "short");
  expect_error([&] { Checkpoint::open(dir.path()); }, {(dir.path() / "model.safetensors").string(), "5 bytes"});
}

// Header validation: one test per failure mode ------------------------------------------------------

TEST(SafetensorsHeader, AcceptsEdgeCases) {
  // Empty header, zero-byte tensors at shared boundaries, a 0 dim next to dims whose product overflows,
  // scalars, and unknown extra fields in an entry (the reference implementation ignores them too).
  std::vector<uint8_t> f = raw_file(R"({"z":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},)"
                                    R"("a":{"dtype":"F32","shape":[],"data_offsets":[0,4],"extra":1},)"
                                    R"("big0":{"dtype":"F64","shape":[4294967296,4294967296,0],"data_offsets":[4,4]},)"
                                    R"("b":{"dtype":"U16","shape":[1,1],"data_offsets":[4,6]}}  )",
                                    6);
  Header h = parse_header(f, "ok");
  ASSERT_EQ(h.tensors.size(), 4u);
  EXPECT_EQ(h.tensors.front().name, "z");
  EXPECT_EQ(h.tensors.back().name, "b");
  EXPECT_EQ(h.tensors.back().offset, h.data_start + 4);
  EXPECT_TRUE(parse_header(raw_file("{}", 0), "ok").tensors.empty());
  EXPECT_TRUE(parse_header(raw_file(R"({"__metadata__":{}})", 0), "ok").metadata.empty());
}

TEST(SafetensorsHeader, Truncated) {
  std::vector<uint8_t> f = {1, 2, 3};
  expect_error([&] { parse_header(f, "t.safetensors"); }, {"t.safetensors: file is 3 bytes, expected at least 8"});
}

TEST(SafetensorsHeader, HeaderLengthPastTheEnd) {
  std::vector<uint8_t> f = raw_file("{}", 0, 1000);
  expect_error([&] { parse_header(f, "t.safetensors"); },
               {"t.safetensors", "header length 1000", "8 + 1000 > file size 10"});
}

TEST(SafetensorsHeader, HeaderTooLarge) {
  std::vector<uint8_t> f = raw_file("{}", 0, 200'000'000);
  expect_error([&] { parse_header(f, "t.safetensors"); },
               {"header length 200000000", "exceeds the limit of 100000000 bytes"});
}

TEST(SafetensorsHeader, BadJson) {
  expect_parse_error(R"({"a": )", 0, {"t.safetensors: header is not valid JSON", "byte"});
  expect_parse_error("", 0, {"header is not valid JSON"});
  expect_parse_error(std::string("{\"\xff\": 1}"), 0, {"header is not valid JSON", "UTF-8"});
  expect_parse_error(std::string("{\"a\x01\": 1}"), 0, {"header is not valid JSON"});
}

TEST(SafetensorsHeader, NotAnObject) {
  expect_parse_error("[1, 2]", 0, {"header is an array ([1,2]), expected a JSON object"});
}

TEST(SafetensorsHeader, MetadataNotAnObjectOfStrings) {
  expect_parse_error(R"({"__metadata__": [1]})", 0, {"__metadata__ is an array", "expected an object of strings"});
  expect_parse_error(R"({"__metadata__": {"format": 1}})", 0,
                     {"__metadata__ key format is an integer (1), expected a string"});
}

TEST(SafetensorsHeader, EntryNotAnObject) {
  expect_parse_error(R"({"w": "x"})", 0, {"tensor w is a string (\"x\")", "expected an object"});
}

TEST(SafetensorsHeader, MissingFields) {
  expect_parse_error(R"({"w": {"shape": [1], "data_offsets": [0, 1]}})", 1, {"tensor w: missing field dtype", "BF16"});
  expect_parse_error(R"({"w": {"dtype": "U8", "data_offsets": [0, 1]}})", 1, {"tensor w: missing field shape"});
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [1]}})", 1,
                     {"tensor w: missing field data_offsets", "[begin, end]"});
}

TEST(SafetensorsHeader, UnknownDtype) {
  expect_parse_error(R"({"w": {"dtype": "F4", "shape": [1], "data_offsets": [0, 1]}})", 1,
                     {"tensor w: dtype \"F4\" is not supported", "expected one of BOOL, U8", "F8_E8M0"});
  expect_parse_error(R"({"w": {"dtype": 2, "shape": [1], "data_offsets": [0, 1]}})", 1,
                     {"tensor w: field dtype is an integer (2), expected a string"});
}

TEST(SafetensorsHeader, BadDims) {
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [2, -3], "data_offsets": [0, 1]}})", 1,
                     {"tensor w: shape[1] is -3, expected a non-negative integer"});
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [2.5], "data_offsets": [0, 1]}})", 1,
                     {"tensor w: shape[0] is a number (2.5), expected a non-negative integer"});
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": ["2"], "data_offsets": [0, 1]}})", 1,
                     {"shape[0] is a string", "expected a non-negative integer"});
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": {}, "data_offsets": [0, 1]}})", 1,
                     {"tensor w: field shape is an object", "expected a list of non-negative integers"});
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [18446744073709551615], "data_offsets": [0, 1]}})", 1,
                     {"shape[0] is 18446744073709551615, expected at most 9223372036854775807"});
}

TEST(SafetensorsHeader, ShapeOverflow) {
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [4294967296, 4294967296], "data_offsets": [0, 1]}})", 1,
                     {"tensor w: shape [4294967296, 4294967296] has more elements than fit in 64 bits"});
  expect_parse_error(R"({"w": {"dtype": "F64", "shape": [4611686018427387904], "data_offsets": [0, 1]}})", 1,
                     {"tensor w: shape [4611686018427387904] x F64 8 bytes is more bytes than fit in 64 bits"});
}

TEST(SafetensorsHeader, BadDataOffsets) {
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0]}})", 1,
                     {"tensor w: field data_offsets is an array ([0])", "expected [begin, end]"});
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [-1, 0]}})", 1,
                     {"data_offsets is an array ([-1,0])", "non-negative integers"});
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0.0, 1.0]}})", 1,
                     {"data_offsets is an array"});
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [1, 0]}})", 1,
                     {"tensor w: data_offsets [1, 0) has begin 1 > end 0"});
}

TEST(SafetensorsHeader, EndBeyondFile) {
  expect_parse_error(
      R"({"w": {"dtype": "U8", "shape": [200], "data_offsets": [0, 200]}})", 100,
      {"t.safetensors: tensor w: data_offsets [0, 200) end beyond the file", "end 200 > data section size 100"});
}

TEST(SafetensorsHeader, WrongSizeForDtype) {
  expect_parse_error(R"({"model.layers.0.mlp.up_proj.weight": {"dtype": "BF16", "shape": [9216, 256],)"
                     R"( "data_offsets": [0, 100]}})",
                     100,
                     {"t.safetensors: tensor model.layers.0.mlp.up_proj.weight: data_offsets [0, 100) hold 100 "
                      "bytes, expected 4718592 (shape [9216, 256] x BF16 2 bytes)"});
}

TEST(SafetensorsHeader, Overlap) {
  expect_parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                     R"( "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})",
                     6, {"tensor b: data_offsets [2, 6) overlap tensor a data_offsets [0, 4), expected begin 4"});
  // Equal ranges overlap as well.
  expect_parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                     R"( "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})",
                     4, {"tensor b: data_offsets [0, 4) overlap tensor a"});
}

TEST(SafetensorsHeader, Gaps) {
  expect_parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                     R"( "b": {"dtype": "U8", "shape": [2], "data_offsets": [6, 8]}})",
                     8,
                     {"data bytes [4, 6) between tensor a (ends at 4) and tensor b (begins at 6) belong to no tensor"});
  expect_parse_error(R"({"b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}})", 5,
                     {"data bytes [0, 3) before tensor b (begins at 3) belong to no tensor"});
  expect_parse_error(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})", 9,
                     {"data bytes [4, 9) after tensor a (ends at 4)", "data section is 9 bytes, expected 4"});
  expect_parse_error("{}", 3, {"data section holds 3 bytes but the header lists no tensor"});
}

TEST(SafetensorsHeader, DuplicateNames) {
  expect_parse_error(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},)"
                     R"( "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
                     2, {"t.safetensors: tensor w appears more than once in the header"});
  expect_parse_error(R"({"w": {"dtype": "U8", "dtype": "F32", "shape": [1], "data_offsets": [0, 1]}})", 1,
                     {"header key w.dtype appears more than once"});
  expect_parse_error(R"({"__metadata__": {"k": "a", "k": "b"}})", 0,
                     {"header key __metadata__.k appears more than once"});
}

TEST(SafetensorsHeader, HostileNamesAreEscaped) {
  std::vector<uint8_t> f = raw_file("{\"evil\\nname\": 1}", 0);
  try {
    parse_header(f, "t");
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("evil\\x0aname"), std::string::npos) << e.what();
  }
  // Malformed UTF-8 quoted back by the JSON parser is escaped too; well-formed UTF-8 is kept.
  f = raw_file("{\"\xc3\x28\": 1}", 0);
  expect_error([&] { parse_header(f, "t"); }, {"\\xc3("});
  f = raw_file(
      "{\"gr\xc3\xbc\xc3\x9f"
      "e\": 1}",
      0);
  expect_error([&] { parse_header(f, "t"); }, {"tensor gr\xc3\xbc\xc3\x9f"
                                               "e is an integer"});
}

// Broken-input corpus (tests/corpus/safetensors, made by make_corpus.py) ----------------------------

TEST(SafetensorsCorpus, EveryFileFailsWithItsMessage) {
  const fs::path dir = fs::path(DP_TEST_DATA_DIR) / "corpus" / "safetensors";
  std::ifstream in(dir / "expected.txt");
  ASSERT_TRUE(in) << (dir / "expected.txt");
  std::map<std::string, std::vector<std::string>> expected;  // file -> fragments (one per line)
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    auto tab = line.find('\t');
    ASSERT_NE(tab, std::string::npos) << "expected.txt line without a tab: " << line;
    expected[line.substr(0, tab)].push_back(line.substr(tab + 1));
  }
  ASSERT_GE(expected.size(), 11u);
  for (const auto& [file, fragments] : expected) {
    SCOPED_TRACE(file);
    MappedFile mf(dir / file);
    expect_error([&] { parse_header(mf.bytes(), file); }, fragments);
  }
  // Every corpus file is covered by expected.txt.
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") {
      EXPECT_TRUE(expected.count(e.path().filename().string())) << e.path() << " has no line in expected.txt";
    }
  }
}
