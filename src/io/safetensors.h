// The safetensors file format: an 8-byte little-endian header length N, N bytes of JSON
// mapping each tensor name to {dtype, shape, data_offsets} (plus an optional "__metadata__"
// string map), then the tensor bytes. Checkpoints come from outside, so a file is validated
// completely when it is opened (every entry, every offset, no gaps or overlaps) and then read
// zero-copy through a read-only memory mapping; a bad file fails with an Error naming the file
// and the tensor instead of yielding garbage weights later. Writes are atomic (temp + rename).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace memtune {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;  // [] for a scalar
  size_t begin = 0, end = 0;   // byte offsets relative to the start of the data buffer

  int64_t numel() const;
  size_t nbytes() const { return end - begin; }
};

// A read-only, memory-mapped safetensors file. Supports the F32, BF16, F16 and I32 dtypes.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Sorted by begin offset, i.e. in file order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr if the file has no tensor of that name.
  const TensorInfo* find(const std::string& name) const;
  // Zero-copy view of a tensor's bytes (valid while this object lives). The bytes are only as
  // aligned as the writer made them: copy them out rather than casting the pointer.
  std::span<const std::byte> data(const TensorInfo& t) const;
  // Drops this process's resident pages of `bytes` (a part of data()): they were read and are
  // not needed again, so loading holds one tensor's pages at a time, not the whole file. Reading
  // them again re-maps them from the file.
  void release(std::span<const std::byte> bytes) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  void parse_header(std::string_view header, size_t data_size);

  std::string path_;
  const std::byte* map_ = nullptr;  // the whole file
  size_t map_size_ = 0;
  size_t data_start_ = 0;  // 8 + header length
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> by_name_;  // index into tensors_
  std::map<std::string, std::string> metadata_;
};

struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // numel() * dtype_size(dtype) bytes, in dtype
  // Instead of data: fills `out` with the bytes at `offset` of the tensor's data, called slice by
  // slice while the file is written (tensors in memory the writer cannot read directly).
  std::function<void(size_t offset, std::span<std::byte> out)> fetch = nullptr;

  int64_t numel() const;
  size_t nbytes() const;
};

// Writes a safetensors file atomically (temp file in the same directory, fsync, rename), the
// tensors laid out back to back in the given order; the header is padded with spaces so the
// data starts 8-byte aligned. `metadata` becomes "__metadata__" when non-empty.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `contents` to `path` with the same temp-file-and-rename atomicity.
void write_file_atomically(const std::string& path, std::string_view contents);

// Creates `dir` and its parents; an Error naming `what` (e.g. "--output_dir") and the reason
// when it cannot.
void create_directory(const std::string& dir, std::string_view what);

// A shape as error messages show it: "[2, 3]", "[]" for a scalar.
std::string shape_string(std::span<const int64_t> shape);

}  // namespace memtune
