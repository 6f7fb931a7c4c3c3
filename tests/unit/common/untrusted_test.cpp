// format/untrusted.h: message excerpts, the bounded JSON parser and regular-file reading that every
// reader of untrusted input goes through (issue 12).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "format/untrusted.h"

namespace dp::format {
namespace {

namespace fs = std::filesystem;

std::string nest(int n) { return std::string(static_cast<size_t>(n), '[') + std::string(static_cast<size_t>(n), ']'); }

// Runs parse_json_text and returns the error, expecting one of `kind`.
JsonTextError refused(std::string_view text, JsonTextError::Kind kind, JsonLimits limits = {}) {
  try {
    parse_json_text(text, limits);
  } catch (const JsonTextError& e) {
    EXPECT_EQ(static_cast<int>(e.kind), static_cast<int>(kind)) << e.what();
    return e;
  }
  ADD_FAILURE() << "accepted: " << text.substr(0, 80);
  return JsonTextError(kind, 0, "");
}

TEST(Excerpt, KeepsShortTextAndCutsLongTextWithItsLength) {
  EXPECT_EQ(excerpt("sm_90a"), "sm_90a");
  EXPECT_EQ(excerpt("a\nb\x7f"), "a\\x0ab\\x7f");
  EXPECT_EQ(excerpt("\xc3\xa9t\xc3"), "\xc3\xa9t\\xc3");  // é kept, a cut-off sequence escaped
  const std::string cut = excerpt(std::string(100000, 'x'));
  EXPECT_EQ(cut, std::string(kExcerptMax, 'x') + "... (100000 bytes)");
  EXPECT_EQ(json_excerpt(Json(std::string(100000, 'y'))), "\"" + std::string(kExcerptMax, 'y') + "... (100000 bytes)");
  EXPECT_EQ(json_excerpt(Json::parse(R"({"a":[1,2]})")), R"({"a":[1,2]})");
}

TEST(ParseJsonText, NestingUpToTheLimitIsAcceptedOneMoreIsRefused) {
  EXPECT_NO_THROW(parse_json_text(nest(kMaxJsonDepth), {}));
  const JsonTextError e = refused(nest(kMaxJsonDepth + 1), JsonTextError::Kind::too_deep);
  EXPECT_EQ(e.offset, static_cast<uint64_t>(kMaxJsonDepth));
  EXPECT_NE(std::string(e.what()).find("nested deeper than 64 levels at byte 64"), std::string::npos) << e.what();
  // The reproducer of issue 12 is refused before anything recurses over it.
  refused(nest(1000000), JsonTextError::Kind::too_deep);
  refused("{\"a\":" + nest(100000) + "}", JsonTextError::Kind::too_deep);
}

TEST(ParseJsonText, BracketsInStringsDoNotCount) {
  const std::string deep_text = "\"" + nest(1000) + "\\\"[[[\"";  // one string, with an escaped quote
  EXPECT_EQ(parse_json_text("[" + deep_text + "]", {}).at(0).get<std::string>().size(), 2004u);
  EXPECT_NO_THROW(parse_json_text(R"({"k[{": "]}\\", "v": [[["x"]]]})", {}));
}

TEST(ParseJsonText, RepeatedKeysAreRefusedWithTheirPath) {
  JsonTextError e = refused(R"({"a": 1, "b": {"c": [{"d": 1, "d": 2}]}})", JsonTextError::Kind::duplicate_key);
  EXPECT_EQ(e.key, "b.c.[].d");
  EXPECT_EQ(e.key_depth, 4u);
  EXPECT_NE(std::string(e.what()).find("key b.c.[].d appears more than once"), std::string::npos) << e.what();
  e = refused(R"({"hidden_size": 1, "hidden_size": 2})", JsonTextError::Kind::duplicate_key);
  EXPECT_EQ(e.key_depth, 1u);
  // Equal keys in different objects are fine.
  EXPECT_NO_THROW(parse_json_text(R"({"a": {"x": 1}, "b": {"x": 2}, "c": [{"x": 1}, {"x": 2}]})", {}));
}

TEST(ParseJsonText, SizeAndSyntax) {
  const JsonTextError big = refused(std::string(101, ' ') + "1", JsonTextError::Kind::too_large, JsonLimits{100});
  EXPECT_STREQ(big.what(), "102 bytes, expected at most 100");
  EXPECT_NO_THROW(parse_json_text(std::string(99, ' ') + "1", JsonLimits{100}));
  const JsonTextError bad = refused(R"({"a": )", JsonTextError::Kind::syntax);
  EXPECT_NE(std::string(bad.what()).find("invalid JSON at byte"), std::string::npos) << bad.what();
  refused("1e999", JsonTextError::Kind::syntax);
  // An unterminated 1 MB string is quoted by nlohmann's message; it arrives excerpted.
  const JsonTextError open = refused("\"" + std::string(1 << 20, 'z'), JsonTextError::Kind::syntax);
  EXPECT_LT(std::string(open.what()).size(), 1000u);
}

class UntrustedFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dp-untrusted-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(UntrustedFiles, ReadsARegularFileWithinItsLimit) {
  std::ofstream(dir_ / "a.json") << "{\"a\": 1}";
  std::string out;
  bool too_large = true;
  EXPECT_EQ(read_regular_file(dir_ / "a.json", 8, out, &too_large), "");
  EXPECT_EQ(out, "{\"a\": 1}");
  EXPECT_FALSE(too_large);
  EXPECT_EQ(read_regular_file(dir_ / "a.json", UINT64_MAX, out), "");  // no limit
  EXPECT_EQ(out, "{\"a\": 1}");
  EXPECT_EQ(read_regular_file(dir_ / "a.json", 7, out, &too_large), "8 bytes, expected at most 7");
  EXPECT_TRUE(too_large);
}

TEST_F(UntrustedFiles, RefusesWhatIsNotARegularFileWithoutBlocking) {
  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0644), 0);
  std::string out;
  EXPECT_EQ(read_regular_file(dir_ / "fifo", 100, out), "is a FIFO (named pipe), expected a regular file");
  EXPECT_EQ(read_regular_file(dir_, 100, out), "is a directory, expected a regular file");
  EXPECT_EQ(read_regular_file(dir_ / "none", 100, out), "cannot open: No such file or directory");
  uint64_t size = 0;
  std::string why;
  EXPECT_EQ(open_regular_file(dir_ / "fifo", &size, &why), -1);
  EXPECT_EQ(why, "is a FIFO (named pipe), expected a regular file");
}

}  // namespace
}  // namespace dp::format
