// What every backend shares: the host sampler, grouped products, transfers as float32, host pages.
#include "backend/backend.h"

#include <fmt/format.h>
#include <sys/mman.h>

namespace memtune {

void Backend::sample_tokens(const SampleArgs& a) {
  MT_ASSERT(host_addressable(), "the host sampler reads logits in host memory");
  sample_rows_on_host(a);
}

void Backend::adamw_update_group(std::span<const AdamWTensor> tensors, const AdamWStep& step) {
  for (const AdamWTensor& t : tensors) {
    AdamWStep s = step;
    s.decay = t.decay;
    adamw_update(t.param, t.grad, t.m, t.v, s);
    if (t.storage) convert(t.storage, t.param);
  }
}

void Backend::decide_and_update(std::span<const Tensor>, float, std::span<const AdamWTensor>, const DecidedStep&) {
  MT_ASSERT(false, "this backend does not decide steps on a device (decides_steps)");
}
void Backend::read_step() { MT_ASSERT(false, "this backend does not decide steps on a device (decides_steps)"); }
Backend::StepReadback Backend::take_step() {
  MT_ASSERT(false, "this backend does not decide steps on a device (decides_steps)");
  return {};
}

void Backend::matmul_forward_group(std::span<const GroupMember> group, const Tensor& inp, const Tensor& scratch) {
  for (const GroupMember& m : group) {
    const Tensor& x = m.inp ? m.inp : inp;
    if (m.quantized)
      quantized_matmul_forward(m.out, x, *m.quantized, m.bias, scratch);
    else
      matmul_forward(m.out, x, m.weight, m.bias);
  }
}

std::vector<float> download_f32(Backend& backend, const Tensor& tensor) {
  std::vector<std::byte> bytes(tensor.bytes());
  backend.copy_to_host(bytes.data(), tensor);
  std::vector<float> values(static_cast<size_t>(tensor.numel()));
  convert_to_f32(bytes.data(), tensor.dtype, values.data(), values.size());
  return values;
}

void upload_f32(Backend& backend, const Tensor& tensor, std::span<const float> values) {
  MT_ASSERT(values.size() == static_cast<size_t>(tensor.numel()), "upload of a different number of values");
  std::vector<std::byte> bytes(tensor.bytes());
  convert_from_f32(values.data(), bytes.data(), tensor.dtype, values.size());
  backend.copy_to_device(tensor, bytes.data());
}

void* map_host_pages(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED)
    throw Error(fmt::format("cannot reserve the planned {:.2f} MiB ({} bytes) of memory", bytes / 1048576.0, bytes));
  return p;
}

}  // namespace memtune
