// safetensors files (length prefix, JSON header, data): opening one validates the whole header
// against the file; every tensor it then lists must be readable within the mapped data.
#include "fuzz_support.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace memtune;
  const std::filesystem::path path = fuzz::scratch_dir() / "input.safetensors";
  fuzz::write_bytes(path, fuzz::text_of(data, size));
  fuzz::refusals_are_errors([&] {
    const SafetensorsFile file(path.string());
    for (const TensorInfo& t : file.tensors()) {
      const std::span<const std::byte> bytes = file.data(t);
      if (bytes.size() != static_cast<size_t>(t.numel()) * dtype_size(t.dtype)) std::abort();
      if (file.find(t.name) != &t) std::abort();
    }
  });
  return 0;
}
