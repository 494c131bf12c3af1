// Reading and writing Hugging Face checkpoint directories (single file or index + shards).
// The index is cross-checked against the shards on open, so a missing shard, a tensor the
// index promises but its shard lacks, or a wrong total_size fails at load time with the file
// named, not halfway through training.
#include "io/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/error.h"
#include "core/json_reader.h"

namespace memtune {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::string join(const std::string& dir, const std::string& name) {
  return (fs::path(dir) / name).string();
}

// transformers' shard naming: model-00001-of-00003.safetensors.
std::string shard_name(size_t index, size_t count) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", index, count);
  return buf;
}

bool is_shard_name(const std::string& s) {
  const std::string_view v(s);
  auto digits = [&](size_t pos) {
    return std::all_of(v.begin() + static_cast<std::ptrdiff_t>(pos), v.begin() + static_cast<std::ptrdiff_t>(pos + 5),
                       [](char c) { return c >= '0' && c <= '9'; });
  };
  return v.size() == 32 && v.starts_with("model-") && digits(6) && v.substr(11, 4) == "-of-" && digits(15) &&
         v.ends_with(".safetensors");
}

void remove_file(const std::string& path) {
  std::error_code ec;
  fs::remove(path, ec);
  if (ec) throw Error(path + ": cannot remove stale checkpoint file: " + ec.message());
}

void rename_file(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0)
    throw Error(to + ": cannot rename " + from + " into place: " + std::strerror(errno));
}

// Removes shard-named files of an earlier write that the new checkpoint does not use.
void remove_stale_shards(const std::string& dir, const std::set<std::string>& keep) {
  std::error_code ec;
  std::vector<std::string> stale;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (is_shard_name(name) && !keep.contains(name)) stale.push_back(e.path().string());
  }
  if (ec) throw Error(dir + ": cannot list checkpoint directory: " + ec.message());
  for (const std::string& path : stale) remove_file(path);
}

// Makes the renames durable: a crash after write_checkpoint returns keeps the new files.
void sync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(dir + ": cannot open directory to sync it: " + std::strerror(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) throw Error(dir + ": cannot sync directory: " + std::strerror(err));
}

}  // namespace

CheckpointReader::CheckpointReader(const std::string& dir) : dir_(dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw Error(dir + ": checkpoint directory does not exist or is not a directory");
  const std::string single = join(dir, kSingleFile), index = join(dir, kIndexFile);
  if (fs::exists(single, ec)) {
    files_.push_back(std::make_unique<SafetensorsFile>(single));
    for (const TensorInfo& t : files_.back()->tensors()) tensors_[t.name] = {files_.back().get(), &t};
  } else if (fs::exists(index, ec)) {
    open_index(index);
  } else {
    throw Error(dir + ": no checkpoint found: expected " + kSingleFile + ", or " + kIndexFile + " with its shards");
  }
}

void CheckpointReader::open_index(const std::string& index_path) {
  const json document = read_json_file(index_path);
  const JsonReader index(document, index_path);
  index.as_object();

  std::map<std::string, const SafetensorsFile*> shards;
  uint64_t total = 0;
  index.object("weight_map").for_each_entry([&](const std::string& name, const JsonReader& file) {
    if (!file.value().is_string()) file.fail("expected a shard file name, got " + json_excerpt(file.value()));
    const std::string shard = file.as_string();
    if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos)
      file.fail("\"" + shard + "\" is not a plain file name in the checkpoint directory");
    auto it = shards.find(shard);
    if (it == shards.end()) {
      const std::string path = join(dir_, shard);
      std::error_code ec;
      if (!fs::exists(path, ec)) file.fail("shard " + path + " does not exist");
      files_.push_back(std::make_unique<SafetensorsFile>(path));
      it = shards.emplace(shard, files_.back().get()).first;
    }
    const TensorInfo* t = it->second->find(name);
    if (t == nullptr) file.fail("shard " + it->second->path() + " has no tensor \"" + name + "\"");
    tensors_[name] = {it->second, t};
    total += t->nbytes();
  });

  const std::optional<JsonReader> metadata = index.optional_object("metadata");
  const std::optional<int64_t> total_size = metadata ? metadata->optional_integer("total_size", 0) : std::nullopt;
  if (total_size && static_cast<uint64_t>(*total_size) != total)
    metadata->fail("total_size is " + std::to_string(*total_size) + " but the tensors in weight_map hold " +
                   std::to_string(total) + " bytes");
}

std::vector<std::string> CheckpointReader::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, e] : tensors_) names.push_back(name);
  return names;
}

bool CheckpointReader::contains(const std::string& name) const {
  return tensors_.contains(name);
}

const CheckpointReader::Entry& CheckpointReader::entry(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw Error(dir_ + ": checkpoint has no tensor \"" + name + "\"");
  return it->second;
}

const TensorInfo& CheckpointReader::info(const std::string& name) const {
  return *entry(name).info;
}

const SafetensorsFile& CheckpointReader::file_of(const std::string& name) const {
  return *entry(name).file;
}

void CheckpointReader::read_into(const std::string& name, std::span<const int64_t> expected_shape, void* dst,
                                 DType dst_dtype, size_t begin, size_t count) const {
  const Entry& e = entry(name);
  const TensorInfo& t = *e.info;
  if (!std::equal(t.shape.begin(), t.shape.end(), expected_shape.begin(), expected_shape.end()))
    throw Error(dir_ + ": tensor \"" + name + "\" in " + e.file->path() + " has shape " + shape_string(t.shape) +
                ", expected " + shape_string(expected_shape));
  if ((t.dtype == DType::I32) != (dst_dtype == DType::I32))
    throw Error(dir_ + ": tensor \"" + name + "\" in " + e.file->path() + " is " +
                std::string(dtype_safetensors_name(t.dtype)) + ", expected " +
                (dst_dtype == DType::I32 ? std::string("I32") : std::string("a floating dtype (F32, BF16, F16)")));
  const size_t numel = static_cast<size_t>(t.numel());
  MT_ASSERT(begin <= numel, "read_into range starts past the tensor");
  count = std::min(count, numel - begin);
  std::span<const std::byte> src = e.file->data(t).subspan(begin * dtype_size(t.dtype), count * dtype_size(t.dtype));
  if (src.empty()) return;
  struct Release {  // the file's pages of this tensor are dropped once copied
    const SafetensorsFile& file;
    std::span<const std::byte> bytes;
    ~Release() { file.release(bytes); }
  } release{*e.file, src};
  if (t.dtype == dst_dtype) {
    std::memcpy(dst, src.data(), src.size());
    return;
  }
  const size_t src_size = dtype_size(t.dtype), dst_size = dtype_size(dst_dtype);
  MT_ASSERT(reinterpret_cast<uintptr_t>(dst) % dst_size == 0, "read_into destination is misaligned");
  // The conversion routines read elements through typed pointers, so source bytes that the
  // file did not align are first copied to an aligned buffer; BF16<->F16 goes through F32.
  const bool src_aligned = reinterpret_cast<uintptr_t>(src.data()) % src_size == 0;
  const size_t n = count;
  const size_t chunk = std::min<size_t>(n, size_t{1} << 20);
  std::vector<float> aligned_src(src_aligned ? 0 : chunk);
  std::vector<float> f32(dst_dtype != DType::F32 && t.dtype != DType::F32 ? chunk : 0);
  for (size_t i = 0; i < n; i += chunk) {
    const size_t m = std::min(chunk, n - i);
    const void* in = src.data() + i * src_size;
    if (!src_aligned) in = std::memcpy(aligned_src.data(), in, m * src_size);
    void* out = static_cast<std::byte*>(dst) + i * dst_size;
    if (dst_dtype == DType::F32) {
      convert_to_f32(in, t.dtype, static_cast<float*>(out), m);
    } else if (t.dtype == DType::F32) {
      convert_from_f32(static_cast<const float*>(in), out, dst_dtype, m);
    } else {
      convert_to_f32(in, t.dtype, f32.data(), m);
      convert_from_f32(f32.data(), out, dst_dtype, m);
    }
  }
}

void write_checkpoint(const std::string& dir, const std::vector<TensorToWrite>& tensors, size_t max_shard_bytes) {
  if (max_shard_bytes == 0) throw Error(dir + ": checkpoint shard size limit must be positive");
  std::set<std::string> names;
  for (const TensorToWrite& t : tensors) {
    if (!names.insert(t.name).second) throw Error(dir + ": tensor \"" + t.name + "\" given more than once");
    if (std::any_of(t.shape.begin(), t.shape.end(), [](int64_t d) { return d < 0; }))
      throw Error(dir + ": tensor \"" + t.name + "\": negative dimension in shape " + shape_string(t.shape));
  }
  create_directory(dir, "checkpoint");

  std::vector<std::vector<TensorToWrite>> shards(1);
  size_t shard_bytes = 0;
  uint64_t total = 0;
  for (const TensorToWrite& t : tensors) {
    const size_t n = t.nbytes();
    if (!shards.back().empty() && shard_bytes + n > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(t);
    shard_bytes += n;
    total += n;
  }
  const std::map<std::string, std::string> metadata{{"format", "pt"}};
  const std::string single = join(dir, kSingleFile), index = join(dir, kIndexFile);

  if (shards.size() == 1) {
    // model.safetensors takes precedence over an index, so the checkpoint is the new one as
    // soon as the rename inside write_safetensors lands; the old index and shards go after.
    write_safetensors(single, tensors, metadata);
    remove_file(index);
    remove_stale_shards(dir, {});
    sync_directory(dir);
    return;
  }

  std::vector<std::string> finals, staged;
  json weight_map = json::object();
  for (size_t i = 0; i < shards.size(); ++i) {
    finals.push_back(shard_name(i + 1, shards.size()));
    staged.push_back(join(dir, finals.back() + ".staged"));
    for (const TensorToWrite& t : shards[i]) weight_map[t.name] = finals.back();
  }
  const std::string staged_index = index + ".staged";
  try {
    for (size_t i = 0; i < shards.size(); ++i) write_safetensors(staged[i], shards[i], metadata);
    json doc = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    write_file_atomically(staged_index, doc.dump(2) + "\n");
  } catch (...) {
    for (const std::string& path : staged) ::unlink(path.c_str());
    throw;
  }
  // Until the new index lands, the directory holds either the old single-file checkpoint or
  // no index at all, never an index that mixes old and new shards.
  remove_file(index);
  for (size_t i = 0; i < shards.size(); ++i) rename_file(staged[i], join(dir, finals[i]));
  remove_file(single);
  rename_file(staged_index, index);
  remove_stale_shards(dir, std::set<std::string>(finals.begin(), finals.end()));
  sync_directory(dir);
}

void copy_model_side_files(const std::string& from_dir, const std::string& to_dir) {
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}) {
    const auto from = std::filesystem::path(from_dir) / name;
    if (std::filesystem::exists(from))
      std::filesystem::copy_file(from, std::filesystem::path(to_dir) / name,
                                 std::filesystem::copy_options::overwrite_existing);
  }
}

}  // namespace memtune
