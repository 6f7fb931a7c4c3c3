#include "format/untrusted.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <vector>

#include <fmt/format.h>

namespace dp::format {

std::string excerpt(std::string_view s, size_t max) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) {
    if (out.size() >= max) {
      out += fmt::format("... ({} bytes)", s.size());
      break;
    }
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    bool ok = len > 0 && i + len <= s.size();
    for (size_t k = 1; ok && k < len; ++k) ok = (static_cast<unsigned char>(s[i + k]) & 0xc0) == 0x80;
    if (!ok || c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
      ++i;
    } else {
      out.append(s.substr(i, len));
      i += len;
    }
  }
  return out;
}

std::string json_excerpt(const Json& v, size_t max) {
  // A string longer than the excerpt is cut before dumping, so quoting it costs O(max), not O(size).
  if (v.is_string() && v.get_ref<const std::string&>().size() > max)
    return "\"" + excerpt(v.get_ref<const std::string&>(), max);
  return excerpt(v.dump(-1, ' ', false, Json::error_handler_t::replace), max);
}

namespace {

// The 0-based byte of the bracket that opens level max_depth + 1, or npos. Brackets inside strings do
// not count. For any text nlohmann::json accepts, and for the prefix it reads before refusing one, this
// is exactly the parser's nesting, so a text that passes cannot nest deeper.
size_t too_deep_at(std::string_view t, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    if (in_string) {
      if (c == '\\') ++i;  // the escaped byte cannot end the string
      else if (c == '"') in_string = false;
      continue;
    }
    switch (c) {
      case '"': in_string = true; break;
      case '[':
      case '{':
        if (++depth > max_depth) return i;
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default: break;
    }
  }
  return std::string_view::npos;
}

// nlohmann's exception text without its "[json.exception.parse_error.101] " prefix.
std::string explanation(const Json::exception& e) {
  std::string_view msg = e.what();
  if (msg.starts_with("[json.exception.")) {
    if (const size_t p = msg.find("] "); p != std::string_view::npos) msg.remove_prefix(p + 2);
  }
  return excerpt(msg, 2 * kExcerptMax);
}

}  // namespace

Json parse_json_text(std::string_view text, const JsonLimits& limits) {
  using Kind = JsonTextError::Kind;
  if (text.size() > limits.max_bytes)
    throw JsonTextError(Kind::too_large, 0,
                        fmt::format("{} bytes, expected at most {}", text.size(), limits.max_bytes));
  if (const size_t at = too_deep_at(text, limits.max_depth); at != std::string_view::npos)
    throw JsonTextError(Kind::too_deep, at,
                        fmt::format("arrays and objects nested deeper than {} levels at byte {} (at most {} are "
                                    "allowed)", limits.max_depth, at, limits.max_depth));

  // The parser callback sees every key before the DOM merges equal ones. Depth is bounded above, so
  // these stacks are small.
  struct Level {
    bool object = false;
    std::set<std::string> keys;
    std::string key;  // the key whose value is being parsed
  };
  std::vector<Level> stack;
  std::string duplicate;  // the first repeated key, as a dotted path
  size_t duplicate_depth = 0;
  auto cb = [&](int /*depth*/, Json::parse_event_t ev, Json& parsed) {
    switch (ev) {
      case Json::parse_event_t::object_start: stack.push_back({true, {}, {}}); break;
      case Json::parse_event_t::array_start: stack.push_back({false, {}, {}}); break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        break;
      case Json::parse_event_t::key: {
        if (stack.empty() || !stack.back().object) break;  // cannot happen: keys occur in objects only
        Level& top = stack.back();
        top.key = parsed.get<std::string>();
        if (!top.keys.insert(top.key).second && duplicate.empty()) {
          for (size_t i = 0; i + 1 < stack.size(); ++i) duplicate += stack[i].object ? stack[i].key + "." : "[].";
          duplicate += top.key;
          duplicate_depth = stack.size();
        }
        break;
      }
      case Json::parse_event_t::value: break;
    }
    return true;
  };
  Json j;
  try {
    j = Json::parse(text.begin(), text.end(), cb);
  } catch (const Json::parse_error& e) {
    // e.byte counts from 1 and points at the last byte read.
    const uint64_t at = e.byte > 0 ? e.byte - 1 : 0;
    throw JsonTextError(Kind::syntax, at, fmt::format("invalid JSON at byte {}: {}", at, explanation(e)));
  } catch (const Json::exception& e) {  // e.g. a number beyond double's range (out_of_range.406)
    throw JsonTextError(Kind::syntax, 0, fmt::format("invalid JSON: {}", explanation(e)));
  }
  if (!duplicate.empty()) {
    JsonTextError e(Kind::duplicate_key, 0,
                    fmt::format("key {} appears more than once in one object (JSON objects must not repeat a key)",
                                excerpt(duplicate)));
    e.key = std::move(duplicate);
    e.key_depth = duplicate_depth;
    throw e;
  }
  return j;
}

std::string_view file_type_name(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFIFO: return "a FIFO (named pipe)";
    case S_IFSOCK: return "a socket";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFLNK: return "a symbolic link";
    default: return "of an unknown file type";
  }
}

std::string_view file_type_name(std::filesystem::file_type type) {
  using T = std::filesystem::file_type;
  switch (type) {
    case T::regular: return file_type_name(S_IFREG);
    case T::directory: return file_type_name(S_IFDIR);
    case T::fifo: return file_type_name(S_IFIFO);
    case T::socket: return file_type_name(S_IFSOCK);
    case T::character: return file_type_name(S_IFCHR);
    case T::block: return file_type_name(S_IFBLK);
    case T::symlink: return file_type_name(S_IFLNK);
    default: return file_type_name(0u);
  }
}

int open_regular_file(const std::filesystem::path& path, uint64_t* size, std::string* why) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer. It is cleared again below,
  // but it changes nothing for regular files anyway.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    *why = fmt::format("cannot open: {}", std::strerror(errno));
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    *why = fmt::format("cannot stat: {}", std::strerror(errno));
    ::close(fd);
    return -1;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = fmt::format("is {}, expected a regular file", file_type_name(st.st_mode));
    ::close(fd);
    return -1;
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

std::string read_regular_file(const std::filesystem::path& path, uint64_t max_bytes, std::string& out,
                              bool* too_large) {
  if (too_large) *too_large = false;
  std::string why;
  uint64_t size = 0;
  const int fd = open_regular_file(path, &size, &why);
  if (fd < 0) return why;
  if (size > max_bytes) {
    ::close(fd);
    if (too_large) *too_large = true;
    return fmt::format("{} bytes, expected at most {}", size, max_bytes);
  }
  out.assign(static_cast<size_t>(size), '\0');
  // The size is from fstat; a file that grows meanwhile is read up to one byte past max_bytes to notice it.
  const uint64_t cap = max_bytes < UINT64_MAX ? max_bytes + 1 : UINT64_MAX;
  size_t done = 0;
  while (true) {
    if (done == out.size()) {
      if (out.size() >= cap) break;
      out.resize(static_cast<size_t>(std::min<uint64_t>(cap, out.size() + 65536)));
    }
    const ssize_t n = ::read(fd, out.data() + done, out.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      why = fmt::format("read failed after {} bytes: {}", done, std::strerror(errno));
      ::close(fd);
      return why;
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  out.resize(done);
  if (done > max_bytes) {
    if (too_large) *too_large = true;
    return fmt::format("more than {} bytes, expected at most {}", max_bytes, max_bytes);
  }
  return {};
}

}  // namespace dp::format
