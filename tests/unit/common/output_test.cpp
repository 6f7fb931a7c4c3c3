// Publishing outputs without losing what was there: staging names that record their owner, the
// removal of a killed run's leftovers (never a live one's), and what may be written over.
#include "common/output.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <set>

#include "../test_util.h"
#include "common/fs.h"

namespace dp {
namespace {

namespace fs = std::filesystem;
using test::expect_error;
using test::TempDir;

void put(const fs::path& p, std::string_view bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

std::string slurp(const fs::path& p) { return read_text_file(p); }

std::set<std::string> names(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

// A pid that belonged to a process which has exited (and been reaped).
long dead_pid() {
  pid_t p = ::fork();
  if (p == 0) ::_exit(0);
  ::waitpid(p, nullptr, 0);
  return p;
}

// The name staging_path() would give `target`'s entry of `kind` if process `pid` of `host` made it in
// the boot whose id starts with `boot`.
std::string entry_name(const std::string& target, const std::string& kind, long pid, const std::string& boot,
                       const std::string& host) {
  return fmt::format(".{}.{}-{}-{}-0123456789abcdef@{}", target, kind, pid, boot, host);
}

// Our own boot id prefix and host name, read back from a name staging_path() made.
StagingOwner self(const fs::path& dir) {
  std::optional<StagingOwner> o = staging_owner(staging_path(dir / "x", "tmp").filename().string(), "x");
  EXPECT_TRUE(o);
  return *o;
}

std::optional<std::vector<std::string>> owned_if_marker(const fs::path& dir) {
  if (!fs::exists(dir / "OURS")) return std::nullopt;
  std::vector<std::string> own{"OURS"};
  std::ifstream in(dir / "OURS");
  for (std::string line; std::getline(in, line);) own.push_back(line);
  return own;
}

TEST(StagingNames, RecordThisProcessAndParseBack) {
  TempDir t;
  const fs::path p = staging_path(t / "out.dpk", "staging");
  EXPECT_EQ(p.parent_path(), t.path());
  const std::string name = p.filename().string();
  EXPECT_EQ(name.rfind(".out.dpk.staging-" + std::to_string(::getpid()) + "-", 0), 0u) << name;
  std::optional<StagingOwner> o = staging_owner(name, "out.dpk");
  ASSERT_TRUE(o);
  EXPECT_EQ(o->kind, "staging");
  EXPECT_EQ(o->pid, ::getpid());
  EXPECT_EQ(o->boot.size(), 8u);
  EXPECT_FALSE(o->host.empty());
  EXPECT_FALSE(staging_owner_is_gone(*o));  // this process
  EXPECT_NE(staging_path(t / "out.dpk", "staging"), p);  // fresh every time
  // A trailing slash names the same output.
  EXPECT_EQ(staging_path(t.path() / "dir/", "tmp").parent_path(), t.path());
  EXPECT_TRUE(staging_owner(staging_path(t.path() / "dir/", "tmp").filename().string(), "dir"));

  // Other names are not staging entries of this target.
  for (const char* other :
       {".out.dpk.staging-0123456789abcdef", "out.dpk", ".out.dpk.staging-12-abcdefgh-0123456789abcdef@h",
        ".out.dpk.staging-12-0123abcd-0123456789abcdef", ".out.dpk.cache-12-0123abcd-0123456789abcdef@h",
        ".other.staging-12-0123abcd-0123456789abcdef@h", ".out.dpk.staging--0123abcd-0123456789abcdef@h"})
    EXPECT_FALSE(staging_owner(other, "out.dpk")) << other;
  EXPECT_FALSE(staging_owner(name, "out"));
}

TEST(StagingNames, StaleEntriesOfDeadOwnersAreRemovedOthersKept) {
  TempDir t;
  const StagingOwner me = self(t.path());
  const long gone = dead_pid();
  const std::string other_boot = me.boot == "ffffffff" ? "eeeeeeee" : "ffffffff";
  put(t / "out.dpk", "the published bundle");
  const std::string dead = entry_name("out.dpk", "staging", gone, me.boot, me.host);
  const std::string dead_tmp = entry_name("out.dpk", "tmp", gone, me.boot, me.host);
  const std::string rebooted = entry_name("out.dpk", "tmp", ::getpid(), other_boot, me.host);
  const std::string live = entry_name("out.dpk", "staging", ::getpid(), me.boot, me.host);
  const std::string elsewhere = entry_name("out.dpk", "staging", gone, me.boot, "another-host");
  const std::string legacy = ".out.dpk.staging-0123456789abcdef";  // no owner recorded: never removed
  const std::string other_target = entry_name("other.dpk", "tmp", gone, me.boot, me.host);
  put(t / dead / "kernels/k.cubin", "partial");
  put(t / dead_tmp, "partial");
  put(t / rebooted, "partial");
  put(t / live / "manifest.json", "in progress");
  put(t / elsewhere / "manifest.json", "in progress elsewhere");
  put(t / legacy / "manifest.json", "unknown");
  put(t / other_target, "another output's");

  std::vector<fs::path> removed = remove_stale_staging(t / "out.dpk");
  std::set<std::string> removed_names;
  for (const fs::path& p : removed) removed_names.insert(p.filename().string());
  EXPECT_EQ(removed_names, (std::set<std::string>{dead, dead_tmp, rebooted}));
  EXPECT_EQ(names(t.path()), (std::set<std::string>{"out.dpk", live, elsewhere, legacy, other_target}));
  EXPECT_EQ(slurp(t / "out.dpk"), "the published bundle");
}

TEST(StagingNames, AStaleOldOutputIsPutBackWhenNothingReplacedIt) {
  TempDir t;
  const StagingOwner me = self(t.path());
  const std::string old = entry_name("out", "old", dead_pid(), me.boot, me.host);
  put(t / old / "manifest.json", "previous bundle");
  EXPECT_TRUE(remove_stale_staging(t / "out").empty());
  EXPECT_EQ(slurp(t / "out/manifest.json"), "previous bundle");
  EXPECT_EQ(names(t.path()), (std::set<std::string>{"out"}));

  // With the output back in place, a second stale one is litter.
  put(t / old / "manifest.json", "older bundle");
  EXPECT_EQ(remove_stale_staging(t / "out").size(), 1u);
  EXPECT_EQ(slurp(t / "out/manifest.json"), "previous bundle");
}

TEST(StagingNames, ALiveChildProcessKeepsItsEntry) {
  TempDir t;
  const StagingOwner me = self(t.path());
  pid_t child = ::fork();
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  const std::string name = entry_name("out", "staging", child, me.boot, me.host);
  put(t / name / "f", "x");
  EXPECT_TRUE(remove_stale_staging(t / "out").empty());
  EXPECT_TRUE(fs::exists(t / name / "f"));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(remove_stale_staging(t / "out").size(), 1u);
  EXPECT_FALSE(fs::exists(t / name));
}

TEST(PlanOutput, NothingOrAnEmptyDirectoryIsCreated) {
  TempDir t;
  EXPECT_EQ(plan_output(t / "new", OutputKind::directory, false, "a bundle", owned_if_marker).action,
            OutputPlan::Action::create);
  EXPECT_EQ(plan_output(t / "new.dpk", OutputKind::file, false, "a bundle", owned_if_marker).action,
            OutputPlan::Action::create);
  fs::create_directories(t / "empty");
  EXPECT_EQ(plan_output(t / "empty", OutputKind::directory, false, "a bundle", owned_if_marker).action,
            OutputPlan::Action::create);
}

TEST(PlanOutput, OurOwnOutputIsReplacedAnythingElseNeedsForce) {
  TempDir t;
  put(t / "ours/OURS", "a\nsub/b\n");
  put(t / "ours/a", "1");
  put(t / "ours/sub/b", "2");
  OutputPlan p = plan_output(t / "ours", OutputKind::directory, false, "a bundle", owned_if_marker);
  EXPECT_EQ(p.action, OutputPlan::Action::replace);

  // One file more, and it is no longer only ours.
  put(t / "ours/notes.txt", "mine");
  expect_error([&] { plan_output(t / "ours", OutputKind::directory, false, "a bundle", owned_if_marker); }, Errc::usage,
               {(t / "ours").string(), "refusing to overwrite", "notes.txt", "--force", "other entries are kept"});
  p = plan_output(t / "ours", OutputKind::directory, true, "a bundle", owned_if_marker);
  EXPECT_EQ(p.action, OutputPlan::Action::write_into);
  EXPECT_EQ(p.previous, (std::vector<std::string>{"OURS", "a", "sub/b"}));

  // A directory that is not ours at all; a symbolic link inside one that is.
  put(t / "theirs/data/x.bin", "x");
  expect_error([&] { plan_output(t / "theirs", OutputKind::directory, false, "a bundle", owned_if_marker); },
               Errc::usage, {"data/", "--force"});
  fs::remove(t / "ours/notes.txt");
  fs::create_symlink("/", t / "ours/sub/link");
  expect_error([&] { plan_output(t / "ours", OutputKind::directory, false, "a bundle", owned_if_marker); },
               Errc::usage, {"sub/link"});
}

TEST(PlanOutput, FilesAreReplacedOnlyWhenOursOrForcedAndADirectoryNeverByAFile) {
  TempDir t;
  auto ours_if_says_so = [](const fs::path& p) -> std::optional<std::vector<std::string>> {
    if (slurp(p) == "ours") return std::vector<std::string>{};
    return std::nullopt;
  };
  put(t / "a.dpk", "ours");
  EXPECT_EQ(plan_output(t / "a.dpk", OutputKind::file, false, "a bundle", ours_if_says_so).action,
            OutputPlan::Action::replace);
  put(t / "b.dpk", std::string(10240, 'x'));
  expect_error([&] { plan_output(t / "b.dpk", OutputKind::file, false, "a bundle", ours_if_says_so); }, Errc::usage,
               {(t / "b.dpk").string(), "a file of 10240 bytes", "not a bundle", "--force to replace it"});
  EXPECT_EQ(plan_output(t / "b.dpk", OutputKind::file, true, "a bundle", ours_if_says_so).action,
            OutputPlan::Action::replace);
  fs::create_directories(t / "c.dpk");
  for (bool force : {false, true})
    expect_error([&] { plan_output(t / "c.dpk", OutputKind::file, force, "a bundle", ours_if_says_so); }, Errc::usage,
                 {"is a directory", "not even with --force"});
  // A file where a directory output goes.
  put(t / "d", "text");
  expect_error([&] { plan_output(t / "d", OutputKind::directory, false, "a bundle", owned_if_marker); }, Errc::usage,
               {"a file", "--force"});
  EXPECT_EQ(plan_output(t / "d", OutputKind::directory, true, "a bundle", owned_if_marker).action,
            OutputPlan::Action::replace);
}

TEST(PlanOutput, AnOutputOverTheInputIsAlwaysRefused) {
  TempDir t;
  put(t / "ckpt/config.json", "{}");
  fs::create_symlink(t / "ckpt", t / "alias");
  for (const fs::path& out : {t / "ckpt", t / "ckpt/", t / "alias", t / "ckpt/../ckpt"})
    expect_error([&] { refuse_output_over_input(out, t / "ckpt", "input model"); }, Errc::usage,
                 {"is the input model", "choose another output"});
  expect_error([&] { refuse_output_over_input(t / "ckpt/b.dpk", t / "ckpt", "input model"); }, Errc::usage,
               {"lies inside the input model"});
  expect_error([&] { refuse_output_over_input(t.path(), t / "ckpt", "input model"); }, Errc::usage,
               {"contains the input model"});
  EXPECT_NO_THROW(refuse_output_over_input(t / "ckpt2", t / "ckpt", "input model"));
  EXPECT_NO_THROW(refuse_output_over_input(t / "b.dpk", t / "ckpt", "input model"));
  EXPECT_NO_THROW(refuse_output_over_input(t / "ckpt", t / "missing", "input model"));
  EXPECT_TRUE(paths_overlap(t / "x/cache", t / "x"));
  EXPECT_FALSE(paths_overlap(t / "x2", t / "x"));
}

TEST(StagingDir, CommitSwapsAPreviousOutputInOneStep) {
  TempDir t;
  put(t / "out/old.txt", "old");
  {
    StagingDir s(t / "out");
    put(s.path() / "new.txt", "new");
    s.commit();
  }
  EXPECT_EQ(names(t / "out"), (std::set<std::string>{"new.txt"}));
  EXPECT_EQ(names(t.path()), (std::set<std::string>{"out"}));  // the old one is gone, no staging left
  // Over a file (forced), and into nothing.
  put(t / "file", "x");
  {
    StagingDir s(t / "file");
    put(s.path() / "f", "dir now");
    s.commit();
  }
  EXPECT_EQ(slurp(t / "file/f"), "dir now");
  {
    StagingDir s(t / "fresh/");
    put(s.path() / "f", "1");
    s.commit();
  }
  EXPECT_EQ(slurp(t / "fresh/f"), "1");
  // "out/." and "x/../out" name "out" (e.g. `-o .` inside it).
  for (const fs::path& same : {t / "out" / ".", t / "x" / ".." / "out"}) {
    StagingDir s(same);
    EXPECT_EQ(s.path().parent_path(), t.path());
    put(s.path() / "again.txt", same.string());
    s.commit();
    EXPECT_EQ(names(t / "out"), (std::set<std::string>{"again.txt"}));
  }
  EXPECT_EQ(names(t.path()), (std::set<std::string>{"out", "file", "fresh"}));
}

TEST(StagingDir, CommitIntoKeepsOtherFilesAndRemovesOnlyThePreviousOutputs) {
  TempDir t;
  put(t / "out/manifest.json", "old manifest");
  put(t / "out/kernels/a/gone.bin", "previous output, not rewritten");
  put(t / "out/kernels/b/kept.bin", "previous output, rewritten");
  put(t / "out/notes.txt", "the user's");
  put(t / "out/kernels/a/users.bin", "the user's, beside ours");
  put(t / "elsewhere/victim", "outside the output");
  fs::create_symlink(t / "elsewhere", t / "out/link");
  {
    StagingDir s(t / "out");
    put(s.path() / "manifest.json", "new manifest");
    put(s.path() / "kernels/b/kept.bin", "new");
    put(s.path() / "kernels/c/new.bin", "new");
    // A previous output listing paths outside, or through a link, never removes them.
    s.commit_into({"manifest.json", "kernels/a/gone.bin", "kernels/b/kept.bin", "../elsewhere/victim", "link/victim",
                   "/etc/passwd"},
                  {"manifest.json"});
  }
  EXPECT_EQ(slurp(t / "out/manifest.json"), "new manifest");
  EXPECT_EQ(slurp(t / "out/kernels/b/kept.bin"), "new");
  EXPECT_EQ(slurp(t / "out/kernels/c/new.bin"), "new");
  EXPECT_FALSE(fs::exists(t / "out/kernels/a/gone.bin"));
  EXPECT_EQ(slurp(t / "out/kernels/a/users.bin"), "the user's, beside ours");
  EXPECT_EQ(slurp(t / "out/notes.txt"), "the user's");
  EXPECT_EQ(slurp(t / "elsewhere/victim"), "outside the output");
  EXPECT_TRUE(fs::is_symlink(t / "out/link"));
  EXPECT_EQ(names(t.path()), (std::set<std::string>{"out", "elsewhere"}));

  // A staged file whose directory is a link in the output is refused, not written through the link.
  {
    StagingDir s(t / "out");
    put(s.path() / "link/x", "through the link");
    expect_error([&] { s.commit_into({}, {}); }, Errc::io, {"link", "is not a directory"});
  }
  EXPECT_FALSE(fs::exists(t / "elsewhere/x"));
}

// The file size limit makes write(2) fail with EFBIG ("File too large") as a full disk fails with ENOSPC,
// without needing a full disk.
TEST(WriteFileAtomic, AWriteErrorNamesThePathAndTheSystemsReasonAndLeavesNothing) {
  TempDir t;
  put(t / "f", "previous");
  struct sigaction ignore {}, old_action {};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGXFSZ, &ignore, &old_action);
  rlimit old_limit{};
  ::getrlimit(RLIMIT_FSIZE, &old_limit);
  rlimit small = old_limit;
  small.rlim_cur = 4096;
  ::setrlimit(RLIMIT_FSIZE, &small);
  std::string message;
  try {
    write_file_atomic(t / "f", std::string(10000, 'x'));
  } catch (const Error& e) {
    message = e.what();
    EXPECT_EQ(e.code(), Errc::io);
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  ::sigaction(SIGXFSZ, &old_action, nullptr);
  EXPECT_NE(message.find((t / "f").string()), std::string::npos) << message;
  EXPECT_NE(message.find(std::strerror(EFBIG)), std::string::npos) << message;
  EXPECT_NE(message.find("4096 of 10000 bytes"), std::string::npos) << message;
  EXPECT_EQ(slurp(t / "f"), "previous");
  EXPECT_EQ(names(t.path()), (std::set<std::string>{"f"}));
}

}  // namespace
}  // namespace dp
