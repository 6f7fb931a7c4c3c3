// The runtime's bundle reader (runtime/format/bundle_reader.h) on real bundles and on one damaged copy
// per failure mode of bundle-format.md §1.2 and §5, each with its expected message.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstring>
#include <functional>

#include "format/bundle_reader.h"
#include "runtime_test_util.h"

namespace dp::rttest {
namespace {

using format::BundleReader;
using format::FormatError;

const Bundles& bundles() {
  static const Bundles b = ensure_bundles();
  return b;
}

// One ustar header (bundle-format.md §1.1 field layout) for hand-made hostile archives.
std::string tar_header(const std::string& name, size_t size, char type = '0', const std::string& link = "",
                       bool gnu = false) {
  std::string h(512, '\0');
  auto field = [&](size_t at, size_t len, const std::string& v) { std::memcpy(&h[at], v.data(), std::min(len, v.size())); };
  auto octal = [&](size_t at, size_t len, uint64_t v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%0*llo", static_cast<int>(len - 1), static_cast<unsigned long long>(v));
    field(at, len - 1, buf);
  };
  field(0, 100, name);
  octal(100, 8, 0644);
  octal(108, 8, 0);
  octal(116, 8, 0);
  octal(124, 12, size);
  octal(136, 12, 0);
  h[156] = type;
  field(157, 100, link);
  if (gnu) field(257, 8, std::string("ustar  \0", 8));
  else field(257, 8, std::string("ustar\0" "00", 8));
  std::memset(&h[148], ' ', 8);
  unsigned sum = 0;
  for (unsigned char c : h) sum += c;
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%06o", sum);
  std::memcpy(&h[148], buf, 6);
  h[154] = '\0';
  h[155] = ' ';
  return h;
}

std::string tar_member(const std::string& name, const std::string& data, char type = '0', const std::string& link = "",
                       bool gnu = false) {
  std::string m = tar_header(name, type == '0' ? data.size() : 0, type, link, gnu);
  if (type == '0') m += data + std::string((512 - data.size() % 512) % 512, '\0');
  return m;
}

const std::string kEnd(1024, '\0');

class BundleReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!bundles().error.empty()) GTEST_FAIL() << bundles().error;
    dir_ = fs::temp_directory_path() / ("dp-rt-reader-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A copy of the tiny bundle's archive bytes, to damage.
  std::string archive() const { return read_text(bundles().tiny); }
  fs::path write(const std::string& name, const std::string& bytes) const {
    write_text(dir_ / name, bytes);
    return dir_ / name;
  }
  fs::path copy_dir() const {
    fs::copy(bundles().tiny_dir, dir_ / "b", fs::copy_options::recursive);
    return dir_ / "b";
  }

  fs::path dir_;
};

// Runs f, expects a FormatError of `kind` whose message holds every fragment.
void expect_format_error(const std::function<void()>& f, FormatError::Kind kind,
                         std::initializer_list<std::string> fragments, bool io = false) {
  try {
    f();
    ADD_FAILURE() << "expected a FormatError";
  } catch (const format::BundleIoError& e) {
    EXPECT_TRUE(io) << "unexpected I/O error: " << e.what();
    for (const auto& s : fragments) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
  } catch (const FormatError& e) {
    EXPECT_FALSE(io) << "expected an I/O error: " << e.what();
    EXPECT_EQ(static_cast<int>(e.kind), static_cast<int>(kind)) << e.what();
    for (const auto& s : fragments) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << "lacks \"" << s << "\": " << e.what();
  }
}

TEST_F(BundleReaderTest, OpensArchiveAndDirectoryWithTheSameDigest) {
  BundleReader a = BundleReader::open(bundles().tiny);
  BundleReader d = BundleReader::open(bundles().tiny_dir);
  a.verify();
  d.verify();
  EXPECT_TRUE(a.is_archive());
  EXPECT_FALSE(d.is_archive());
  EXPECT_EQ(a.digest(), d.digest());
  EXPECT_EQ(a.digest().substr(0, 7), "sha256:");
  EXPECT_EQ(a.digest().size(), 7u + 64u);
  EXPECT_EQ(a.digest(), "sha256:" + format::sha256_hex({reinterpret_cast<const uint8_t*>(a.manifest_bytes().data()),
                                                        a.manifest_bytes().size()}));
  EXPECT_EQ(a.files(), d.files());
  EXPECT_EQ(a.files().size(), a.manifest().files.size());
  const auto& k = a.manifest().kernels.front();
  EXPECT_EQ(format::sha256_hex(a.file(k.file)), k.sha256);
}

TEST_F(BundleReaderTest, DigestMatchesTheCli) {
  // `decodepack inspect --json` prints the digest the compiler computes; the runtime must agree.
  const fs::path log = dir_ / "inspect.json";
  ASSERT_EQ(run_cli({"inspect", bundles().tiny.string(), "--json"}, log), 0) << read_text(log);
  EXPECT_NE(read_text(log).find(BundleReader::open(bundles().tiny).digest()), std::string::npos);
}

TEST_F(BundleReaderTest, MissingPathIsAnIoError) {
  expect_format_error([&] { BundleReader::open(dir_ / "nope.dpk"); }, FormatError::Kind::integrity,
                      {"nope.dpk", "no such bundle"}, true);
}

TEST_F(BundleReaderTest, EmptyDirectoryIsNotABundle) {
  fs::create_directories(dir_ / "empty");
  expect_format_error([&] { BundleReader::open(dir_ / "empty"); }, FormatError::Kind::schema,
                      {"not a bundle: no manifest.json"});
}

TEST_F(BundleReaderTest, ShortFileIsTruncated) {
  const fs::path p = write("short.dpk", archive().substr(0, 100));
  expect_format_error([&] { BundleReader::open(p); }, FormatError::Kind::integrity,
                      {"short.dpk", "truncated archive", "first header needs 512 bytes, 100 present"});
}

TEST_F(BundleReaderTest, CutInsideAMemberIsTruncated) {
  const std::string a = archive();
  const fs::path p = write("cut.dpk", a.substr(0, 512 + 1000));
  const std::string first = a.substr(0, a.find('\0'));  // the first member's name (ustar name field)
  ASSERT_EQ(first.rfind("kernels/gfx942/", 0), 0u) << first;
  expect_format_error([&] { BundleReader::open(p); }, FormatError::Kind::integrity, {"truncated archive", first});
}

TEST_F(BundleReaderTest, MissingEndMarkerIsTruncated) {
  const std::string a = archive();
  const fs::path p = write("noend.dpk", a.substr(0, a.size() - 1024));
  expect_format_error([&] { BundleReader::open(p); }, FormatError::Kind::integrity,
                      {"truncated archive", "end-of-archive marker", "after entry manifest.json"});
}

TEST_F(BundleReaderTest, GarbageAfterTheEndIsRefused) {
  const fs::path p = write("tail.dpk", archive() + std::string(512, 'x'));
  expect_format_error([&] { BundleReader::open(p); }, FormatError::Kind::integrity, {"non-zero byte"});
}

TEST_F(BundleReaderTest, ZeroPaddingAfterTheEndIsAccepted) {
  const fs::path p = write("pad.dpk", archive() + std::string(10240, '\0'));
  BundleReader::open(p).verify();
}

TEST_F(BundleReaderTest, NotATarFile) {
  const fs::path p = write("text.dpk", std::string(2048, 'a'));
  expect_format_error([&] { BundleReader::open(p); }, FormatError::Kind::schema, {"text.dpk"});
}

TEST_F(BundleReaderTest, AlteredCodeObjectFailsVerify) {
  const fs::path d = copy_dir();
  const fs::path cubin = d / "kernels/sm_90a/rmsnorm_w1_h256.sm_90a.cubin";
  std::string bytes = read_text(cubin);
  bytes[bytes.size() / 2] ^= 1;
  write_text(cubin, bytes);
  BundleReader b = BundleReader::open(d);  // opening reads the manifest only
  expect_format_error([&] { b.verify(); }, FormatError::Kind::integrity,
                      {"kernels/sm_90a/rmsnorm_w1_h256.sm_90a.cubin", "sha256", "expected", "altered"});
}

TEST_F(BundleReaderTest, ShortenedCodeObjectFailsVerifyOnSize) {
  const fs::path d = copy_dir();
  const fs::path f = d / "kernels/gfx942/prefetch_b32.gfx942.hsaco";
  const std::string bytes = read_text(f);
  write_text(f, bytes.substr(0, 10));
  expect_format_error([&] { BundleReader::open(d).verify(); }, FormatError::Kind::integrity,
                      {"prefetch_b32.gfx942.hsaco", "10 bytes, expected " + std::to_string(bytes.size())});
}

TEST_F(BundleReaderTest, MissingFileFailsVerify) {
  const fs::path d = copy_dir();
  fs::remove(d / "kernels/sm_90a/prefetch_b32.sm_90a.cubin");
  expect_format_error([&] { BundleReader::open(d).verify(); }, FormatError::Kind::integrity,
                      {"prefetch_b32.sm_90a.cubin", "listed in the manifest but missing"});
}

TEST_F(BundleReaderTest, ExtraFileFailsVerify) {
  const fs::path d = copy_dir();
  write_text(d / "notes.txt", "hello");
  expect_format_error([&] { BundleReader::open(d).verify(); }, FormatError::Kind::integrity,
                      {"notes.txt", "not listed in the manifest"});
}

TEST_F(BundleReaderTest, SymlinkInDirectoryIsRefused) {
  const fs::path d = copy_dir();
  fs::create_symlink("manifest.json", d / "link");
  expect_format_error([&] { BundleReader::open(d); }, FormatError::Kind::integrity, {"link", "symbolic link"});
}

TEST_F(BundleReaderTest, NewerFormatVersionIsRefusedFirst) {
  const fs::path d = copy_dir();
  std::string m = read_text(d / "manifest.json");
  const std::string from = "\"format_version\":{\"major\":1,\"minor\":5}";
  ASSERT_NE(m.find(from), std::string::npos);
  m.replace(m.find(from), from.size(), "\"format_version\":{\"major\":1,\"minor\":99}");
  // Also break a later field: the version must be reported, not the schema problem.
  m.replace(m.find("\"kernels\":"), 10, "\"kernelz\":");
  write_text(d / "manifest.json", m);
  expect_format_error([&] { BundleReader::open(d); }, FormatError::Kind::version,
                      {"1.99", "format 1.9", "supported: 1.0 to 1.9", "upgrade decodepack"});
}

TEST_F(BundleReaderTest, ManifestThatIsNotJson) {
  const fs::path d = copy_dir();
  write_text(d / "manifest.json", "{not json");
  expect_format_error([&] { BundleReader::open(d); }, FormatError::Kind::schema, {"manifest.json", "invalid JSON at byte"});
}

TEST_F(BundleReaderTest, MissingFileAccessorNamesTheFile) {
  BundleReader b = BundleReader::open(bundles().tiny);
  expect_format_error([&] { b.file("kernels/none.cubin"); }, FormatError::Kind::integrity,
                      {"kernels/none.cubin", "missing"});
}

TEST_F(BundleReaderTest, HandMadeArchiveOpens) {
  // The helper writes what the format prescribes: a minimal archive holding the real manifest and its
  // files opens and verifies, so the failures below are caused by the one defect each adds.
  BundleReader src = BundleReader::open(bundles().tiny);
  std::string a;
  for (const std::string& f : src.files())
    a += tar_member(f, std::string(reinterpret_cast<const char*>(src.file(f).data()), src.file(f).size()));
  a += tar_member("manifest.json", src.manifest_bytes()) + kEnd;
  BundleReader::open(write("hand.dpk", a)).verify();
}

TEST_F(BundleReaderTest, DuplicateEntryIsRefused) {
  const std::string a = tar_member("x", "1") + tar_member("x", "2") + kEnd;
  expect_format_error([&] { BundleReader::open(write("dup.dpk", a)); }, FormatError::Kind::integrity,
                      {"entry x", "duplicate entry"});
}

TEST_F(BundleReaderTest, UnsafePathIsRefused) {
  const std::string a = tar_member("../evil", "1") + kEnd;
  expect_format_error([&] { BundleReader::open(write("dotdot.dpk", a)); }, FormatError::Kind::integrity,
                      {"../evil", "'..' path component"});
}

TEST_F(BundleReaderTest, AbsolutePathIsRefused) {
  const std::string a = tar_member("/etc/x", "1") + kEnd;
  expect_format_error([&] { BundleReader::open(write("abs.dpk", a)); }, FormatError::Kind::integrity,
                      {"/etc/x", "absolute path"});
}

TEST_F(BundleReaderTest, SymlinkEntryIsRefused) {
  const std::string a = tar_member("link", "", '2', "manifest.json") + kEnd;
  expect_format_error([&] { BundleReader::open(write("sym.dpk", a)); }, FormatError::Kind::integrity,
                      {"entry link", "symbolic link"});
}

TEST_F(BundleReaderTest, FileAsParentIsRefused) {
  const std::string a = tar_member("a", "1") + tar_member("a/b", "2") + kEnd;
  expect_format_error([&] { BundleReader::open(write("parent.dpk", a)); }, FormatError::Kind::integrity,
                      {"entry a/b", "parent a is a file"});
}

TEST_F(BundleReaderTest, GnuHeaderIsRefused) {
  const std::string a = tar_member("x", "1", '0', "", true) + kEnd;
  expect_format_error([&] { BundleReader::open(write("gnu.dpk", a)); }, FormatError::Kind::integrity,
                      {"entry x", "expected plain ustar"});
}

// The reader parses headers itself (format/ustar.h; libdecodepack links no archive library): every
// kind of header a bundle may not hold is refused by name, and a damaged header by its position.
TEST_F(BundleReaderTest, ExtendedAndLinkHeadersAreRefused) {
  auto refused = [&](const std::string& name, const std::string& bytes) {
    return [this, name, bytes] { BundleReader::open(write(name, bytes)); };
  };
  expect_format_error(refused("pax.dpk", tar_member("PaxHeaders/x", "20 path=renamed.txt\n", 'x') + tar_member("x", "1") + kEnd),
                      FormatError::Kind::integrity, {"entry PaxHeaders/x", "pax extended header", "expected plain ustar"});
  expect_format_error(refused("longname.dpk", tar_member("././@LongLink", "", 'L') + kEnd), FormatError::Kind::integrity,
                      {"GNU long-name header", "expected plain ustar"});
  expect_format_error(refused("hard.dpk", tar_member("a", "1") + tar_member("h", "", '1', "a") + kEnd),
                      FormatError::Kind::integrity, {"entry h", "hard link"});
  expect_format_error(refused("fifo.dpk", tar_member("p", "", '6') + kEnd), FormatError::Kind::integrity,
                      {"entry p", "device, fifo or socket"});
  expect_format_error(refused("unknown.dpk", tar_member("v", "", 'V') + kEnd), FormatError::Kind::integrity,
                      {"entry v", "unknown type 'V'"});
}

TEST_F(BundleReaderTest, DamagedHeaderIsNamedByPosition) {
  std::string a = tar_member("a.txt", "hello") + tar_member("b.txt", "x") + kEnd;
  a[1024 + 10] ^= 0x40;  // the second header's name: its checksum no longer matches
  expect_format_error([&] { BundleReader::open(write("damaged.dpk", a)); }, FormatError::Kind::integrity,
                      {"corrupt archive", "after entry a.txt", "at byte 1024", "checksum"});
  std::string first = tar_member("a.txt", "hello") + kEnd;
  std::memcpy(&first[124], "12x", 3);  // a size that is not octal (checksum fixed below)
  std::memset(&first[148], ' ', 8);
  unsigned sum = 0;
  for (size_t i = 0; i < 512; ++i) sum += static_cast<unsigned char>(first[i]);
  std::snprintf(&first[148], 8, "%06o", sum);
  expect_format_error([&] { BundleReader::open(write("size.dpk", first)); }, FormatError::Kind::schema,
                      {"not a tar archive", "size field", "not an octal number"});
}

TEST_F(BundleReaderTest, LongPathsUseTheUstarPrefix) {
  const std::string dir(120, 'd');
  std::string h = tar_header("f.bin", 3);
  std::memcpy(&h[345], dir.data(), dir.size());  // prefix field
  std::memset(&h[148], ' ', 8);
  unsigned sum = 0;
  for (unsigned char c : h) sum += c;
  std::snprintf(&h[148], 8, "%06o", sum);
  const std::string a = h + "abc" + std::string(509, '\0') + tar_member("manifest.json", "{}") + kEnd;
  // Structure is accepted (the manifest is then refused as a schema error, which is not the point).
  try {
    BundleReader::open(write("prefix.dpk", a));
  } catch (const FormatError& e) {
    EXPECT_EQ(e.kind, FormatError::Kind::schema) << e.what();
    EXPECT_EQ(std::string(e.what()).find("entry"), std::string::npos) << e.what();
  }
}

// ---- Hostile bundles (issue 12): what is read is bounded before the manifest is validated ----------

// An archive of `prefix` then a member whose data is a hole of `size` zeros (no disk space), then the
// end-of-archive marker.
fs::path sparse_archive(const fs::path& p, const std::string& prefix, const std::string& name, uint64_t size) {
  write_text(p, prefix + tar_header(name, size));
  fs::resize_file(p, prefix.size() + 512 + (size + 511) / 512 * 512 + 1024);
  return p;
}

TEST_F(BundleReaderTest, ManifestAboveTheLimitIsRefusedUnread) {
  const fs::path p = sparse_archive(dir_ / "huge.dpk", "", "manifest.json", format::kMaxManifestBytes + 1);
  expect_format_error([&] { BundleReader::open(p); }, FormatError::Kind::schema,
                      {"huge.dpk:manifest.json", std::to_string(format::kMaxManifestBytes + 1) + " bytes",
                       "expected at most " + std::to_string(format::kMaxManifestBytes)});
}

TEST_F(BundleReaderTest, LargeUnlistedMemberIsNeverRead) {
  // 6 GB of zeros after the real bundle's members: open() skips it, verify() names it without reading it.
  std::string a = archive();
  a.resize(a.size() - 1024);  // drop the end marker; sparse_archive adds one after the new member
  const fs::path p = sparse_archive(dir_ / "big.dpk", a, "zz/padding.bin", uint64_t{6} << 30);
  BundleReader b = BundleReader::open(p);
  EXPECT_EQ(b.size("zz/padding.bin"), uint64_t{6} << 30);
  expect_format_error([&] { b.verify(); }, FormatError::Kind::integrity, {"zz/padding.bin", "not listed"});
  expect_format_error([&] { b.file("zz/padding.bin"); }, FormatError::Kind::integrity,
                      {"zz/padding.bin", "expected at most " + std::to_string(format::kMaxLoadedFileBytes)});
}

TEST_F(BundleReaderTest, TooMuchPaddingAfterTheEndIsRefused) {
  const fs::path p = write("pad.dpk", archive() + std::string(format::kMaxArchiveTrailingBytes + 512, '\0'));
  expect_format_error([&] { BundleReader::open(p); }, FormatError::Kind::integrity,
                      {"pad.dpk", "bytes from the end-of-archive marker", "expected at most"});
}

TEST_F(BundleReaderTest, TooManyEntriesAreRefused) {
  std::string a;
  a.reserve((format::kMaxBundleFiles + 1) * 512 + 1024);
  for (uint64_t i = 0; i <= format::kMaxBundleFiles; ++i) a += tar_header("d" + std::to_string(i) + "/", 0, '5');
  expect_format_error([&] { BundleReader::open(write("many.dpk", a + kEnd)); }, FormatError::Kind::schema,
                      {"many.dpk", "more than " + std::to_string(format::kMaxBundleFiles) + " entries"});
}

TEST_F(BundleReaderTest, FifoIsRefusedWithoutBlocking) {
  const fs::path p = dir_ / "fifo.dpk";
  ASSERT_EQ(::mkfifo(p.c_str(), 0644), 0);
  expect_format_error([&] { BundleReader::open(p); }, FormatError::Kind::integrity,
                      {"fifo.dpk", "is a FIFO (named pipe), expected a regular file"}, true);
  const fs::path d = copy_dir();
  ASSERT_EQ(::mkfifo((d / "kernels" / "fifo").c_str(), 0644), 0);
  expect_format_error([&] { BundleReader::open(d); }, FormatError::Kind::integrity,
                      {"kernels/fifo is a FIFO (named pipe)", "only regular files"});
}

TEST_F(BundleReaderTest, DeeplyNestedManifestIsRefused) {
  const fs::path d = copy_dir();
  std::string m = read_text(d / "manifest.json");
  m.replace(m.find("\"toolchains\":{"), 14, "\"toolchains\":{\"zz\":" + std::string(100000, '[') +
            std::string(100000, ']') + ",");
  write_text(d / "manifest.json", m);
  expect_format_error([&] { BundleReader::open(d); }, FormatError::Kind::schema,
                      {"manifest.json", "nested deeper than 64 levels"});
}

TEST_F(BundleReaderTest, FileLoadedAfterOpenIsCheckedAgainstTheManifest) {
  // load() / file() read files after open(): one edited in between is refused, never handed out.
  const fs::path d = copy_dir();
  BundleReader b = BundleReader::open(d);
  const std::string f = "kernels/sm_90a/rmsnorm_w1_h256.sm_90a.cubin";
  std::string bytes = read_text(d / f);
  bytes[100] ^= 1;
  write_text(d / f, bytes);
  expect_format_error([&] { b.file(f); }, FormatError::Kind::integrity, {f, "sha256", "altered"});
  expect_format_error([&] { BundleReader::open(d).load(); }, FormatError::Kind::integrity, {f, "altered"});
}

TEST_F(BundleReaderTest, LoadKeepsFilesAfterTheDirectoryIsGone) {
  // dp_bundle_open's promise: once loaded, the bundle no longer needs its path.
  const fs::path d = copy_dir();
  BundleReader b = BundleReader::open(d);
  b.load();
  fs::remove_all(d);
  for (const auto& f : b.manifest().files) EXPECT_EQ(format::sha256_hex(b.file(f.path)), f.sha256) << f.path;
}

}  // namespace
}  // namespace dp::rttest
