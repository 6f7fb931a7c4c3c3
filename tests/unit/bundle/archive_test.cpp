// The .dpk archive: determinism, round trip, truncation and hostile archives.
#include "bundle/archive.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <clocale>
#include <cstring>
#include <fstream>
#include <random>

#include "../test_util.h"
#include "common/fs.h"

namespace fs = std::filesystem;
using dp::Errc;
using dp::test::expect_error;
using dp::test::TempDir;

namespace {

void put(const fs::path& p, std::string_view bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

std::string slurp(const fs::path& p) { return dp::read_text_file(p); }

std::string random_bytes(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(gen());
  return s;
}

// The contents used by most tests: nested directories, an empty file, a file larger than the 1 MiB
// streaming chunk, and names whose bytewise order differs from a locale's collation.
const std::vector<std::pair<std::string, std::string>>& sample_files() {
  static const std::vector<std::pair<std::string, std::string>> files = {
      {"manifest.json", R"({"format":"decodepack-bundle"})"},
      {"kernels/sm_90a/moe_w4_q1_e256_k8_h2304.cubin", random_bytes(3 * 1024 * 1024 + 17, 1)},
      {"kernels/sm_90a/empty.bin", ""},
      {"B", "upper case sorts before lower case"},
      {"a-b", "x"},
      {"a.b", "y"},
      {"a/z", "z"},
      {"\xc3\xa9t\xc3\xa9", "non-ASCII bytes sort last"},
  };
  return files;
}

void make_tree(const fs::path& dir, bool reverse) {
  auto files = sample_files();
  if (reverse) std::reverse(files.begin(), files.end());
  for (const auto& [name, bytes] : files) put(dir / name, bytes);
}

// A hand-made ustar header, so that tests can build archives the writer refuses to produce.
std::string ustar_header(const std::string& name, char type, uint64_t size, const std::string& link = "") {
  std::string h(512, '\0');
  std::memcpy(&h[0], name.data(), std::min<size_t>(name.size(), 100));
  std::snprintf(&h[100], 8, "%07o", 0644);
  std::snprintf(&h[108], 8, "%07o", 0);
  std::snprintf(&h[116], 8, "%07o", 0);
  std::snprintf(&h[124], 12, "%011llo", static_cast<unsigned long long>(size));
  std::snprintf(&h[136], 12, "%011o", 0);
  std::memset(&h[148], ' ', 8);
  h[156] = type;
  std::memcpy(&h[157], link.data(), std::min<size_t>(link.size(), 100));
  std::memcpy(&h[257], "ustar\0" "00", 8);
  unsigned sum = 0;
  for (unsigned char c : h) sum += c;
  std::snprintf(&h[148], 8, "%06o", sum);
  return h;
}

std::string member(const std::string& name, const std::string& data, char type = '0', const std::string& link = "") {
  std::string s = ustar_header(name, type, data.size(), link) + data;
  s.resize((s.size() + 511) / 512 * 512, '\0');
  return s;
}

std::string end_marker() { return std::string(1024, '\0'); }

// Field of a raw header block as a C string.
std::string field(const std::string& block, size_t off, size_t len) {
  return std::string(block.data() + off, strnlen(block.data() + off, len));
}

}  // namespace

TEST(Archive, SameContentsGiveSameBytes) {
  TempDir tmp;
  // Same contents, but created in opposite orders, with different permissions and modification times.
  make_tree(tmp / "one", false);
  make_tree(tmp / "two", true);
  fs::permissions(tmp / "two" / "B", fs::perms::owner_all | fs::perms::group_read);
  fs::permissions(tmp / "one" / "a-b", fs::perms::owner_read | fs::perms::owner_write);
  fs::last_write_time(tmp / "one" / "manifest.json", fs::file_time_type::clock::now() - std::chrono::hours(1000));
  fs::last_write_time(tmp / "two" / "a/z", fs::file_time_type::clock::now() + std::chrono::hours(5));

  // Different output paths (one deeper), umasks and locales.
  mode_t old_umask = ::umask(022);
  std::setlocale(LC_ALL, "C");
  dp::bundle::write_archive(tmp / "one", tmp / "out1.dpk");
  ::umask(077);
  if (!std::setlocale(LC_ALL, "C.UTF-8")) std::setlocale(LC_ALL, "POSIX");
  fs::create_directories(tmp / "elsewhere/deeper");
  dp::bundle::write_archive(tmp / "two", tmp / "elsewhere/deeper/other-name.dpk");
  ::umask(old_umask);
  std::setlocale(LC_ALL, "C");

  std::string a = slurp(tmp / "out1.dpk");
  std::string b = slurp(tmp / "elsewhere/deeper/other-name.dpk");
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(a == b) << "archives of identical contents differ";

  // Writing again over an existing archive gives the same bytes too.
  dp::bundle::write_archive(tmp / "two", tmp / "out1.dpk");
  EXPECT_TRUE(slurp(tmp / "out1.dpk") == a);
}

TEST(Archive, HeadersCarryNoHostData) {
  TempDir tmp;
  make_tree(tmp / "src", false);
  dp::bundle::write_archive(tmp / "src", tmp / "b.dpk");
  std::string bytes = slurp(tmp / "b.dpk");
  auto entries = dp::bundle::list_archive(tmp / "b.dpk");
  ASSERT_EQ(entries.size(), sample_files().size());
  for (const auto& e : entries) {
    std::string h = bytes.substr(e.offset - 512, 512);
    SCOPED_TRACE(e.path);
    EXPECT_EQ(field(h, 0, 100), e.path);             // relative, no "./"
    EXPECT_EQ(field(h, 100, 8), "000644 ");          // mode
    EXPECT_EQ(field(h, 108, 8), "000000 ");          // uid
    EXPECT_EQ(field(h, 116, 8), "000000 ");          // gid
    EXPECT_EQ(field(h, 136, 12), "00000000000 ");    // mtime
    EXPECT_EQ(h[156], '0');                          // regular file
    EXPECT_EQ(std::string(h.data() + 257, 8), std::string("ustar\0" "00", 8));
    EXPECT_EQ(field(h, 265, 32), "");                // uname
    EXPECT_EQ(field(h, 297, 32), "");                // gname
  }
  // Entries plus exactly the 1024-byte end-of-archive marker, no record padding.
  const auto& last = entries.back();
  EXPECT_EQ(bytes.size(), (last.offset + last.size + 511) / 512 * 512 + 1024);
}

TEST(Archive, EntriesAreSortedBytewise) {
  TempDir tmp;
  make_tree(tmp / "src", true);
  dp::bundle::write_archive(tmp / "src", tmp / "b.dpk");
  std::vector<std::string> names;
  for (const auto& e : dp::bundle::list_archive(tmp / "b.dpk")) names.push_back(e.path);
  std::vector<std::string> expected = {"B",
                                       "a-b",
                                       "a.b",
                                       "a/z",
                                       "kernels/sm_90a/empty.bin",
                                       "kernels/sm_90a/moe_w4_q1_e256_k8_h2304.cubin",
                                       "manifest.json",
                                       "\xc3\xa9t\xc3\xa9"};
  EXPECT_EQ(names, expected);
}

TEST(Archive, RoundTrip) {
  TempDir tmp;
  make_tree(tmp / "src", false);
  dp::bundle::write_archive(tmp / "src", tmp / "b.dpk");
  std::string bytes = slurp(tmp / "b.dpk");

  // Offsets point at each member's data in the file.
  std::map<std::string, std::string> want(sample_files().begin(), sample_files().end());
  for (const auto& e : dp::bundle::list_archive(tmp / "b.dpk")) {
    ASSERT_TRUE(want.count(e.path)) << e.path;
    EXPECT_EQ(e.size, want[e.path].size()) << e.path;
    EXPECT_TRUE(bytes.compare(e.offset, e.size, want[e.path]) == 0) << e.path;
  }

  EXPECT_EQ(dp::bundle::read_archive_member(tmp / "b.dpk", "manifest.json"), want["manifest.json"]);
  EXPECT_EQ(dp::bundle::read_archive_member(tmp / "b.dpk", "kernels/sm_90a/empty.bin"), "");

  dp::bundle::extract_archive(tmp / "b.dpk", tmp / "out");
  size_t files = 0;
  for (const auto& de : fs::recursive_directory_iterator(tmp / "out")) {
    if (!de.is_regular_file()) continue;
    ++files;
    std::string rel = de.path().lexically_relative(tmp / "out").generic_string();
    ASSERT_TRUE(want.count(rel)) << rel;
    EXPECT_TRUE(slurp(de.path()) == want[rel]) << rel;
  }
  EXPECT_EQ(files, want.size());

  // Archiving the extracted tree reproduces the archive.
  dp::bundle::write_archive(tmp / "out", tmp / "again.dpk");
  EXPECT_TRUE(slurp(tmp / "again.dpk") == bytes);
}

TEST(Archive, EmptyDirectoryGivesEmptyArchive) {
  TempDir tmp;
  fs::create_directories(tmp / "src/only/dirs");
  dp::bundle::write_archive(tmp / "src", tmp / "e.dpk");
  EXPECT_EQ(fs::file_size(tmp / "e.dpk"), 1024u);
  EXPECT_TRUE(dp::bundle::list_archive(tmp / "e.dpk").empty());
}

TEST(Archive, LongPaths) {
  TempDir tmp;
  // 150 bytes: fits only as prefix '/' name.
  std::string ok = std::string(60, 'p') + "/" + std::string(89, 'n');
  put(tmp / "src" / ok, "long");
  dp::bundle::write_archive(tmp / "src", tmp / "l.dpk");
  EXPECT_EQ(dp::bundle::read_archive_member(tmp / "l.dpk", ok), "long");
  dp::bundle::extract_archive(tmp / "l.dpk", tmp / "x");
  EXPECT_EQ(slurp(tmp / "x" / ok), "long");

  // A 120-byte final component cannot be stored by ustar at all.
  std::string bad = "dir/" + std::string(120, 'n');
  put(tmp / "src2" / bad, "x");
  expect_error([&] { dp::bundle::write_archive(tmp / "src2", tmp / "bad.dpk"); }, Errc::input,
               {bad, "124 bytes", "ustar"});
  EXPECT_FALSE(fs::exists(tmp / "bad.dpk"));
}

TEST(Archive, WriterRefusesLinksAndSelfInclusion) {
  TempDir tmp;
  put(tmp / "src/real", "r");
  fs::create_symlink("real", tmp / "src/link");
  expect_error([&] { dp::bundle::write_archive(tmp / "src", tmp / "s.dpk"); }, Errc::input,
               {"link", "symbolic link"});

  put(tmp / "src2/f", "f");
  expect_error([&] { dp::bundle::write_archive(tmp / "src2", tmp / "src2/inner.dpk"); }, Errc::usage,
               {"inside the directory"});
  expect_error([&] { dp::bundle::write_archive(tmp / "missing", tmp / "m.dpk"); }, Errc::io, {"missing"});
  // Nothing was left behind in the destination directory.
  for (const auto& de : fs::directory_iterator(tmp.path()))
    EXPECT_EQ(de.path().filename().string().find(".tmp-"), std::string::npos) << de.path();
}

TEST(Archive, TruncationIsDetectedAtEveryOffset) {
  TempDir tmp;
  put(tmp / "src/a.txt", std::string(700, 'a'));  // data spills into a second block
  put(tmp / "src/b.bin", random_bytes(5000, 2));
  put(tmp / "src/c.json", "{}");
  dp::bundle::write_archive(tmp / "src", tmp / "full.dpk");
  std::string full = slurp(tmp / "full.dpk");
  // Layout: a.txt header 0, data 512..1212 (padded to 1536); b.bin header 1536, data 2048..7048
  // (padded to 7168); c.json header 7168, data 7680; end marker 8192..9216.
  ASSERT_EQ(full.size(), 9216u);

  // Every 256 bytes, plus cuts one byte either side of block boundaries.
  std::vector<size_t> cuts = {1, 511, 513, 1535, 2047, 7047, 7169, 8191, 8193, 9215};
  for (size_t cut = 0; cut < full.size(); cut += 256) cuts.push_back(cut);
  for (size_t cut : cuts) {
    SCOPED_TRACE("cut at " + std::to_string(cut));
    fs::path p = tmp / ("cut-" + std::to_string(cut) + ".dpk");
    put(p, std::string_view(full).substr(0, cut));
    expect_error([&] { dp::bundle::list_archive(p); }, Errc::verify, {p.string(), "truncated archive"});
    expect_error([&] { dp::bundle::read_archive_member(p, "a.txt"); }, Errc::verify, {"truncated archive"});
    expect_error([&] { dp::bundle::extract_archive(p, tmp / "x"); }, Errc::verify, {"truncated archive"});
    EXPECT_FALSE(fs::exists(tmp / "x"));
  }

  // Messages name the entry and what is missing.
  put(tmp / "mid.dpk", std::string_view(full).substr(0, 4000));
  expect_error([&] { dp::bundle::list_archive(tmp / "mid.dpk"); }, Errc::verify,
               {"entry b.bin needs 5120 bytes", "at byte 2048, 1952 present"});
  put(tmp / "end.dpk", std::string_view(full).substr(0, 8192));
  expect_error([&] { dp::bundle::list_archive(tmp / "end.dpk"); }, Errc::verify,
               {"end-of-archive marker after entry c.json", "0 present"});
}

TEST(Archive, ZeroPaddingIsAcceptedGarbageIsNot) {
  TempDir tmp;
  put(tmp / "src/f", "data");
  dp::bundle::write_archive(tmp / "src", tmp / "a.dpk");
  std::string bytes = slurp(tmp / "a.dpk");
  // Other tar writers pad to 10240-byte records.
  put(tmp / "padded.dpk", bytes + std::string(10240 - bytes.size(), '\0'));
  EXPECT_EQ(dp::bundle::list_archive(tmp / "padded.dpk").size(), 1u);
  put(tmp / "garbage.dpk", bytes + "trailing");
  expect_error([&] { dp::bundle::list_archive(tmp / "garbage.dpk"); }, Errc::verify,
               {"garbage.dpk", "after the end-of-archive marker"});
}

TEST(Archive, HostileArchivesAreRefused) {
  TempDir tmp;
  struct Case {
    std::string name;
    std::string bytes;
    std::vector<std::string> fragments;
  };
  std::vector<Case> cases = {
      {"dotdot", member("../evil", "x") + end_marker(), {"../evil", "'..'"}},
      {"inner-dotdot", member("a/../../evil", "x") + end_marker(), {"a/../../evil", "'..'"}},
      {"absolute", member("/etc/evil", "x") + end_marker(), {"/etc/evil", "absolute path"}},
      {"dot", member("./a", "x") + end_marker(), {"./a", "'.'"}},
      {"empty-component", member("a//b", "x") + end_marker(), {"a//b", "empty path component"}},
      // One walk (format/ustar.h) for both readers: the compiler's used to accept a backslash, which the spec
      // forbids, and the runtime's a directory entry named twice.
      {"backslash", member("a\\b", "x") + end_marker(), {"a\\b", "backslash"}},
      {"directory-twice", member("d/", "", '5') + member("d/", "", '5') + end_marker(), {"entry d", "duplicate"}},
      {"symlink", member("a", "x") + member("l", "", '2', "/etc/passwd") + end_marker(), {"entry l", "symbolic link"}},
      {"hardlink", member("a", "x") + member("h", "", '1', "a") + end_marker(), {"entry h", "hard link"}},
      {"chardev", member("dev", "", '3') + end_marker(), {"entry dev", "device"}},
      {"fifo", member("fifo", "", '6') + end_marker(), {"entry fifo", "device, fifo"}},
      {"duplicate", member("m.json", "1") + member("m.json", "2") + end_marker(), {"entry m.json", "duplicate"}},
      {"file-as-parent", member("a", "1") + member("a/b", "2") + end_marker(), {"entry a/b", "parent a is a file"}},
      {"pax", member("pax", "20 path=renamed.txt\n", 'x') + member("f", "x") + end_marker(), {"ustar", "extended"}},
      {"bad-checksum", [] {
         std::string s = member("f", "x") + end_marker();
         s[0] = 'g';  // the checksum no longer matches
         return s;
       }(), {"not a tar archive"}},
      {"not-tar", random_bytes(4096, 3), {"not a"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    fs::path p = tmp / (c.name + ".dpk");
    put(p, c.bytes);
    try {
      dp::bundle::extract_archive(p, tmp / "out");
      ADD_FAILURE() << "extraction succeeded";
    } catch (const dp::Error& e) {
      EXPECT_EQ(e.code(), Errc::verify) << e.what();
      std::string msg = e.what();
      EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
      for (const auto& f : c.fragments) EXPECT_NE(msg.find(f), std::string::npos) << "lacks \"" << f << "\": " << msg;
    }
    EXPECT_THROW(dp::bundle::list_archive(p), dp::Error);
    // Nothing was created, inside or outside the target.
    EXPECT_FALSE(fs::exists(tmp / "out"));
    EXPECT_FALSE(fs::exists(tmp / "evil"));
    EXPECT_FALSE(fs::exists(tmp.path().parent_path() / "evil"));
  }

  // Directory entries are allowed, including one that names a directory already implied by a file.
  fs::path ok = tmp / "dirs.dpk";
  put(ok, member("d/", "", '5') + member("d/f", "1") + member("e/f", "2") + member("e/", "", '5') + end_marker());
  dp::bundle::extract_archive(ok, tmp / "dirs");
  EXPECT_EQ(slurp(tmp / "dirs/d/f"), "1");
  EXPECT_EQ(dp::bundle::list_archive(ok).size(), 2u);
  put(tmp / "dupdir.dpk", member("d/", "", '5') + member("d/", "", '5') + end_marker());
  expect_error([&] { dp::bundle::list_archive(tmp / "dupdir.dpk"); }, Errc::verify, {"duplicate"});
}

TEST(Archive, ExtractNeedsAnEmptyTarget) {
  TempDir tmp;
  put(tmp / "src/f", "new");
  dp::bundle::write_archive(tmp / "src", tmp / "a.dpk");
  put(tmp / "busy/keep", "old");
  expect_error([&] { dp::bundle::extract_archive(tmp / "a.dpk", tmp / "busy"); }, Errc::io,
               {"busy", "not an empty directory"});
  EXPECT_EQ(slurp(tmp / "busy/keep"), "old");
  fs::create_directories(tmp / "empty");
  dp::bundle::extract_archive(tmp / "a.dpk", tmp / "empty");
  EXPECT_EQ(slurp(tmp / "empty/f"), "new");
}

TEST(Archive, MissingMemberAndMissingFile) {
  TempDir tmp;
  put(tmp / "src/f", "x");
  dp::bundle::write_archive(tmp / "src", tmp / "a.dpk");
  expect_error([&] { dp::bundle::read_archive_member(tmp / "a.dpk", "manifest.json"); }, Errc::verify,
               {"a.dpk", "no member manifest.json"});
  expect_error([&] { dp::bundle::list_archive(tmp / "nope.dpk"); }, Errc::io, {"nope.dpk", "cannot open"});
}

TEST(Archive, DamagedHeaderIsNamed) {
  TempDir tmp;
  put(tmp / "src/a.txt", std::string(700, 'a'));
  put(tmp / "src/b.bin", "bbbb");
  dp::bundle::write_archive(tmp / "src", tmp / "a.dpk");
  std::string bytes = slurp(tmp / "a.dpk");
  bytes[1536 + 1] ^= 0x01;  // a byte of b.bin's name: its header checksum no longer matches
  put(tmp / "damaged.dpk", bytes);
  expect_error([&] { dp::bundle::list_archive(tmp / "damaged.dpk"); }, Errc::verify,
               {"damaged.dpk", "corrupt archive", "after entry a.txt", "at byte 1536"});
}
