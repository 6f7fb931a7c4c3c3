// Deployment config: every rule, every default, the canonical form, the schema staying in step with the
// reader, the model-dependent checks and the broken-input corpus (tests/corpus/deploy).
#include "deploy/deploy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "common/embedded.h"
#include "common/error.h"
#include "model/ir.h"
#include "deploy_errors.h"

namespace fs = std::filesystem;
using dp::Errc;
using dp::Json;
using namespace dp::deploy;
using dp::test::deploy_error_of;

namespace {

const std::string kWhere = "deploy.json";

Deploy parse(const std::string& text) { return parse_deploy(dp::parse_json(text, kWhere), kWhere); }

// A minimal valid deploy file with `patch` merged in (JSON merge patch: null removes a key).
Json minimal(const Json& patch = Json::object()) {
  Json j = {{"targets", {"sm_90a"}}, {"max_num_seqs", 4}};
  j.merge_patch(patch);
  return j;
}

// ---- Defaults -----------------------------------------------------------------------------------------

TEST(Deploy, DefaultsOfAMinimalFile) {
  Deploy d = parse_deploy(minimal(), kWhere);
  EXPECT_EQ(d.targets, std::vector<std::string>{"sm_90a"});
  EXPECT_EQ(d.tensor_parallel, 1);
  EXPECT_EQ(d.ranks, std::vector<int64_t>{0});
  EXPECT_EQ(d.widths, (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_EQ(d.num_speculative_tokens, 0);
  EXPECT_EQ(d.q(), 1);
  EXPECT_EQ(d.max_width(), 4);
  EXPECT_EQ(d.kv_cache.dtype, KvCacheDtype::bf16);
  EXPECT_EQ(d.kv_cache.block_size, 64);
  EXPECT_EQ(d.kda_state.dtype, KdaStateDtype::float32);
  EXPECT_EQ(d.kda_state.layout, KdaStateLayout::kv);
  EXPECT_EQ(d.conv_state.dtype, ConvStateDtype::bf16);
  EXPECT_EQ(d.conv_state.layout, ConvStateLayout::sd);
  EXPECT_EQ(d.dcp.size, 1);
  EXPECT_EQ(d.dcp.interleave, 1);
  EXPECT_TRUE(d.prefetch.enabled);
  EXPECT_EQ(d.prefetch.cap_bytes, 24 << 20);
  EXPECT_EQ(d.prefetch.max_rows, 8);
  EXPECT_TRUE(d.prefetch.width_cap_bytes.empty());
  EXPECT_EQ(d.indexer.max_keys_per_chunk, 40 * 163840);
  EXPECT_EQ(d.indexer.max_requests, 1024);
  // A default-constructed Deploy has the same defaults as the reader, apart from what the file must give.
  Deploy blank;
  blank.targets = d.targets;
  blank.ranks = d.ranks;
  blank.widths = d.widths;
  EXPECT_EQ(blank, d);
}

TEST(Deploy, EmptyNestedObjectsMeanDefaults) {
  Deploy a = parse_deploy(minimal(), kWhere);
  Deploy b = parse_deploy(minimal({{"kv_cache", Json::object()}, {"kda_state", Json::object()},
                                   {"conv_state", Json::object()}, {"dcp", Json::object()},
                                   {"prefetch", Json::object()}, {"indexer", Json::object()}}),
                          kWhere);
  EXPECT_EQ(a, b);
}

TEST(Deploy, BuiltInDefaultDeploy) {
  Deploy d = load_deploy("default");
  EXPECT_EQ(d.targets, (std::vector<std::string>{"gfx942", "sm_90a"}));
  EXPECT_EQ(d.tensor_parallel, 1);
  EXPECT_EQ(d.ranks, std::vector<int64_t>{0});
  EXPECT_EQ(d.widths, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(d.num_speculative_tokens, 0);
  EXPECT_EQ(d.kv_cache.dtype, KvCacheDtype::bf16);
  EXPECT_EQ(d.kv_cache.block_size, 64);
  // The embedded file uses only the fixed keys of DESIGN.md section 4.
  Json j = dp::parse_json(*dp::embedded_file("deploy-default.json"), "deploy-default.json");
  std::set<std::string> keys;
  for (auto it = j.begin(); it != j.end(); ++it) keys.insert(it.key());
  EXPECT_EQ(keys, (std::set<std::string>{"targets", "tensor_parallel", "max_num_seqs", "num_speculative_tokens",
                                         "kv_cache"}));
}

TEST(Deploy, LoadFromFile) {
  fs::path dir = fs::temp_directory_path() / ("dp_deploy_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::path p = dir / "d.json";
  std::ofstream(p) << R"({"targets": ["gfx950"], "widths": [2, 1]})";
  Deploy d = load_deploy(p.string());
  EXPECT_EQ(d.targets, std::vector<std::string>{"gfx950"});
  EXPECT_EQ(d.widths, (std::vector<int64_t>{1, 2}));

  std::ofstream(p) << R"({"targets": ["gfx950"], "widths": [0]})";
  try {
    load_deploy(p.string());
    ADD_FAILURE() << "no error";
  } catch (const dp::Error& e) {
    EXPECT_EQ(e.code(), Errc::input);
    EXPECT_EQ(std::string(e.what()), p.string() + ": widths[0] 0 is out of range (valid: 1..64)");
  }
  try {
    load_deploy((dir / "missing.json").string());
    ADD_FAILURE() << "no error";
  } catch (const dp::Error& e) {
    EXPECT_EQ(e.code(), Errc::io);
  }
  fs::remove_all(dir);
}

// ---- Targets ------------------------------------------------------------------------------------------

TEST(Deploy, TargetTable) {
  auto t = known_targets();
  ASSERT_FALSE(t.empty());
  EXPECT_TRUE(std::is_sorted(t.begin(), t.end(), [](const TargetInfo& a, const TargetInfo& b) { return a.name < b.name; }));
  for (const TargetInfo& x : t) {
    EXPECT_EQ(find_target(x.name), &x);
    if (x.vendor == Vendor::hip) {
      EXPECT_TRUE(x.name.starts_with("gfx"));
      EXPECT_GT(x.min_llvm_major, 0) << x.name;
      EXPECT_EQ(x.min_cuda_major, 0) << x.name;
    } else {
      EXPECT_TRUE(x.name.starts_with("sm_"));
      EXPECT_GE(x.min_cuda_major, 11) << x.name;
      EXPECT_EQ(x.min_llvm_major, 0) << x.name;
    }
  }
  for (const char* name : {"sm_80", "sm_90", "sm_90a", "sm_100a", "gfx90a", "gfx942", "gfx950"})
    EXPECT_NE(find_target(name), nullptr) << name;
  EXPECT_EQ(find_target("gfx942")->vendor, Vendor::hip);
  EXPECT_EQ(find_target("gfx942")->min_llvm_major, 17);
  EXPECT_EQ(find_target("gfx950")->min_llvm_major, 20);  // DESIGN.md 7: gfx950 needs LLVM >= 20
  EXPECT_EQ(find_target("sm_90a")->vendor, Vendor::cuda);
  EXPECT_EQ(find_target("sm_90a")->min_cuda_major, 12);
  EXPECT_EQ(find_target("sm_91"), nullptr);
  EXPECT_STREQ(to_string(Vendor::cuda), "cuda");
  EXPECT_STREQ(to_string(Vendor::hip), "hip");
}

TEST(Deploy, TargetsAreSortedAndChecked) {
  EXPECT_EQ(parse_deploy(minimal({{"targets", {"sm_90a", "gfx942", "sm_80"}}}), kWhere).targets,
            (std::vector<std::string>{"gfx942", "sm_80", "sm_90a"}));
  EXPECT_EQ(deploy_error_of(minimal({{"targets", {"sm_90a", "sm_91"}}})),
            "deploy.json: targets[1] \"sm_91\" is not a known target (valid: gfx90a, gfx942, gfx950, sm_100a, "
            "sm_120a, sm_80, sm_86, sm_89, sm_90, sm_90a)");
  EXPECT_MSG(minimal({{"targets", {"sm_90a", "sm_90a"}}}), "targets[1] \"sm_90a\" is listed twice");
  EXPECT_MSG(minimal({{"targets", Json::array()}}), "targets is an empty list");
  EXPECT_MSG(minimal({{"targets", "sm_90a"}}), "targets is a string (\"sm_90a\"), expected a list");
  EXPECT_MSG(minimal({{"targets", {90}}}), "targets[0] is an integer (90), expected a string");
  EXPECT_MSG(minimal({{"targets", nullptr}}), "missing field targets");
}

// ---- Tensor parallelism and ranks ------------------------------------------------------------------

TEST(Deploy, TensorParallelSizes) {
  for (int tp : {1, 2, 4, 8}) {
    Deploy d = parse_deploy(minimal({{"tensor_parallel", tp}}), kWhere);
    EXPECT_EQ(d.tensor_parallel, tp);
    ASSERT_EQ(d.ranks.size(), static_cast<size_t>(tp));  // default: every rank
    for (int r = 0; r < tp; ++r) EXPECT_EQ(d.ranks[r], r);
  }
  for (int tp : {0, 3, 6, 16, -1})
    EXPECT_EQ(deploy_error_of(minimal({{"tensor_parallel", tp}})),
              fmt::format("deploy.json: tensor_parallel {} is not supported (valid: 1, 2, 4, 8)", tp));
  EXPECT_MSG(minimal({{"tensor_parallel", "2"}}), "tensor_parallel is a string (\"2\"), expected an integer");
  EXPECT_MSG(minimal({{"tensor_parallel", true}}), "tensor_parallel is a boolean");
  EXPECT_EQ(parse_deploy(minimal({{"tensor_parallel", 2.0}}), kWhere).tensor_parallel, 2);
  EXPECT_MSG(minimal({{"tensor_parallel", 2.5}}), "tensor_parallel is a number (2.5), expected an integer");
  EXPECT_MSG(dp::parse_json(R"({"targets":["sm_90a"],"max_num_seqs":1,"tensor_parallel":18446744073709551615})", "x"),
             "tensor_parallel 18446744073709551615 is out of range (too large for a 64-bit integer)");
}

TEST(Deploy, Ranks) {
  EXPECT_EQ(parse_deploy(minimal({{"tensor_parallel", 4}, {"ranks", {3, 1}}}), kWhere).ranks,
            (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(deploy_error_of(minimal({{"tensor_parallel", 4}, {"ranks", {0, 4}}})),
            "deploy.json: ranks[1] 4 is not a rank of tensor_parallel 4 (valid: 0..3)");
  EXPECT_EQ(deploy_error_of(minimal({{"ranks", {-1}}})),
            "deploy.json: ranks[0] -1 is not a rank of tensor_parallel 1 (valid: 0..0)");
  EXPECT_MSG(minimal({{"tensor_parallel", 2}, {"ranks", {1, 1}}}), "ranks[1] 1 is listed twice (each rank once)");
  EXPECT_MSG(minimal({{"ranks", Json::array()}}), "ranks is an empty list");
  EXPECT_MSG(minimal({{"ranks", {"0"}}}), "ranks[0] is a string");
}

// ---- Widths and speculative decoding -----------------------------------------------------------------

TEST(Deploy, WidthsFromMaxNumSeqs) {
  EXPECT_EQ(parse_deploy(minimal({{"max_num_seqs", 1}}), kWhere).widths, std::vector<int64_t>{1});
  Deploy d = parse_deploy(minimal({{"max_num_seqs", kMaxWidth}}), kWhere);
  EXPECT_EQ(d.widths.size(), static_cast<size_t>(kMaxWidth));
  EXPECT_EQ(d.max_width(), kMaxWidth);
  EXPECT_EQ(deploy_error_of(minimal({{"max_num_seqs", 0}})).substr(0, 55),
            "deploy.json: max_num_seqs 0 is out of range (valid: 1..");
  EXPECT_MSG(minimal({{"max_num_seqs", 65}}), "max_num_seqs 65 is out of range (valid: 1..64; steps wider");
  EXPECT_MSG(minimal({{"max_num_seqs", -3}}), "max_num_seqs -3 is out of range");
  EXPECT_MSG(minimal({{"max_num_seqs", "8"}}), "max_num_seqs is a string");
}

TEST(Deploy, ExplicitWidths) {
  Json j = minimal({{"max_num_seqs", nullptr}, {"widths", {8, 1, 4, 2}}});
  EXPECT_EQ(parse_deploy(j, kWhere).widths, (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(deploy_error_of(minimal({{"max_num_seqs", nullptr}, {"widths", {1, 0}}})),
            "deploy.json: widths[1] 0 is out of range (valid: 1..64)");
  EXPECT_MSG(minimal({{"max_num_seqs", nullptr}, {"widths", {65}}}), "widths[0] 65 is out of range (valid: 1..64)");
  EXPECT_MSG(minimal({{"max_num_seqs", nullptr}, {"widths", {2, 4, 2}}}), "widths[2] 2 is listed twice (each width once)");
  EXPECT_MSG(minimal({{"max_num_seqs", nullptr}, {"widths", Json::array()}}), "widths is an empty list");
  EXPECT_MSG(minimal({{"max_num_seqs", nullptr}, {"widths", {1.5}}}), "widths[0] is a number (1.5), expected an integer");
  EXPECT_MSG(minimal({{"max_num_seqs", nullptr}, {"widths", 4}}), "widths is an integer (4), expected a list");
}

TEST(Deploy, WidthsXorMaxNumSeqs) {
  EXPECT_MSG(minimal({{"widths", {1}}}), "give either max_num_seqs or widths, not both");
  EXPECT_MSG(minimal({{"max_num_seqs", nullptr}}), "missing field max_num_seqs");
}

TEST(Deploy, SpeculativeTokens) {
  for (int n = 0; n <= kMaxSpeculativeTokens; ++n) {
    Deploy d = parse_deploy(minimal({{"num_speculative_tokens", n}}), kWhere);
    EXPECT_EQ(d.num_speculative_tokens, n);
    EXPECT_EQ(d.q(), n + 1);
  }
  EXPECT_EQ(deploy_error_of(minimal({{"num_speculative_tokens", 8}})),
            "deploy.json: num_speculative_tokens 8 is out of range (valid: 0..7)");
  EXPECT_MSG(minimal({{"num_speculative_tokens", -1}}), "num_speculative_tokens -1 is out of range (valid: 0..7)");
}

// ---- Caches and states -------------------------------------------------------------------------------

TEST(Deploy, KvCache) {
  Deploy d = parse_deploy(minimal({{"kv_cache", {{"dtype", "fp8"}, {"block_size", 16}}}}), kWhere);
  EXPECT_EQ(d.kv_cache.dtype, KvCacheDtype::fp8);
  EXPECT_EQ(d.kv_cache.block_size, 16);
  EXPECT_EQ(element_dtype(KvCacheDtype::fp8), dp::DType::F8_E4M3);
  EXPECT_EQ(element_dtype(KvCacheDtype::bf16), dp::DType::BF16);
  for (int bs : {16, 32, 48, 64, 128, 256, 1920, 65536})
    EXPECT_EQ(parse_deploy(minimal({{"kv_cache", {{"block_size", bs}}}}), kWhere).kv_cache.block_size, bs);
  EXPECT_EQ(deploy_error_of(minimal({{"kv_cache", {{"dtype", "fp16"}}}})),
            "deploy.json: kv_cache.dtype \"fp16\" is not supported (valid: bf16, fp8; the Kimi models are bf16)");
  EXPECT_MSG(minimal({{"kv_cache", {{"dtype", "auto"}}}}), "vLLM's \"auto\" means the model dtype: write bf16");
  EXPECT_MSG(minimal({{"kv_cache", {{"dtype", "fp8_ds_mla"}}}}), "DeepSeek sparse-MLA");
  EXPECT_EQ(deploy_error_of(minimal({{"kv_cache", {{"dtype", "int4"}}}})),
            "deploy.json: kv_cache.dtype \"int4\" is not supported (valid: bf16, fp8)");
  EXPECT_MSG(minimal({{"kv_cache", {{"block_size", 24}}}}), "kv_cache.block_size 24 is not a multiple of 16");
  EXPECT_MSG(minimal({{"kv_cache", {{"block_size", 0}}}}), "kv_cache.block_size 0 is out of range (valid: 16..65536)");
  EXPECT_MSG(minimal({{"kv_cache", {{"block_size", 8}}}}), "kv_cache.block_size 8 is out of range");
  EXPECT_MSG(minimal({{"kv_cache", {{"block_size", 65552}}}}), "kv_cache.block_size 65552 is out of range");
  EXPECT_MSG(minimal({{"kv_cache", "bf16"}}), "kv_cache is a string (\"bf16\"), expected an object");
}

TEST(Deploy, KdaAndConvState) {
  Deploy d = parse_deploy(
      minimal({{"kda_state", {{"dtype", "float32"}, {"layout", "vk"}}}, {"conv_state", {{"dtype", "float32"}, {"layout", "ds"}}}}),
      kWhere);
  EXPECT_EQ(d.kda_state.layout, KdaStateLayout::vk);
  EXPECT_EQ(d.conv_state.dtype, ConvStateDtype::float32);
  EXPECT_EQ(d.conv_state.layout, ConvStateLayout::ds);
  EXPECT_EQ(element_dtype(KdaStateDtype::float32), dp::DType::F32);
  EXPECT_EQ(element_dtype(ConvStateDtype::bf16), dp::DType::BF16);
  EXPECT_EQ(element_dtype(ConvStateDtype::float32), dp::DType::F32);
  EXPECT_MSG(minimal({{"kda_state", {{"dtype", "bf16"}}}}),
             "kda_state.dtype \"bf16\" is not supported (valid: float32; vLLM keeps the KDA recurrent state in float32");
  EXPECT_EQ(deploy_error_of(minimal({{"kda_state", {{"layout", "kk"}}}})),
            "deploy.json: kda_state.layout \"kk\" is not supported (valid: kv, vk)");
  EXPECT_MSG(minimal({{"conv_state", {{"dtype", "fp8"}}}}), "conv_state.dtype \"fp8\" is not supported (valid: bf16, float32)");
  EXPECT_MSG(minimal({{"conv_state", {{"layout", "SD"}}}}), "write it in lower case: sd");
  EXPECT_MSG(minimal({{"conv_state", {{"layout", 1}}}}), "conv_state.layout is an integer (1), expected a string");
}

TEST(Deploy, EnumNames) {
  EXPECT_STREQ(to_string(KvCacheDtype::bf16), "bf16");
  EXPECT_STREQ(to_string(KvCacheDtype::fp8), "fp8");
  EXPECT_STREQ(to_string(KdaStateDtype::float32), "float32");
  EXPECT_STREQ(to_string(KdaStateLayout::kv), "kv");
  EXPECT_STREQ(to_string(KdaStateLayout::vk), "vk");
  EXPECT_STREQ(to_string(ConvStateDtype::bf16), "bf16");
  EXPECT_STREQ(to_string(ConvStateDtype::float32), "float32");
  EXPECT_STREQ(to_string(ConvStateLayout::sd), "sd");
  EXPECT_STREQ(to_string(ConvStateLayout::ds), "ds");
}

// ---- DCP ---------------------------------------------------------------------------------------------

TEST(Deploy, Dcp) {
  Deploy d = parse_deploy(minimal({{"tensor_parallel", 8}, {"dcp", {{"size", 4}, {"interleave", 16}}}}), kWhere);
  EXPECT_EQ(d.dcp.size, 4);
  EXPECT_EQ(d.dcp.interleave, 16);
  EXPECT_EQ(deploy_error_of(minimal({{"tensor_parallel", 4}, {"dcp", {{"size", 8}}}})),
            "deploy.json: dcp.size 8 does not divide tensor_parallel 4 (valid: 1, 2, 4)");
  EXPECT_EQ(deploy_error_of(minimal({{"tensor_parallel", 4}, {"dcp", {{"size", 3}}}})),
            "deploy.json: dcp.size 3 does not divide tensor_parallel 4 (valid: 1, 2, 4)");
  EXPECT_MSG(minimal({{"dcp", {{"size", 0}}}}), "dcp.size 0 is out of range (valid: 1..8)");
  EXPECT_EQ(deploy_error_of(minimal({{"dcp", {{"interleave", 3}}}})),
            "deploy.json: dcp.interleave 3 does not divide kv_cache.block_size 64 (valid: 1, 2, 4, 8, 16, 32, 64)");
  EXPECT_MSG(minimal({{"kv_cache", {{"block_size", 48}}}, {"dcp", {{"interleave", 32}}}}),
             "dcp.interleave 32 does not divide kv_cache.block_size 48 (valid: 1, 2, 3, 4, 6, 8, 12, 16, 24, 48)");
  EXPECT_MSG(minimal({{"dcp", {{"interleave", 0}}}}), "dcp.interleave 0 is out of range");
}

// ---- Prefetch and indexer ----------------------------------------------------------------------------

TEST(Deploy, PrefetchCaps) {
  Deploy d = parse_deploy(minimal({{"max_num_seqs", 16}}), kWhere);
  for (int64_t w = 1; w <= 8; ++w) EXPECT_EQ(d.prefetch_cap(w), 24 << 20) << w;
  for (int64_t w = 9; w <= 16; ++w) EXPECT_EQ(d.prefetch_cap(w), 0) << w;  // above max_rows

  // Spec decode multiplies the rows: with q = 2, width 4 is 8 rows and width 5 is 10.
  d = parse_deploy(minimal({{"max_num_seqs", 16}, {"num_speculative_tokens", 1}}), kWhere);
  EXPECT_EQ(d.prefetch_cap(4), 24 << 20);
  EXPECT_EQ(d.prefetch_cap(5), 0);

  d = parse_deploy(minimal({{"max_num_seqs", 16},
                            {"prefetch", {{"cap_bytes", 1 << 20}, {"max_rows", 2}, {"width_cap_bytes", {{"1", 0}, {"16", 4096}}}}}}),
                   kWhere);
  EXPECT_EQ(d.prefetch_cap(1), 0);        // override turns it off
  EXPECT_EQ(d.prefetch_cap(2), 1 << 20);  // default cap, within max_rows
  EXPECT_EQ(d.prefetch_cap(3), 0);        // above max_rows
  EXPECT_EQ(d.prefetch_cap(16), 4096);    // override beyond max_rows
  EXPECT_EQ(d.prefetch.width_cap_bytes, (std::map<int64_t, int64_t>{{1, 0}, {16, 4096}}));

  d = parse_deploy(minimal({{"prefetch", {{"enabled", false}, {"width_cap_bytes", {{"1", 4096}}}}}}), kWhere);
  for (int64_t w : d.widths) EXPECT_EQ(d.prefetch_cap(w), 0);
}

TEST(Deploy, PrefetchPoints) {
  // Defaults from measurement: none at TP 1, the K3 module's three above.
  Deploy d = parse_deploy(minimal(Json::object()), kWhere);
  EXPECT_TRUE(d.prefetch.points.empty());
  EXPECT_FALSE(d.prefetch_point("next_attention"));
  d = parse_deploy(minimal({{"tensor_parallel", 2}}), kWhere);
  EXPECT_EQ(d.prefetch.points, (std::vector<std::string>{"oproj_down", "attention_moe", "next_attention"}));
  EXPECT_TRUE(d.prefetch_point("oproj_down"));
  EXPECT_FALSE(d.prefetch_point("attention_oproj"));
  // Listed points, kept in the format's order; enabled=false turns every point off.
  d = parse_deploy(minimal({{"prefetch", {{"points", {"attention_oproj", "next_attention"}}}}}), kWhere);
  EXPECT_EQ(d.prefetch.points, (std::vector<std::string>{"next_attention", "attention_oproj"}));
  EXPECT_TRUE(d.prefetch_point("attention_oproj"));
  d = parse_deploy(minimal({{"tensor_parallel", 2}, {"prefetch", {{"points", Json::array()}}}}), kWhere);
  EXPECT_TRUE(d.prefetch.points.empty());
  d = parse_deploy(minimal({{"prefetch", {{"enabled", false}, {"points", {"oproj_down"}}}}}), kWhere);
  EXPECT_FALSE(d.prefetch_point("oproj_down"));
  // The effective list is written into the bundle's deploy block.
  EXPECT_EQ(to_json(parse_deploy(minimal({{"tensor_parallel", 2}}), kWhere))["prefetch"]["points"],
            Json({"oproj_down", "attention_moe", "next_attention"}));

  EXPECT_MSG(minimal({{"prefetch", {{"points", {"next_atention"}}}}}),
             "prefetch.points[0] is \"next_atention\", expected one of oproj_down, attention_moe, next_attention, "
             "attention_oproj (did you mean next_attention?)");
  EXPECT_MSG(minimal({{"prefetch", {{"points", {"oproj_down", 3}}}}}), "prefetch.points[1] is \"3\", expected one of");
  EXPECT_MSG(minimal({{"prefetch", {{"points", {"oproj_down", "oproj_down"}}}}}),
             "prefetch.points[1]: \"oproj_down\" is listed twice");
  EXPECT_MSG(minimal({{"prefetch", {{"points", "oproj_down"}}}}),
             "prefetch.points is a string (\"oproj_down\"), expected an array of prefetch points");
}

TEST(Deploy, PrefetchErrors) {
  EXPECT_MSG(minimal({{"prefetch", {{"enabled", "yes"}}}}), "prefetch.enabled is a string (\"yes\"), expected true or false");
  EXPECT_MSG(minimal({{"prefetch", {{"cap_bytes", -1}}}}), "prefetch.cap_bytes -1 is out of range (valid: 0..1073741824)");
  EXPECT_MSG(minimal({{"prefetch", {{"cap_bytes", (int64_t{1} << 30) + 1}}}}), "prefetch.cap_bytes 1073741825 is out of range");
  EXPECT_MSG(minimal({{"prefetch", {{"max_rows", 513}}}}), "prefetch.max_rows 513 is out of range (valid: 0..512)");
  EXPECT_EQ(deploy_error_of(minimal({{"prefetch", {{"width_cap_bytes", {{"16", 0}}}}}})),
            "deploy.json: prefetch.width_cap_bytes.16 names width 16, which is not built (valid: 1..4)");
  EXPECT_MSG(minimal({{"max_num_seqs", nullptr}, {"widths", {1, 4}}, {"prefetch", {{"width_cap_bytes", {{"2", 0}}}}}}),
             "names width 2, which is not built (valid: 1, 4)");
  for (const char* bad : {"w4", "04", "0", "-1", "", "1.0", "1234567"})
    EXPECT_MSG(minimal({{"prefetch", {{"width_cap_bytes", {{bad, 0}}}}}}),
               fmt::format("prefetch.width_cap_bytes key \"{}\" is not a width", bad));
  EXPECT_MSG(minimal({{"prefetch", {{"width_cap_bytes", {{"1", -5}}}}}}),
             "prefetch.width_cap_bytes.1 -5 is out of range (valid: 0..1073741824)");
  EXPECT_MSG(minimal({{"prefetch", {{"width_cap_bytes", Json::array()}}}}),
             "prefetch.width_cap_bytes is an array ([]), expected an object mapping widths to byte caps");
}

TEST(Deploy, Indexer) {
  Deploy d = parse_deploy(minimal({{"indexer", {{"max_keys_per_chunk", 4096}, {"max_requests", 8}}}}), kWhere);
  EXPECT_EQ(d.indexer.max_keys_per_chunk, 4096);
  EXPECT_EQ(d.indexer.max_requests, 8);
  EXPECT_MSG(minimal({{"indexer", {{"max_keys_per_chunk", 0}}}}), "indexer.max_keys_per_chunk 0 is out of range (valid: 1..2147483584)");
  EXPECT_MSG(minimal({{"indexer", {{"max_requests", int64_t{1} << 31}}}}), "indexer.max_requests 2147483648 is out of range");
  // 2^31 - 64 is the most keys whose 64-key pages still number int32 keys.
  EXPECT_MSG(minimal({{"indexer", {{"max_keys_per_chunk", 2147483647}}}}),
             "indexer.max_keys_per_chunk 2147483647 is out of range (valid: 1..2147483584)");
  EXPECT_NO_THROW(parse_deploy(minimal({{"indexer", {{"max_keys_per_chunk", 2147483584}}}}), kWhere));
}

// Under DCP every rank stages world * (ceil(keys / world) + requests * interleave) rows, int32-indexed.
TEST(Deploy, IndexerUnderDcp) {
  auto with = [](int64_t keys, int64_t reqs, int64_t size, int64_t interleave) {
    return minimal({{"tensor_parallel", 8},
                    {"dcp", {{"size", size}, {"interleave", interleave}}},
                    {"indexer", {{"max_keys_per_chunk", keys}, {"max_requests", reqs}}}});
  };
  // ceil(2147483584 / 2) = 1073741792; 2 * (1073741792 + 1 * 1) = 2147483586 fits.
  EXPECT_NO_THROW(parse_deploy(with(2147483584, 1, 2, 1), kWhere));
  // 2 * (1073741792 + 32) = 2147483648 = 2^31: one past the limit.
  EXPECT_MSG(with(2147483584, 32, 2, 1),
             "deploy.json: indexer.max_keys_per_chunk 2147483584 and indexer.max_requests 32 with dcp.size 2 and "
             "dcp.interleave 1: each rank packs up to ceil(2147483584 / 2) + 32 x 1 = 1073741824 keys and stages all "
             "2 ranks' keys, 2147483648 rows, above 2147483647 (the prefill kernels index keys with int32); lower "
             "indexer.max_requests or indexer.max_keys_per_chunk");
  // 2 * (1073741792 + 31) = 2147483646 fits.
  EXPECT_NO_THROW(parse_deploy(with(2147483584, 31, 2, 1), kWhere));
  // The interleave counts once per request: 2 * (1073741792 + 8 * 4) = 2147483648 again.
  EXPECT_MSG(with(2147483584, 8, 2, 4), "2147483648 rows, above 2147483647");
  // At dcp.size 1 there is no all-gather: any max_requests is fine.
  EXPECT_NO_THROW(parse_deploy(minimal({{"indexer", {{"max_keys_per_chunk", 2147483584}, {"max_requests", 2147483647}}}}),
                               kWhere));
}

// ---- Unknown and null fields -------------------------------------------------------------------------

TEST(Deploy, UnknownFields) {
  EXPECT_EQ(deploy_error_of(minimal({{"tensor_paralel", 2}})),
            "deploy.json: unknown field tensor_paralel: did you mean tensor_parallel? (valid fields of the top level: "
            "allreduce, conv_state, dcp, indexer, kda_state, kv_cache, max_num_seqs, num_speculative_tokens, prefetch, ranks, "
            "targets, tensor_parallel, widths)");
  EXPECT_EQ(deploy_error_of(minimal({{"kv_cache", {{"blocksize", 64}}}})),
            "deploy.json: unknown field kv_cache.blocksize: did you mean kv_cache.block_size? (valid fields of "
            "kv_cache: block_size, dtype)");
  EXPECT_MSG(minimal({{"quantization", "fp8"}}), "unknown field quantization (valid fields of the top level: allreduce, conv_state");
  EXPECT_MSG(minimal({{"prefetch", {{"cap_mib", 64}}}}), "unknown field prefetch.cap_mib");
  EXPECT_MSG(minimal({{"indexer", {{"max_keys", 64}}}}), "unknown field indexer.max_keys");
  EXPECT_MSG(minimal({{"dcp", {{"size", 1}, {"interleave_size", 1}}}}), "unknown field dcp.interleave_size");
}

TEST(Deploy, NullIsNotDefault) {
  Json j = minimal();
  j["ranks"] = nullptr;
  EXPECT_EQ(deploy_error_of(j), "deploy.json: ranks is null; leave it out to get the default");
  j = minimal();
  j["kv_cache"] = {{"dtype", nullptr}};
  EXPECT_MSG(j, "kv_cache.dtype is null");
}

TEST(Deploy, TopLevelMustBeAnObject) {
  EXPECT_EQ(deploy_error_of(Json::array()), "deploy.json: the top level is an array ([]), expected an object");
  EXPECT_MSG(Json("x"), "the top level is a string");
}

// ---- Canonical form ----------------------------------------------------------------------------------

// Dotted paths of every object member in `j` ("kv_cache", "kv_cache.dtype"); maps keyed by data
// (width_cap_bytes) are leaves.
void collect_paths(const Json& j, const std::string& prefix, std::set<std::string>& out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    std::string p = prefix.empty() ? it.key() : prefix + "." + it.key();
    out.insert(p);
    if (it->is_object() && it.key() != "width_cap_bytes" && it.key() != "allreduce") collect_paths(*it, p, out);
  }
}

TEST(Deploy, CanonicalJsonHasEveryFieldAndRoundTrips) {
  Deploy d = parse_deploy(minimal({{"tensor_parallel", 2},
                                   {"num_speculative_tokens", 2},
                                   {"kv_cache", {{"dtype", "fp8"}, {"block_size", 128}}},
                                   {"prefetch", {{"width_cap_bytes", {{"2", 1024}, {"3", 0}}}}},
                                   {"allreduce", {{"3", "nccl"}}}}),  // recorded only when some width uses NCCL
                          kWhere);
  Json j = to_json(d);
  std::set<std::string> paths;
  collect_paths(j, "", paths);
  std::set<std::string> keys;
  for (const std::string& k : known_keys()) keys.insert(k);
  keys.erase("max_num_seqs");  // canonical form lists widths
  EXPECT_EQ(paths, keys);
  EXPECT_EQ(parse_deploy(j, "canonical"), d);
  EXPECT_EQ(to_json(parse_deploy(j, "canonical")), j);
}

TEST(Deploy, CanonicalJsonIsDeterministic) {
  // Same build, written four ways: key order, target order, max_num_seqs vs widths, defaults spelled out.
  std::vector<std::string> texts = {
      R"({"targets":["sm_90a","gfx942"],"tensor_parallel":1,"max_num_seqs":8,"num_speculative_tokens":0,
          "kv_cache":{"dtype":"bf16","block_size":64}})",
      R"({"kv_cache":{"block_size":64,"dtype":"bf16"},"max_num_seqs":8,"targets":["gfx942","sm_90a"]})",
      R"({"targets":["gfx942","sm_90a"],"widths":[8,7,6,5,4,3,2,1],"ranks":[0],"dcp":{"size":1,"interleave":1}})",
      R"({"targets":["sm_90a","gfx942"],"widths":[1,2,3,4,5,6,7,8],"prefetch":{"enabled":true,"cap_bytes":25165824,
          "max_rows":8,"width_cap_bytes":{}},"indexer":{"max_requests":1024},"kda_state":{"layout":"kv"},
          "conv_state":{"dtype":"bf16","layout":"sd"}})",
  };
  std::string first = dp::canonical_json(to_json(parse(texts[0])));
  for (const std::string& t : texts) EXPECT_EQ(dp::canonical_json(to_json(parse(t))), first) << t;
  EXPECT_EQ(dp::canonical_json(to_json(load_deploy("default"))), first);
  // The exact bytes the bundle manifest records for the README's default deploy.
  EXPECT_EQ(first,
            R"({"conv_state":{"dtype":"bf16","layout":"sd"},"dcp":{"interleave":1,"size":1},)"
            R"("indexer":{"max_keys_per_chunk":6553600,"max_requests":1024},"kda_state":{"dtype":"float32","layout":"kv"},)"
            R"("kv_cache":{"block_size":64,"dtype":"bf16"},"num_speculative_tokens":0,)"
            R"("prefetch":{"cap_bytes":25165824,"enabled":true,"max_rows":8,"points":[],"width_cap_bytes":{}},"ranks":[0],)"
            R"("targets":["gfx942","sm_90a"],"tensor_parallel":1,"widths":[1,2,3,4,5,6,7,8]})");
  // A different build gives a different canonical form.
  EXPECT_NE(dp::canonical_json(to_json(parse(R"({"targets":["gfx942","sm_90a"],"max_num_seqs":4})"))), first);
}

// ---- Schema ------------------------------------------------------------------------------------------

Json load_schema() {
  std::optional<std::string_view> text = dp::embedded_file("deploy.schema.json");
  EXPECT_TRUE(text.has_value());
  return dp::parse_json(text.value_or("{}"), "deploy.schema.json");
}

// Every property path the schema declares, with its schema.
void schema_paths(const Json& s, const std::string& prefix, std::map<std::string, Json>& out) {
  if (!s.contains("properties")) return;
  for (auto it = s["properties"].begin(); it != s["properties"].end(); ++it) {
    std::string p = prefix.empty() ? it.key() : prefix + "." + it.key();
    out[p] = *it;
    schema_paths(*it, p, out);
  }
}

Json* at_path(Json& j, const std::string& path) {
  Json* cur = &j;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string k = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    cur = &(*cur)[k];
    if (dot == std::string::npos) return cur;
    start = dot + 1;
  }
}

TEST(DeploySchema, IsDraft202012AndClosed) {
  Json s = load_schema();
  EXPECT_EQ(s.value("$schema", ""), "https://json-schema.org/draft/2020-12/schema");
  EXPECT_EQ(s.value("type", ""), "object");
  EXPECT_EQ(s["additionalProperties"], false);
  EXPECT_EQ(s["required"], Json({"targets"}));
  std::map<std::string, Json> paths;
  schema_paths(s, "", paths);
  for (const auto& [p, sub] : paths) {
    if (sub.value("type", "") == "object" && sub.contains("properties")) {
      EXPECT_EQ(sub["additionalProperties"], false) << p;
    }
  }
}

TEST(DeploySchema, PropertiesMatchTheReader) {
  std::map<std::string, Json> paths;
  schema_paths(load_schema(), "", paths);
  std::set<std::string> schema_keys, reader_keys;
  for (const auto& [p, sub] : paths) schema_keys.insert(p);
  for (const std::string& k : known_keys()) reader_keys.insert(k);
  EXPECT_EQ(schema_keys, reader_keys);
}

TEST(DeploySchema, DefaultsMatchTheReader) {
  std::map<std::string, Json> paths;
  schema_paths(load_schema(), "", paths);
  Json canonical = to_json(parse_deploy(minimal(), kWhere));
  int checked = 0;
  for (const auto& [p, sub] : paths) {
    if (!sub.contains("default") || sub["default"].is_object()) continue;  // {} means "all member defaults"
    EXPECT_EQ(sub["default"], *at_path(canonical, p)) << p;
    ++checked;
  }
  EXPECT_GE(checked, 15);
}

TEST(DeploySchema, TargetsEnumIsTheTargetTable) {
  Json s = load_schema();
  std::vector<std::string> names;
  for (const TargetInfo& t : known_targets()) names.emplace_back(t.name);
  EXPECT_EQ(s["properties"]["targets"]["items"]["enum"].get<std::vector<std::string>>(), names);
}

// Each enum value the schema allows is accepted, and a value outside it is refused.
TEST(DeploySchema, EnumsMatchTheReader) {
  std::map<std::string, Json> paths;
  schema_paths(load_schema(), "", paths);
  int checked = 0;
  for (const auto& [p, sub] : paths) {
    if (!sub.contains("enum")) continue;
    for (const Json& v : sub["enum"]) {
      Json j = minimal({{"tensor_parallel", 8}});
      *at_path(j, p) = v;
      EXPECT_NO_THROW(parse_deploy(j, kWhere)) << p << " = " << v.dump();
      ++checked;
    }
    Json j = minimal();
    *at_path(j, p) = sub["enum"][0].is_string() ? Json("not-a-value") : Json(3);
    EXPECT_THROW(parse_deploy(j, kWhere), dp::Error) << p;
  }
  EXPECT_GE(checked, 13);
}

// Every integer bound in the schema is the reader's bound: min and max are accepted, one past each is not.
TEST(DeploySchema, BoundsMatchTheReader) {
  std::map<std::string, Json> paths;
  schema_paths(load_schema(), "", paths);
  int checked = 0;
  for (auto [p, sub] : paths) {
    bool array = sub.value("type", "") == "array";
    bool map = p == "prefetch.width_cap_bytes";
    Json item = array ? sub["items"] : map ? sub["additionalProperties"] : sub;
    if (item.value("type", "") != "integer") continue;
    for (const char* bound : {"minimum", "maximum"}) {
      ASSERT_TRUE(item.contains(bound)) << p << " has no " << bound;
      int64_t b = item[bound].get<int64_t>();
      int64_t outside = std::string(bound) == "minimum" ? b - 1 : b + 1;
      auto make = [&](int64_t v) {
        // Wide enough that every bound is reachable: TP 8 for ranks and dcp.size, the largest block for
        // dcp.interleave, and width 1 built for the width map.
        Json j = minimal({{"tensor_parallel", 8}, {"kv_cache", {{"block_size", 65536}}}});
        Json val = array ? Json::array({v}) : map ? Json::object({{"1", v}}) : Json(v);
        if (p == "widths") j.erase("max_num_seqs");
        if (p == "kv_cache.block_size") j["kv_cache"].erase("block_size");
        *at_path(j, p) = val;
        return j;
      };
      EXPECT_NO_THROW(parse_deploy(make(b), kWhere)) << p << " " << bound << " " << b;
      EXPECT_THROW(parse_deploy(make(outside), kWhere), dp::Error) << p << " " << outside;
      ++checked;
    }
  }
  EXPECT_GE(checked, 2 * 11);
  // multipleOf
  Json s = load_schema();
  EXPECT_EQ(s["properties"]["kv_cache"]["properties"]["block_size"]["multipleOf"], 16);
}

// ---- Model checks ------------------------------------------------------------------------------------

dp::model::LayerSpec layer(int index, dp::model::Mixer mixer, dp::model::Ffn ffn) {
  dp::model::LayerSpec l;
  l.index = index;
  l.mixer = mixer;
  l.ffn = ffn;
  return l;
}

// Kimi-Linear-48B-A3B's shapes, with a few representative weights and a two-layer pattern.
dp::model::Model kimi_like() {
  using namespace dp::model;
  Model m;
  m.hidden = 2304;
  m.kda.num_heads = 32;
  m.kda.head_dim = 128;
  m.kda.conv_kernel = 4;
  m.kda.gate_rank = 128;
  m.mla.num_heads = 32;
  m.mla.kv_lora_rank = 512;
  m.mla.qk_nope_head_dim = 128;
  m.mla.qk_rope_head_dim = 64;
  m.mla.v_head_dim = 128;
  m.moe.num_experts = 256;
  m.moe.top_k = 8;
  m.moe.intermediate = 1024;
  m.moe.num_shared = 1;
  m.dense_intermediate = 9216;
  m.layers = {layer(0, Mixer::kda, Ffn::dense), layer(1, Mixer::mla, Ffn::moe)};
  auto add = [&](std::string name, std::vector<int64_t> shape, Split s) {
    WeightSpec w;
    w.name = std::move(name);
    w.shape = std::move(shape);
    w.split = s;
    m.weights.push_back(w);
  };
  add("model.layers.0.self_attn.q_proj.weight", {4096, 2304}, Split::along(0));
  add("model.layers.0.self_attn.o_proj.weight", {2304, 4096}, Split::along(1));
  add("model.layers.0.input_layernorm.weight", {2304}, Split::replicated());
  add("model.layers.1.mlp.gate.weight", {256, 2304}, Split::replicated());
  return m;
}

std::string model_error(const Deploy& d, const dp::model::Model& m) {
  try {
    check_against_model(d, m, kWhere);
  } catch (const dp::Error& e) {
    EXPECT_EQ(e.code(), Errc::input) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

Deploy with_tp(int64_t tp) { return parse_deploy(minimal({{"tensor_parallel", tp}}), kWhere); }

TEST(DeployModel, KimiShapesFitEveryTensorParallelSize) {
  dp::model::Model m = kimi_like();
  for (int tp : {1, 2, 4, 8}) EXPECT_NO_THROW(check_against_model(with_tp(tp), m, kWhere)) << tp;
  EXPECT_EQ(valid_tensor_parallel(m), (std::vector<int64_t>{1, 2, 4, 8}));
}

TEST(DeployModel, StyleGuideExample) {
  Deploy d = with_tp(1);
  d.tensor_parallel = 3;  // a hand-made Deploy: parse_deploy would refuse 3 itself
  EXPECT_EQ(model_error(d, kimi_like()),
            "deploy.json: tensor_parallel 3 does not divide kda num_heads 32 (valid: 1, 2, 4, 8, 16, 32)");
}

TEST(DeployModel, EachDividedQuantity) {
  struct Case {
    std::function<void(dp::model::Model&)> change;
    std::string message;
  };
  std::vector<Case> cases = {
      {[](auto& m) { m.kda.num_heads = 12; }, "tensor_parallel 8 does not divide kda num_heads 12 (valid: 1, 2, 4)"},
      {[](auto& m) { m.mla.num_heads = 20; }, "tensor_parallel 8 does not divide mla num_heads 20 (valid: 1, 2, 4)"},
      {[](auto& m) { m.moe.num_experts = 12; }, "tensor_parallel 8 does not divide moe num_experts 12 (valid: 1, 2, 4)"},
      {[](auto& m) { m.dense_intermediate = 9220; },
       "tensor_parallel 8 does not divide dense intermediate_size 9220 (valid: 1, 2, 4)"},
      {[](auto& m) { m.moe.intermediate = 1028; m.moe.num_shared = 0; },
       "tensor_parallel 8 does not divide moe_intermediate_size 1028 (valid: 1, 2, 4)"},
      {[](auto& m) { m.moe.intermediate = 1028; },
       "tensor_parallel 8 does not divide moe_intermediate_size 1028 (valid: 1, 2, 4)"},
      {[](auto& m) { m.weights[0].shape = {4100, 2304}; },
       "tensor_parallel 8 does not divide dim 0 (4100) of model.layers.0.self_attn.q_proj.weight [4100, 2304] "
       "(valid: 1, 2, 4)"},
      {[](auto& m) { m.weights[1].shape = {2304, 4098}; },
       "tensor_parallel 8 does not divide dim 1 (4098) of model.layers.0.self_attn.o_proj.weight [2304, 4098] "
       "(valid: 1, 2)"},
  };
  for (const Case& c : cases) {
    dp::model::Model m = kimi_like();
    c.change(m);
    EXPECT_EQ(model_error(with_tp(8), m), "deploy.json: " + c.message);
    EXPECT_NO_THROW(check_against_model(with_tp(1), m, kWhere));
  }
}

TEST(DeployModel, ReplicatedWeightsAreNotChecked) {
  dp::model::Model m = kimi_like();
  m.weights[2].shape = {2303};  // replicated norm with an odd size
  EXPECT_NO_THROW(check_against_model(with_tp(8), m, kWhere));
}

TEST(DeployModel, BadSplitDimIsAnInternalError) {
  dp::model::Model m = kimi_like();
  m.weights[2].split = dp::model::Split::along(1);  // a 1-D tensor has no dim 1
  try {
    check_against_model(with_tp(2), m, kWhere);
    ADD_FAILURE() << "no error";
  } catch (const dp::Error& e) {
    EXPECT_EQ(e.code(), Errc::internal);
    EXPECT_NE(std::string(e.what()).find("model.layers.0.input_layernorm.weight"), std::string::npos);
  }
}

TEST(DeployModel, UnusedMixersAndFfnsAreNotChecked) {
  dp::model::Model m = kimi_like();
  m.layers = {layer(0, dp::model::Mixer::kda, dp::model::Ffn::moe)};
  m.mla.num_heads = 3;          // no MLA layer
  m.dense_intermediate = 9999;  // no dense layer
  EXPECT_NO_THROW(check_against_model(with_tp(8), m, kWhere));
}

TEST(DeployModel, ModelsWithoutLayerListsUseTheConfig) {
  dp::model::Model m = kimi_like();
  m.layers.clear();
  m.mla.num_heads = 6;
  EXPECT_EQ(model_error(with_tp(4), m), "deploy.json: tensor_parallel 4 does not divide mla num_heads 6 (valid: 1, 2)");
  EXPECT_EQ(valid_tensor_parallel(m), (std::vector<int64_t>{1, 2}));
}

TEST(DeployModel, Dcp) {
  dp::model::Model m = kimi_like();
  Deploy d = parse_deploy(minimal({{"tensor_parallel", 4}, {"dcp", {{"size", 2}}}}), kWhere);
  EXPECT_NO_THROW(check_against_model(d, m, kWhere));
  Deploy bad = d;
  bad.dcp.size = 3;  // hand-made
  EXPECT_EQ(model_error(bad, m), "deploy.json: dcp.size 3 does not divide tensor_parallel 4 (valid: 1, 2, 4)");
  m.layers = {layer(0, dp::model::Mixer::kda, dp::model::Ffn::dense)};
  EXPECT_EQ(model_error(d, m), "deploy.json: dcp.size 2 needs MLA layers, and the model has none (valid: 1)");
}

TEST(DeployModel, MlaBlockSize) {
  Deploy d = with_tp(1);
  d.kv_cache.block_size = 40;  // hand-made
  EXPECT_NE(model_error(d, kimi_like()).find("kv_cache.block_size 40 is not a positive multiple of 16"), std::string::npos);
}

TEST(DeployModel, Presets) {
  // The real configs through the model reader: the 48B model takes every TP size; the tiny preset has
  // 2 KDA and 2 MLA heads, so only TP 1 and 2.
  dp::model::Model big = dp::model::load_model("kimi-linear-48b-a3b");
  EXPECT_EQ(valid_tensor_parallel(big), (std::vector<int64_t>{1, 2, 4, 8}));
  dp::model::Model tiny = dp::model::load_model("kimi-linear-tiny");
  EXPECT_EQ(valid_tensor_parallel(tiny), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(model_error(with_tp(4), tiny), "deploy.json: tensor_parallel 4 does not divide kda num_heads 2 (valid: 1, 2)");
}

// ---- Broken-input corpus -----------------------------------------------------------------------------

// tests/corpus/deploy/expected.txt: one line per file, "<file> | <fragment>" or
// "<file> model=<preset> | <fragment>" (the file parses; checking it against the preset fails).
TEST(DeployCorpus, EveryBrokenFileFailsWithItsMessage) {
  fs::path dir = fs::path(DP_TEST_DATA_DIR) / "corpus" / "deploy";
  std::ifstream in(dir / "expected.txt");
  ASSERT_TRUE(in) << "missing " << (dir / "expected.txt");
  std::set<std::string> listed;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    size_t bar = line.find(" | ");
    ASSERT_NE(bar, std::string::npos) << line;
    std::istringstream head(line.substr(0, bar));
    std::string file, model_arg;
    head >> file >> model_arg;
    std::string fragment = line.substr(bar + 3);
    EXPECT_TRUE(listed.insert(file).second) << file << " listed twice";
    std::string path = (dir / file).string();
    try {
      Deploy d = load_deploy(path);
      ASSERT_TRUE(model_arg.starts_with("model=")) << file << ": parsed without error";
      check_against_model(d, dp::model::load_model(model_arg.substr(6)), path);
      ADD_FAILURE() << file << ": no error";
    } catch (const dp::Error& e) {
      std::string msg = e.what();
      EXPECT_EQ(e.code(), Errc::input) << file << ": " << msg;
      EXPECT_NE(msg.find(fragment), std::string::npos) << file << "\n  message:  " << msg << "\n  expected: " << fragment;
      EXPECT_TRUE(msg.starts_with(path + ": ")) << file << ": message does not name the file: " << msg;
      // Values from the file are quoted through excerpt(): a 100 KB value appears cut, never whole.
      EXPECT_LT(msg.size(), 1500u) << file << ": " << msg.substr(0, 1500);
    }
    ++n;
  }
  // Every file in the corpus is listed, so none is silently skipped.
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".json") {
      EXPECT_TRUE(listed.count(e.path().filename().string())) << e.path();
    }
  }
  EXPECT_GE(n, 40);
}

}  // namespace
