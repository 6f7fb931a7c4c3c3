// The in-kernel all-reduce as the runtime sees it (src/allreduce.cpp, compiled into this binary): the
// exchange buffer's size agrees with templates/allreduce.h's layout, and a gave-up wait recorded in the
// error flag word is reported with its layer, op and peer.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "decodepack/decodepack.h"
#include "src/allreduce.h"

namespace dp::rt {
namespace {

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(Allreduce, ExchangeLayoutMatchesTheDeviceHeader) {
  const std::string h = read(std::string(DP_TEST_DATA_DIR) + "/../templates/allreduce.h");
  ASSERT_FALSE(h.empty());
  for (const char* line : {"#define DP_AR_MAX_RANKS 8\n", "#define DP_AR_MAX_BLOCKS 64\n", "#define DP_AR_LINE 128\n",
                           "#define DP_AR_FLAGS_OFFSET 512\n",
                           "#define DP_AR_DATA_OFFSET (DP_AR_FLAGS_OFFSET + 2 * DP_AR_MAX_RANKS * DP_AR_MAX_BLOCKS * "
                           "DP_AR_LINE)\n",
                           "#define DP_AR_FLAG_WAIT_TIMEOUT 0x1u", "#define DP_AR_FLAG_PEER_ABORT 0x2u"})
    EXPECT_NE(h.find(line), std::string::npos) << line;
  EXPECT_EQ(kAllreduceDataOffset, 512u + 2 * 8 * 64 * 128);
  static_assert(DP_FLAG_WAIT_TIMEOUT == 0x1u && DP_FLAG_PEER_ABORT == 0x2u);
  // Two halves x ranks x rows x hidden bf16 after the header: 48B-shaped TP 2 at 8 rows.
  EXPECT_EQ(allreduce_exchange_bytes(2, 8, 2304), 131584u + 2 * 2 * 8 * 2304 * 2);
  EXPECT_EQ(allreduce_exchange_bytes(8, 32, 7168), 131584u + 2ull * 8 * 32 * 7168 * 2);
}

// The device's record (templates/allreduce.h dp_ar_record): bit | (op + 1) << 2 | (peer + 1) << 8 | (layer + 1) << 16.
uint32_t record(uint32_t bit, uint32_t op, uint32_t peer, uint32_t layer) {
  return bit | ((op + 1) << 2) | ((peer + 1) << 8) | ((layer + 1) << 16);
}

TEST(Allreduce, FlagFieldsDecode) {
  const uint32_t v = record(DP_FLAG_WAIT_TIMEOUT, 1, 3, 26);
  EXPECT_EQ(DP_FLAG_OP(v), 2u);
  EXPECT_EQ(DP_FLAG_PEER(v), 4u);
  EXPECT_EQ(DP_FLAG_LAYER(v), 27u);
}

TEST(Allreduce, GaveUpWaitsAreReportedWithLayerOpAndPeer) {
  EXPECT_EQ(describe_error_flag(record(DP_FLAG_WAIT_TIMEOUT, 1, 1, 3)),
            "error flag 0x00040209: a bounded wait of this rank gave up waiting for rank 1 (first in layer 3, after the "
            "FFN)");
  EXPECT_EQ(describe_error_flag(record(DP_FLAG_PEER_ABORT, 0, 0, 0)),
            "error flag 0x00010106: rank 0 announced that it gave up a wait (first in layer 0, after the o-projection)");
  // A later peer abort only adds its bit to the first record.
  EXPECT_EQ(describe_error_flag(record(DP_FLAG_WAIT_TIMEOUT, 0, 2, 5) | DP_FLAG_PEER_ABORT),
            "error flag 0x00060307: a bounded wait of this rank gave up waiting for rank 2; a peer rank announced that it "
            "gave up (first in layer 5, after the o-projection)");
  // The host's own bits (dp_session_raise_error_flag) carry no fields.
  EXPECT_EQ(describe_error_flag(DP_FLAG_WAIT_TIMEOUT), "error flag 0x00000001: a kernel of this rank gave up a bounded wait");
  EXPECT_EQ(describe_error_flag(0x80u), "error flag 0x00000080: unknown cause");
}

}  // namespace
}  // namespace dp::rt
