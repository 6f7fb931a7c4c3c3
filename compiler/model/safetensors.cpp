#include "model/safetensors.h"

#include <algorithm>
#include <set>
#include <tuple>

#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"

namespace fs = std::filesystem;

namespace dp::st {
namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

// Untrusted text (tensor names, JSON excerpts) goes into messages escaped and bounded, so that a
// hostile header cannot forge extra lines, emit malformed UTF-8 or flood the terminal.
std::string printable(std::string_view s, size_t max = format::kExcerptMax) { return format::excerpt(s, max); }

// A JSON value as it appears in a message: its type and (a bounded excerpt of) its text.
std::string describe(const Json& v) {
  return fmt::format("{} ({})", json_type_name(v),
                     printable(v.dump(-1, ' ', false, Json::error_handler_t::replace), 60));
}

std::string dtype_list() {
  std::string out;
  for (int i = 0; i <= static_cast<int>(DType::F8_E8M0); ++i) {
    if (i) out += ", ";
    out += dtype_name(static_cast<DType>(i));
  }
  return out;
}

// Parses JSON within the limits of format/untrusted.h (at most `max_bytes`, nesting depth 64) and
// rejects duplicate keys at any depth: nlohmann (like most DOM parsers) silently keeps one of two equal
// keys, which would let a header list one tensor name twice and hide a byte range. `what` names the
// document in messages ("header", "index"), `byte_base` is where it starts in the file, and `top_noun`,
// when given, names what a top-level key is ("tensor") for a clearer duplicate message.
Json parse_unique_keys(std::string_view text, const std::string& where, std::string_view what, uint64_t max_bytes,
                       size_t byte_base = 0, std::string_view top_noun = {}) {
  using Kind = format::JsonTextError::Kind;
  try {
    return format::parse_json_text(text, format::JsonLimits{max_bytes});
  } catch (const format::JsonTextError& e) {
    switch (e.kind) {
      case Kind::too_large: fail(Errc::input, "{}: {} is {}", where, what, e.what());
      case Kind::too_deep:
        fail(Errc::input, "{}: {} nests arrays and objects deeper than {} levels (at byte {} of the file)", where,
             what, format::kMaxJsonDepth, byte_base + e.offset);
      case Kind::syntax: {
        // The text after "invalid JSON at byte N: " is nlohmann's explanation, already excerpted.
        std::string msg = e.what();
        if (auto p = msg.find(": "); p != std::string::npos) msg = msg.substr(p + 2);
        fail(Errc::input, "{}: {} is not valid JSON (error at byte {} of the file): {}", where, what,
             byte_base + e.offset, msg);
      }
      case Kind::duplicate_key:
        if (e.key_depth == 1 && !top_noun.empty() && e.key != "__metadata__")
          fail(Errc::input, "{}: {} {} appears more than once in the {} (JSON objects must not repeat a key)", where,
               top_noun, printable(e.key), what);
        fail(Errc::input, "{}: {} key {} appears more than once (JSON objects must not repeat a key)", where, what,
             printable(e.key));
    }
    throw;
  }
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }

// One tensor entry of the header, validated on its own (ranges against each other come later).
TensorInfo parse_entry(const std::string& name, const Json& v, const std::string& where, uint64_t data_start,
                       uint64_t data_size) {
  const std::string tn = printable(name);
  if (!v.is_object())
    fail(Errc::input, "{}: tensor {} is {}, expected an object with dtype, shape and data_offsets", where, tn,
         describe(v));
  TensorInfo t;
  t.name = name;

  // dtype
  auto it = v.find("dtype");
  if (it == v.end())
    fail(Errc::input, "{}: tensor {}: missing field dtype (expected one of {})", where, tn, dtype_list());
  if (!it->is_string())
    fail(Errc::input, "{}: tensor {}: field dtype is {}, expected a string (one of {})", where, tn, describe(*it),
         dtype_list());
  const std::string& dt = it->get_ref<const std::string&>();
  auto dtype = dtype_from_name(dt);
  if (!dtype)
    fail(Errc::input, "{}: tensor {}: dtype \"{}\" is not supported (expected one of {})", where, tn, printable(dt),
         dtype_list());
  t.dtype = *dtype;

  // shape: non-negative integers that fit int64, product overflow-checked.
  it = v.find("shape");
  if (it == v.end())
    fail(Errc::input, "{}: tensor {}: missing field shape (expected a list of non-negative integers)", where, tn);
  if (!it->is_array())
    fail(Errc::input, "{}: tensor {}: field shape is {}, expected a list of non-negative integers", where, tn,
         describe(*it));
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& d = (*it)[i];
    if (d.is_number_integer() && !d.is_number_unsigned())  // nlohmann stores only negatives as signed
      fail(Errc::input, "{}: tensor {}: shape[{}] is {}, expected a non-negative integer", where, tn, i,
           d.get<int64_t>());
    if (!d.is_number_unsigned())
      fail(Errc::input, "{}: tensor {}: shape[{}] is {}, expected a non-negative integer", where, tn, i, describe(d));
    uint64_t u = d.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX))
      fail(Errc::input, "{}: tensor {}: shape[{}] is {}, expected at most {}", where, tn, i, u, INT64_MAX);
    t.shape.push_back(static_cast<int64_t>(u));
  }
  // A 0 dim anywhere makes an empty tensor, whatever the other dims multiply to.
  uint64_t numel = 1;
  bool numel_overflow = false;
  if (std::find(t.shape.begin(), t.shape.end(), 0) != t.shape.end())
    numel = 0;
  else
    for (int64_t d : t.shape) numel_overflow = numel_overflow || mul_overflows(numel, static_cast<uint64_t>(d), &numel);
  const std::string shp = shape_string(t.shape);
  if (numel_overflow)
    fail(Errc::input, "{}: tensor {}: shape {} has more elements than fit in 64 bits", where, tn, shp);
  uint64_t bytes = 0;
  if (mul_overflows(numel, dtype_size(t.dtype), &bytes))
    fail(Errc::input, "{}: tensor {}: shape {} x {} {} bytes is more bytes than fit in 64 bits", where, tn, shp,
         dtype_name(t.dtype), dtype_size(t.dtype));

  // data_offsets: [begin, end) relative to the data section.
  it = v.find("data_offsets");
  if (it == v.end()) fail(Errc::input, "{}: tensor {}: missing field data_offsets (expected [begin, end])", where, tn);
  if (!it->is_array() || it->size() != 2 || !(*it)[0].is_number_unsigned() || !(*it)[1].is_number_unsigned())
    fail(Errc::input, "{}: tensor {}: field data_offsets is {}, expected [begin, end] with two non-negative integers",
         where, tn, describe(*it));
  uint64_t begin = (*it)[0].get<uint64_t>(), end = (*it)[1].get<uint64_t>();
  if (begin > end)
    fail(Errc::input, "{}: tensor {}: data_offsets [{}, {}) has begin {} > end {}, expected begin <= end", where, tn,
         begin, end, begin, end);
  if (end > data_size)
    fail(Errc::input,
         "{}: tensor {}: data_offsets [{}, {}) end beyond the file: end {} > data section size {} (file size {}, "
         "data starts at byte {})",
         where, tn, begin, end, end, data_size, data_start + data_size, data_start);
  if (end - begin != bytes)
    fail(Errc::input, "{}: tensor {}: data_offsets [{}, {}) hold {} bytes, expected {} (shape {} x {} {} bytes)", where,
         tn, begin, end, end - begin, bytes, shp, dtype_name(t.dtype), dtype_size(t.dtype));
  t.offset = data_start + begin;
  t.size = bytes;
  return t;
}

}  // namespace

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::string shape_string(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Header parse_header(std::span<const uint8_t> file, const std::string& where) {
  if (file.size() < 8)
    fail(Errc::input, "{}: file is {} bytes, expected at least 8 (the header length of a safetensors file)", where,
         file.size());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | file[static_cast<size_t>(i)];  // little endian
  if (n > kMaxHeaderSize)
    fail(Errc::input, "{}: header length {} (bytes 0-7) exceeds the limit of {} bytes", where, n, kMaxHeaderSize);
  if (n > file.size() - 8)
    fail(Errc::input, "{}: header length {} (bytes 0-7) runs past the end of the file: 8 + {} > file size {}", where, n,
         n, file.size());

  Header h;
  h.data_start = 8 + n;
  const uint64_t data_size = file.size() - h.data_start;
  std::string_view text(reinterpret_cast<const char*>(file.data() + 8), n);
  // nlohmann rejects malformed UTF-8 inside strings and any non-ASCII byte outside them, so a parsed
  // header is valid UTF-8.
  Json j = parse_unique_keys(text, where, "header", kMaxHeaderSize, 8, "tensor");
  if (!j.is_object()) fail(Errc::input, "{}: header is {}, expected a JSON object", where, describe(j));

  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object())
        fail(Errc::input, "{}: __metadata__ is {}, expected an object of strings", where, describe(*it));
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string())
          fail(Errc::input, "{}: __metadata__ key {} is {}, expected a string", where, printable(m.key()),
               describe(*m));
        h.metadata.emplace(m.key(), m->get<std::string>());
      }
      continue;
    }
    h.tensors.push_back(parse_entry(it.key(), it.value(), where, h.data_start, data_size));
  }

  // The ranges must tile the data section exactly: sorted by (begin, end), each must start where the
  // previous one ended. Zero-byte tensors sit between neighbours at the shared boundary.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return std::tie(a.offset, a.size, a.name) < std::tie(b.offset, b.size, b.name);
  });
  auto rel = [&](const TensorInfo& t) { return std::pair(t.offset - h.data_start, t.offset - h.data_start + t.size); };
  uint64_t next = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : h.tensors) {
    auto [b, e] = rel(t);
    if (b < next)
      fail(Errc::input,
           "{}: tensor {}: data_offsets [{}, {}) overlap tensor {} data_offsets [{}, {}), expected begin {}", where,
           printable(t.name), b, e, printable(prev->name), rel(*prev).first, rel(*prev).second, next);
    if (b > next) {
      if (prev)
        fail(Errc::input,
             "{}: data bytes [{}, {}) between tensor {} (ends at {}) and tensor {} (begins at {}) belong to no "
             "tensor (the data section must be covered without holes)",
             where, next, b, printable(prev->name), next, printable(t.name), b);
      fail(Errc::input,
           "{}: data bytes [0, {}) before tensor {} (begins at {}) belong to no tensor (the data section must be "
           "covered without holes, starting at 0)",
           where, b, printable(t.name), b);
    }
    next = e;
    prev = &t;
  }
  if (next != data_size) {
    if (prev)
      fail(Errc::input,
           "{}: data bytes [{}, {}) after tensor {} (ends at {}) belong to no tensor (data section is {} bytes, "
           "expected {})",
           where, next, data_size, printable(prev->name), next, data_size, next);
    fail(Errc::input, "{}: data section holds {} bytes but the header lists no tensor, expected 0 bytes", where,
         data_size);
  }
  return h;
}

// Checkpoint -----------------------------------------------------------------------------------------

bool Checkpoint::present(const fs::path& dir) {
  std::error_code ec;
  if (path_exists(dir / kIndexName) || path_exists(dir / kSingleName)) return true;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".safetensors" && e.path().filename().string()[0] != '.') return true;
  if (ec) fail(Errc::io, "{}: cannot list directory: {}", dir.string(), ec.message());
  return false;
}

void Checkpoint::add_shard(const fs::path& path) {
  MappedFile mf(path);
  Header h = parse_header(mf.bytes(), path.string());
  const size_t file = files_.size();
  for (TensorInfo& t : h.tensors) {
    t.file = file;
    auto [pos, inserted] = by_name_.emplace(t.name, tensors_.size());
    if (!inserted)
      fail(Errc::input, "{}: tensor {} is also in {} (a tensor name must appear in one shard only)", path.string(),
           printable(t.name), paths_[tensors_[pos->second].file].string());
    tensors_.push_back(std::move(t));
  }
  files_.push_back(std::move(mf));
  paths_.push_back(path);
}

Checkpoint Checkpoint::open(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    fail(Errc::io, "{}: not a directory (expected a model checkpoint directory)", dir.string());
  Checkpoint cp;
  cp.dir_ = dir;

  const fs::path index = dir / kIndexName;
  if (path_exists(index)) {
    cp.index_path_ = index;
    const std::string where = index.string();
    Json j = parse_unique_keys(read_text_file(index, format::kMaxIndexBytes), where, "index", format::kMaxIndexBytes);
    if (!j.is_object()) fail(Errc::input, "{}: top level is {}, expected a JSON object", where, describe(j));
    auto wm = j.find("weight_map");
    if (wm == j.end())
      fail(Errc::input, "{}: missing field weight_map (expected an object {{tensor: shard file}})", where);
    if (!wm->is_object())
      fail(Errc::input, "{}: field weight_map is {}, expected an object {{tensor: shard file}}", where, describe(*wm));
    std::map<std::string, std::string> map;
    std::set<std::string> shards;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it->is_string())
        fail(Errc::input, "{}: weight_map.{} is {}, expected a shard file name", where, printable(it.key()),
             describe(*it));
      const std::string& shard = it->get_ref<const std::string&>();
      // Shards are plain names inside the checkpoint directory; anything else could reach outside it.
      if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos ||
          shard.find('\\') != std::string::npos)
        fail(Errc::input, "{}: weight_map.{} is \"{}\", expected a file name inside {} (no directory part)", where,
             printable(it.key()), printable(shard), dir.string());
      map.emplace(it.key(), shard);
      shards.insert(shard);
    }
    for (const std::string& s : shards) cp.add_shard(dir / s);
    for (const auto& [name, shard] : map) {
      const TensorInfo* t = cp.find(name);
      if (!t)
        fail(Errc::input, "{}: weight_map maps tensor {} to {}, but {} has no tensor of that name", where,
             printable(name), shard, (dir / shard).string());
      if (cp.paths_[t->file].filename() != shard)
        fail(Errc::input, "{}: weight_map maps tensor {} to {}, but it is in {}", where, printable(name), shard,
             cp.paths_[t->file].string());
    }
    for (const TensorInfo& t : cp.tensors_)
      if (!map.count(t.name))
        fail(Errc::input, "{}: tensor {} is not listed in {} weight_map (expected every shard tensor listed)",
             cp.paths_[t.file].string(), printable(t.name), where);
    return cp;
  }

  if (path_exists(dir / kSingleName)) {
    cp.add_shard(dir / kSingleName);
    return cp;
  }

  std::vector<fs::path> found;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string fn = e.path().filename().string();
    // Dot files are skipped: they are write_file_atomic's temporaries or editor/OS litter.
    if (e.path().extension() == ".safetensors" && fn[0] != '.') found.push_back(e.path());
  }
  if (ec) fail(Errc::io, "{}: cannot list directory: {}", dir.string(), ec.message());
  if (found.empty())
    fail(Errc::input, "{}: no {}, {} or *.safetensors file (expected a safetensors checkpoint)", dir.string(),
         kIndexName, kSingleName);
  std::sort(found.begin(), found.end());
  for (const fs::path& p : found) cp.add_shard(p);
  return cp;
}

const TensorInfo* Checkpoint::find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> Checkpoint::data(const TensorInfo& t) const {
  if (t.file >= files_.size() || t.offset > files_[t.file].size() || t.size > files_[t.file].size() - t.offset)
    fail(Errc::internal, "tensor {}: range [{}, +{}) of file #{} is not part of checkpoint {}", t.name, t.offset,
         t.size, t.file, dir_.string());
  return files_[t.file].bytes().subspan(t.offset, t.size);
}

const fs::path& Checkpoint::file_path(size_t file) const {
  if (file >= paths_.size())
    fail(Errc::internal, "checkpoint {}: file #{} requested, it has {}", dir_.string(), file, paths_.size());
  return paths_[file];
}

// Writing ------------------------------------------------------------------------------------------

std::string serialize(const std::vector<TensorData>& tensors, const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorData& t : tensors) {
    if (t.name == "__metadata__")
      fail(Errc::internal, "safetensors writer: tensor name __metadata__ is reserved for the metadata object");
    if (header.contains(t.name))
      fail(Errc::internal, "safetensors writer: tensor {} is given twice", printable(t.name));
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0 || mul_overflows(numel, static_cast<uint64_t>(d), &numel))
        fail(Errc::internal, "safetensors writer: tensor {}: invalid shape {}", printable(t.name),
             shape_string(t.shape));
    }
    uint64_t bytes = 0;
    if (mul_overflows(numel, dtype_size(t.dtype), &bytes) || bytes != t.bytes.size())
      fail(Errc::internal, "safetensors writer: tensor {}: {} bytes given, expected {} (shape {} x {} {} bytes)",
           printable(t.name), t.bytes.size(), bytes, shape_string(t.shape), dtype_name(t.dtype), dtype_size(t.dtype));
    header[t.name] = {
        {"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text;
  try {
    text = header.dump(-1, ' ', false, Json::error_handler_t::strict);
  } catch (const Json::exception& e) {
    fail(Errc::internal, "safetensors writer: cannot serialise the header: {}", e.what());
  }
  // Spaces are JSON whitespace, so the padded header still parses; the data section then starts at a
  // multiple of 8 and every tensor of an 8-byte-multiple size stays naturally aligned when mapped.
  text.append((8 - text.size() % 8) % 8, ' ');

  std::string out;
  out.reserve(8 + text.size() + offset);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((text.size() >> (8 * i)) & 0xff));
  out += text;
  for (const TensorData& t : tensors) out.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  return out;
}

void write_file(const fs::path& path, const std::vector<TensorData>& tensors,
                const std::map<std::string, std::string>& metadata) {
  write_file_atomic(path, serialize(tensors, metadata));
}

void write_index(const fs::path& dir, const std::map<std::string, std::string>& weight_map, uint64_t total_size) {
  Json j = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
  write_file_atomic(dir / kIndexName, j.dump(2) + "\n");
}

}  // namespace dp::st
