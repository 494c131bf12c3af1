// safetensors reader (mmap + full validation of the header against the file) and atomic
// writer. Every failure caused by the file's contents is an Error that starts with the path
// and names the tensor or field at fault.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/error.h"
#include "core/json_reader.h"

namespace memtune {
namespace {

using nlohmann::json;

// A header larger than this is taken as corruption rather than allocated and parsed.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

std::string errno_text() {
  return std::strerror(errno);
}

// Element count of a shape, saturating at the uint64 maximum: callers compare it with a byte
// count from the file, so an overflowing shape reads as "too large for the data".
uint64_t saturating_numel(std::span<const int64_t> shape) {
  uint64_t n = 1;
  for (int64_t d : shape)
    if (d == 0) return 0;
  for (int64_t d : shape) {
    auto ud = static_cast<uint64_t>(d);
    if (n > std::numeric_limits<uint64_t>::max() / ud) return std::numeric_limits<uint64_t>::max();
    n *= ud;
  }
  return n;
}

uint64_t saturating_bytes(uint64_t numel, DType dtype) {
  uint64_t size = dtype_size(dtype);
  return numel > std::numeric_limits<uint64_t>::max() / size ? std::numeric_limits<uint64_t>::max() : numel * size;
}

// A file written under a temporary name next to its destination and renamed over it only once
// complete, so a reader never sees a half-written file. Unlinks the temp file if not committed.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(const std::string& path) : path_(path) {
    static std::atomic<uint64_t> counter{0};
    for (;;) {
      tmp_ = path + ".tmp." + std::to_string(getpid()) + "." + std::to_string(counter++);
      fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd_ >= 0) return;
      if (errno != EEXIST && errno != EINTR) throw Error(path + ": cannot create file: " + errno_text());
    }
  }
  ~AtomicFileWriter() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, size_t n) {
    auto* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::write(fd_, p, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        throw Error(path_ + ": write failed: " + errno_text());
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
  }

  void commit() {
    if (::fsync(fd_) != 0) throw Error(path_ + ": fsync failed: " + errno_text());
    int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) throw Error(path_ + ": close failed: " + errno_text());
    if (::rename(tmp_.c_str(), path_.c_str()) != 0)
      throw Error(path_ + ": cannot rename temp file into place: " + errno_text());
    committed_ = true;
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace

int64_t TensorInfo::numel() const {
  // The header was checked: numel * dtype size == end - begin, so the count fits (a shape such as
  // [2^62, 2^62, 0] has none, and must not be multiplied out in int64).
  const uint64_t n = saturating_numel(shape);
  MT_ASSERT(n <= end - begin, "tensor " + name + " has a shape its data does not cover");
  return static_cast<int64_t>(n);
}

int64_t TensorToWrite::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) {
    MT_ASSERT(d >= 0, "tensor " + name + " has a negative dimension");
    n *= d;
  }
  return n;
}

size_t TensorToWrite::nbytes() const {
  return static_cast<size_t>(numel()) * dtype_size(dtype);
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(path + ": cannot open safetensors file: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string why = errno_text();
    ::close(fd);
    throw Error(path + ": cannot stat: " + why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": not a regular file");
  }
  auto size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    throw Error(path + ": file is " + std::to_string(size) +
                " bytes, too short for a safetensors file (needs at least the 8-byte header length)");
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  std::string why = m == MAP_FAILED ? errno_text() : "";
  ::close(fd);
  if (m == MAP_FAILED) throw Error(path + ": cannot memory-map file: " + why);
  map_ = static_cast<const std::byte*>(m);
  map_size_ = size;

  try {
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = header_len << 8 | std::to_integer<uint64_t>(map_[i]);
    if (header_len > kMaxHeaderBytes)
      throw Error(path + ": header length " + std::to_string(header_len) + " exceeds the " +
                  std::to_string(kMaxHeaderBytes) + "-byte limit (corrupt or not a safetensors file)");
    if (header_len > size - 8)
      throw Error(path + ": header length " + std::to_string(header_len) + " runs past the end of the file (" +
                  std::to_string(size) + " bytes; truncated?)");
    data_start_ = 8 + static_cast<size_t>(header_len);
    parse_header(std::string_view(reinterpret_cast<const char*>(map_) + 8, header_len), size - data_start_);
  } catch (...) {
    ::munmap(const_cast<std::byte*>(map_), map_size_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  ::munmap(const_cast<std::byte*>(map_), map_size_);
}

void SafetensorsFile::parse_header(std::string_view header, size_t data_size) {
  // Starting with '{' and parsing means the header is an object.
  if (header.empty() || header.front() != '{')
    throw Error(path_ + ": header is not a JSON object (does not start with '{'; not a safetensors file?)");

  // nlohmann keeps the last of duplicate keys silently; the format forbids duplicates.
  const json doc = parse_json(header, path_ + ": header", DuplicateKeys::Refuse);

  if (const std::optional<JsonReader> metadata = JsonReader(doc, path_).optional_object("__metadata__"))
    metadata->for_each_entry(
        [&](const std::string& key, const JsonReader& value) { metadata_[key] = value.as_string(); });

  for (const auto& [name, entry_json] : doc.items()) {
    if (name == "__metadata__") continue;
    const JsonReader entry(entry_json, path_ + ": tensor \"" + name + "\"");
    entry.as_object();

    TensorInfo t;
    t.name = name;
    const std::string dt = entry.string("dtype");
    if (dt == "F32")
      t.dtype = DType::F32;
    else if (dt == "BF16")
      t.dtype = DType::BF16;
    else if (dt == "F16")
      t.dtype = DType::F16;
    else if (dt == "I32")  // GPTQ / AWQ packed weights and group indices
      t.dtype = DType::I32;
    else
      entry.fail("dtype", dt + " not supported (supported: F32, BF16, F16, I32)");

    const JsonReader shape = entry.array("shape");
    for (size_t i = 0; i < shape.size(); ++i) t.shape.push_back(shape[i].as_integer(0));

    const JsonReader offsets = entry.array("data_offsets");
    const std::string offsets_text = json_excerpt(offsets.value());
    if (offsets.size() != 2) offsets.fail("expected [begin, end], got " + offsets_text);
    const auto begin = static_cast<uint64_t>(offsets[0].as_integer(0));
    const auto end = static_cast<uint64_t>(offsets[1].as_integer(0));
    if (begin > end) offsets.fail(offsets_text + " end before they begin");
    if (end > data_size)
      offsets.fail(offsets_text + " run past the end of the " + std::to_string(data_size) +
                   "-byte data buffer (truncated file?)");
    uint64_t expected = saturating_bytes(saturating_numel(t.shape), t.dtype);
    if (expected != end - begin)
      entry.fail(dt + " shape " + shape_string(t.shape) + " needs " + std::to_string(expected) +
                 " bytes but data_offsets " + offsets_text + " cover " + std::to_string(end - begin));
    t.begin = static_cast<size_t>(begin);
    t.end = static_cast<size_t>(end);
    tensors_.push_back(std::move(t));
  }

  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  size_t covered = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const TensorInfo& t = tensors_[i];
    if (t.begin < covered)
      throw Error(path_ + ": tensor \"" + t.name + "\" overlaps tensor \"" + tensors_[i - 1].name + "\" (bytes " +
                  std::to_string(t.begin) + " to " + std::to_string(covered) + ")");
    if (t.begin > covered)
      throw Error(path_ + ": bytes " + std::to_string(covered) + " to " + std::to_string(t.begin) +
                  " of the data buffer belong to no tensor (gap before tensor \"" + t.name + "\")");
    covered = t.end;
    by_name_[t.name] = i;
  }
  if (covered != data_size)
    throw Error(path_ + ": the data buffer has " + std::to_string(data_size) + " bytes but the tensors cover only " +
                std::to_string(covered) + " (trailing bytes)");
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

std::span<const std::byte> SafetensorsFile::data(const TensorInfo& t) const {
  MT_ASSERT(t.begin <= t.end && data_start_ + t.end <= map_size_, "tensor " + t.name + " is not from " + path_);
  return {map_ + data_start_ + t.begin, t.nbytes()};
}

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  size_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    const std::string where = path + ": tensor \"" + t.name + "\": ";
    if (t.name == "__metadata__") throw Error(where + "the name is reserved by the format");
    if (header.contains(t.name)) throw Error(where + "given more than once");
    for (int64_t d : t.shape)
      if (d < 0) throw Error(where + "negative dimension in shape " + shape_string(t.shape));
    size_t n = t.nbytes();
    if (n > 0 && t.data == nullptr && !t.fetch) throw Error(where + "no data");
    header[t.name] = {
        {"dtype", dtype_safetensors_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;

  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::type_error& e) {
    throw Error(path + ": a tensor name or metadata string is not valid UTF-8 (" + e.what() + ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * i));

  AtomicFileWriter out(path);
  out.write(len, sizeof len);
  out.write(text.data(), text.size());
  std::vector<std::byte> slice;
  for (const TensorToWrite& t : tensors) {
    if (t.data) {
      out.write(t.data, t.nbytes());
      continue;
    }
    constexpr size_t kSliceBytes = size_t{8} << 20;
    slice.resize(std::min(kSliceBytes, t.nbytes()));
    for (size_t offset = 0; offset < t.nbytes(); offset += slice.size()) {
      const std::span<std::byte> part(slice.data(), std::min(slice.size(), t.nbytes() - offset));
      t.fetch(offset, part);
      out.write(part.data(), part.size());
    }
  }
  out.commit();
}

std::string shape_string(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void create_directory(const std::string& dir, std::string_view what) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error(fmt::format("{} {}: cannot create the directory: {}", what, dir, ec.message()));
}

void write_file_atomically(const std::string& path, std::string_view contents) {
  AtomicFileWriter out(path);
  out.write(contents.data(), contents.size());
  out.commit();
}

void SafetensorsFile::release(std::span<const std::byte> bytes) const {
  // Only the pages wholly inside the range: a page shared with a neighbouring tensor stays.
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(bytes.data()) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(bytes.data()) + bytes.size()) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

}  // namespace memtune
