#include "common/output.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <utility>

#include "common/error.h"

namespace fs = std::filesystem;

namespace dp {
namespace {

constexpr std::string_view kUnknownBoot = "00000000";
constexpr std::string_view kKinds[] = {"staging", "tmp", "old"};

bool is_hex(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// The first 8 hex digits of this boot's id: a pid recorded in another boot names no live process.
const std::string& boot_id() {
  static const std::string id = [] {
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string line;
    std::getline(in, line);
    std::string hex;
    for (char c : line)
      if (is_hex(std::string_view(&c, 1)) && hex.size() < 8) hex += c;
    return hex.size() == 8 ? hex : std::string(kUnknownBoot);
  }();
  return id;
}

// The host name, reduced to characters that are safe in a file name.
const std::string& host_name() {
  static const std::string host = [] {
    char buf[256] = {};
    std::string h;
    if (::gethostname(buf, sizeof buf - 1) == 0)
      for (const char* p = buf; *p && h.size() < 64; ++p)
        if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '.' || *p == '-')
          h += *p;
    return h.empty() ? std::string("localhost") : h;
  }();
  return host;
}

std::string random_hex16() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}", rd(), rd());
}

std::string describe_type(const fs::file_status& st) {
  switch (st.type()) {
    case fs::file_type::regular: return "a file";
    case fs::file_type::directory: return "a directory";
    case fs::file_type::symlink: return "a symbolic link";
    case fs::file_type::fifo: return "a FIFO";
    case fs::file_type::socket: return "a socket";
    case fs::file_type::block:
    case fs::file_type::character: return "a device";
    default: return "something";
  }
}

// Up to `limit` entries under `dir` that are not in `own` (relative paths; a directory counts only
// when nothing of `own` lies under it). A directory that cannot be listed counts as foreign.
std::vector<std::string> foreign_entries(const fs::path& dir, const std::set<std::string>& own, size_t limit) {
  std::set<std::string> own_dirs;
  for (const std::string& f : own)
    for (size_t slash = f.find('/'); slash != std::string::npos; slash = f.find('/', slash + 1))
      own_dirs.insert(f.substr(0, slash));
  std::vector<std::string> out;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, fs::directory_options::none, ec), end;
  if (ec) return {"(unreadable)"};
  for (; it != end && out.size() < limit; it.increment(ec)) {
    if (ec) {
      out.push_back("(unreadable)");
      break;
    }
    const std::string rel = it->path().lexically_relative(dir).generic_string();
    std::error_code sec;
    const fs::file_status st = it->symlink_status(sec);
    if (fs::is_directory(st)) {
      if (!own_dirs.count(rel)) {
        out.push_back(rel + "/");
        it.disable_recursion_pending();
      }
    } else if (!fs::is_regular_file(st) || !own.count(rel)) {
      out.push_back(rel);
    }
  }
  return out;
}

// The directory an output lives in and its name ("out/" names "out").
std::pair<fs::path, std::string> split_target(const fs::path& target) {
  fs::path abs = fs::absolute(target).lexically_normal();  // "out/." and "a/../out" name "out"
  if (abs.filename().empty()) abs = abs.parent_path();
  return {abs.parent_path(), abs.filename().string()};
}

bool is_within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i)
    if (i == inner.end() || *i != *o) return false;
  return i != inner.end();
}

fs::path resolved(const fs::path& p) {
  std::error_code ec;
  fs::path abs = fs::absolute(p, ec);
  if (ec) return p.lexically_normal();
  fs::path c = fs::weakly_canonical(abs, ec);
  return (ec ? abs : c).lexically_normal();
}

}  // namespace

fs::path staging_path(const fs::path& target, std::string_view kind) {
  auto [parent, name] = split_target(target);
  return parent / fmt::format(".{}.{}-{}-{}-{}@{}", name, kind, static_cast<long>(::getpid()), boot_id(),
                              random_hex16(), host_name());
}

std::optional<StagingOwner> staging_owner(std::string_view entry, std::string_view target_name) {
  // .<target>.<kind>-<pid>-<boot>-<random>@<host>
  if (entry.size() < target_name.size() + 2 || entry[0] != '.' || entry.substr(1, target_name.size()) != target_name ||
      entry[1 + target_name.size()] != '.')
    return std::nullopt;
  std::string_view rest = entry.substr(2 + target_name.size());
  StagingOwner o;
  for (std::string_view k : kKinds)
    if (rest.size() > k.size() && rest.substr(0, k.size()) == k && rest[k.size()] == '-') o.kind = std::string(k);
  if (o.kind.empty()) return std::nullopt;
  rest.remove_prefix(o.kind.size() + 1);
  size_t at = rest.find('@');
  if (at == std::string_view::npos || at + 1 == rest.size()) return std::nullopt;
  o.host = std::string(rest.substr(at + 1));
  std::string_view fields = rest.substr(0, at);
  size_t d1 = fields.find('-'), d2 = d1 == std::string_view::npos ? d1 : fields.find('-', d1 + 1);
  if (d2 == std::string_view::npos) return std::nullopt;
  std::string_view pid = fields.substr(0, d1), boot = fields.substr(d1 + 1, d2 - d1 - 1), rnd = fields.substr(d2 + 1);
  if (pid.empty() || pid.size() > 9 || !std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  if (boot.size() != 8 || !is_hex(boot) || rnd.size() != 16 || !is_hex(rnd)) return std::nullopt;
  o.pid = std::stol(std::string(pid));
  o.boot = std::string(boot);
  return o;
}

bool staging_owner_is_gone(const StagingOwner& owner) {
  if (owner.host != host_name() || owner.pid <= 0) return false;
  if (owner.boot != boot_id() && owner.boot != kUnknownBoot && boot_id() != kUnknownBoot) return true;
  if (owner.pid == static_cast<long>(::getpid())) return false;
  return ::kill(static_cast<pid_t>(owner.pid), 0) != 0 && errno == ESRCH;
}

std::vector<fs::path> remove_stale_staging(const fs::path& target) {
  std::vector<fs::path> removed;
  const auto [dir, name] = split_target(target);
  std::error_code ec;
  std::vector<fs::path> stale_old;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::optional<StagingOwner> o = staging_owner(it->path().filename().string(), name);
    if (!o || !staging_owner_is_gone(*o)) continue;
    if (o->kind == "old") {
      stale_old.push_back(it->path());
      continue;
    }
    std::error_code rec;
    fs::remove_all(it->path(), rec);
    if (!rec) removed.push_back(it->path());
  }
  // A previous output moved aside by a killed publication goes back where it was, if that is free.
  const fs::path published = dir / name;
  for (const fs::path& old : stale_old) {
    std::error_code sec;
    if (!fs::exists(fs::symlink_status(published, sec)) && ::rename(old.c_str(), published.c_str()) == 0) continue;
    std::error_code rec;
    fs::remove_all(old, rec);
    if (!rec) removed.push_back(old);
  }
  return removed;
}

bool paths_overlap(const fs::path& a, const fs::path& b) {
  const fs::path x = resolved(a), y = resolved(b);
  return x == y || is_within(x, y) || is_within(y, x);
}

bool is_safe_relative_path(std::string_view rel) {
  if (rel.empty() || rel.front() == '/' || rel.find('\0') != std::string_view::npos) return false;
  size_t start = 0;
  while (true) {
    size_t slash = rel.find('/', start);
    std::string_view c = rel.substr(start, slash == std::string_view::npos ? std::string_view::npos : slash - start);
    if (c.empty() || c == "." || c == "..") return false;
    if (slash == std::string_view::npos) return true;
    start = slash + 1;
  }
}

OutputPlan plan_output(const fs::path& out, OutputKind kind, bool force, std::string_view what, const OwnedFiles& owned) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(out, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    fail(Errc::io, "{}: cannot examine the output path: {}", out.string(), ec.message());
  if (!fs::exists(st)) return {};

  auto refuse = [&](const std::string& there, std::string_view force_does) {
    fail(Errc::usage, "{}: refusing to overwrite {}; choose another output, or pass --force to {}", out.string(), there,
         force_does);
  };

  if (kind == OutputKind::file) {
    if (fs::is_directory(st))
      fail(Errc::usage, "{}: is a directory, and {} goes to a file here; choose another output (a directory is never "
                        "replaced by a file, not even with --force)", out.string(), what);
    if (fs::is_regular_file(st) && owned(out)) return {OutputPlan::Action::replace, {}, {}};
    if (!force) {
      std::string there = describe_type(st);
      if (fs::is_regular_file(st)) there += fmt::format(" of {} bytes", fs::file_size(out, ec));
      refuse(fmt::format("{} that is not {} decodepack wrote", there, what), "replace it");
    }
    return {OutputPlan::Action::replace, {}, {}};
  }

  if (!fs::is_directory(st)) {
    if (!force) refuse(fmt::format("{} that is not {} decodepack wrote", describe_type(st), what), "replace it");
    return {OutputPlan::Action::replace, {}, {}};
  }
  if (fs::is_empty(out, ec) && !ec) return {};
  std::optional<std::vector<std::string>> mine = owned(out);
  std::set<std::string> own;
  if (mine) own.insert(mine->begin(), mine->end());
  const std::vector<std::string> foreign = foreign_entries(out, own, 6);
  if (mine && foreign.empty()) return {OutputPlan::Action::replace, *mine, {}};
  if (!force) {
    std::string list;
    for (size_t i = 0; i < foreign.size() && i < 5; ++i) list += (i ? ", " : "") + foreign[i];
    if (foreign.size() > 5) list += ", ...";
    refuse(fmt::format("a directory holding entries that are not part of {} decodepack wrote ({})", what, list),
           fmt::format("write {} into it (its other entries are kept)", what));
  }
  return {OutputPlan::Action::write_into, mine ? *mine : std::vector<std::string>{}, foreign};
}

void refuse_output_over_input(const fs::path& out, const fs::path& input, std::string_view input_what,
                              std::string_view out_what) {
  std::error_code ec;
  if (input.empty() || !fs::exists(input, ec)) return;
  const fs::path o = resolved(out), in = resolved(input);
  if (o == in)
    fail(Errc::usage, "{}: the {} is the {} {}; decodepack never writes over its input: choose another {}",
         out.string(), out_what, input_what, input.string(), out_what);
  if (is_within(o, in))
    fail(Errc::usage, "{}: the {} lies inside the {} {}; decodepack never writes into its input: choose another {}",
         out.string(), out_what, input_what, input.string(), out_what);
  if (is_within(in, o))
    fail(Errc::usage, "{}: the {} contains the {} {}, which publishing it would remove: choose another {}",
         out.string(), out_what, input_what, input.string(), out_what);
}

}  // namespace dp
