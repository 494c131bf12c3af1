// model.safetensors.index.json of a sharded checkpoint: the index is the input, beside two real
// shards; every tensor the reader then lists must be readable.
#include <vector>

#include "fuzz_support.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"

namespace {

// A checkpoint directory with two shards (a, b in the first; c in the second) and no index.
const std::filesystem::path& checkpoint_dir() {
  static const std::filesystem::path dir = [] {
    using namespace memtune;
    const auto d = fuzz::scratch_dir() / "sharded";
    std::filesystem::create_directories(d);
    static const float values[4] = {1, 2, 3, 4};
    write_safetensors((d / "model-00001-of-00002.safetensors").string(),
                      {{"a", DType::F32, {2}, values, nullptr}, {"b", DType::F32, {2}, values + 2, nullptr}});
    write_safetensors((d / "model-00002-of-00002.safetensors").string(), {{"c", DType::F32, {4}, values, nullptr}});
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const std::filesystem::path& dir = checkpoint_dir();
  fuzz::write_bytes(dir / "model.safetensors.index.json", fuzz::text_of(data, size));
  fuzz::refusals_are_errors([&] {
    const CheckpointReader reader(dir.string());
    for (const std::string& name : reader.tensor_names()) {
      const TensorInfo& info = reader.info(name);
      std::vector<float> values(static_cast<size_t>(info.numel()));
      reader.read_into(name, info.shape, values.data(), DType::F32);
    }
  });
  return 0;
}
