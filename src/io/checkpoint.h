// Hugging Face checkpoint directories: either one model.safetensors, or shards named
// model-00001-of-0000N.safetensors tied together by model.safetensors.index.json. The reader
// presents one flat tensor namespace over either layout (and checks the index against the
// shards); the writer produces the same layouts the way transformers' save_pretrained does, so
// a fine-tuned model loads back in transformers unchanged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/safetensors.h"

namespace memtune {

class CheckpointReader {
 public:
  // Like transformers, uses dir/model.safetensors when present, else the index and its shards.
  explicit CheckpointReader(const std::string& dir);

  std::vector<std::string> tensor_names() const;  // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  // Error naming dir + tensor if absent
  const SafetensorsFile& file_of(const std::string& name) const;
  // Copies elements [begin, begin + count) of the tensor (all of them by default) into dst
  // (dst_dtype, row-major), converting the dtype if needed. Error if the stored shape differs
  // from expected_shape.
  void read_into(const std::string& name, std::span<const int64_t> expected_shape, void* dst, DType dst_dtype,
                 size_t begin = 0, size_t count = SIZE_MAX) const;

 private:
  struct Entry {
    const SafetensorsFile* file;
    const TensorInfo* info;
  };
  const Entry& entry(const std::string& name) const;
  void open_index(const std::string& index_path);

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry> tensors_;
};

// Writes dir/model.safetensors when all tensors fit in one shard of max_shard_bytes, else
// HF-named shards plus model.safetensors.index.json ({"metadata": {"total_size": N},
// "weight_map": {tensor: file}}). Tensors keep their order; one larger than the limit gets a
// shard of its own. Every file carries the metadata {"format": "pt"}. Creates dir if needed.
// Files go to temporary names first and are renamed into place in an order that never leaves
// a mix of old and new files readable as a checkpoint; stale model files of an earlier write
// into the same directory are removed.
inline constexpr size_t kDefaultMaxShardBytes = 5'000'000'000;  // save_pretrained's "5GB"
void write_checkpoint(const std::string& dir, const std::vector<TensorToWrite>& tensors,
                      size_t max_shard_bytes = kDefaultMaxShardBytes);

// Copies what a model directory holds beside its weights and config (tokenizer.json,
// tokenizer_config.json, generation_config.json), those present, from one directory to another.
void copy_model_side_files(const std::string& from_dir, const std::string& to_dir);

}  // namespace memtune
