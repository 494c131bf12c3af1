#include "train/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>

#include "core/error.h"
#include "io/safetensors.h"

namespace memtune {

namespace fs = std::filesystem;

std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& output_dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  if (!fs::exists(output_dir)) return out;
  for (const auto& e : fs::directory_iterator(output_dir)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || !name.starts_with("checkpoint-")) continue;
    try {
      out.emplace_back(std::stoll(name.substr(11)), e.path());
    } catch (const std::exception&) {
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void rotate_checkpoints(const fs::path& output_dir, int64_t limit, const std::string& keep) {
  if (limit <= 0) return;
  const auto all = list_checkpoints(output_dir);
  size_t excess = all.size() > static_cast<size_t>(limit) ? all.size() - static_cast<size_t>(limit) : 0;
  for (size_t i = 0; i + 1 < all.size() && excess > 0; ++i) {
    if (all[i].second.string() == keep) continue;
    fs::remove_all(all[i].second);
    --excess;
  }
}

void write_optimizer_state(ModelParameters& params, Arena& arena, Communicator& comm, const fs::path& file) {
  arena.enter_phase(Phase::Optimizer);
  const bool sharded = params.optimizer_sharded();
  std::deque<std::vector<float>> gathered;  // host staging for the sharded state (rank 0)
  Backend& backend = params.backend();
  auto whole = [&](const std::string& name, const Tensor& shard, size_t i) -> TensorToWrite {
    const ParamSpec& s = params.trainable_spec(i);
    if (!sharded) return device_tensor_to_write(backend, name, s.shape, shard);
    const size_t n = static_cast<size_t>(s.numel());
    const std::vector<float> block = download_f32(backend, shard);
    gathered.emplace_back(comm.is_root() ? n : 0);
    comm.gather_to_root(block, n, gathered.back().data());
    return {name, DType::F32, s.shape, gathered.back().data()};
  };
  std::vector<TensorToWrite> tensors;
  for (size_t i = 0; i < params.num_trainable(); ++i) {
    const ParamSpec& s = params.trainable_spec(i);
    tensors.push_back(whole("exp_avg." + s.name, params.adam_m(i), i));
    tensors.push_back(whole("exp_avg_sq." + s.name, params.adam_v(i), i));
    if (params.trainable_is_master(i)) tensors.push_back(whole("master." + s.name, params.shard_value(i), i));
  }
  if (comm.is_root()) write_safetensors(file.string(), tensors, {{"format", "pt"}});
  arena.enter_phase(Phase::Forward);
}

void read_optimizer_state(ModelParameters& params, Arena& arena, const fs::path& file) {
  const SafetensorsFile opt(file.string());
  arena.enter_phase(Phase::Optimizer);
  params.load_masters();
  auto restore = [&](const std::string& name, const Tensor& dst, size_t i) {
    const ParamSpec& s = params.trainable_spec(i);
    const TensorInfo* t = opt.find(name);
    if (!t || t->dtype != DType::F32 || t->shape != s.shape)
      throw Error(fmt::format("{}: tensor \"{}\" missing or not F32 {}", file.string(), name, shape_string(s.shape)));
    params.backend().copy_to_device(dst, opt.data(*t).data() + params.optimizer_shard(i).begin * 4);
  };
  for (size_t i = 0; i < params.num_trainable(); ++i) {
    const ParamSpec& s = params.trainable_spec(i);
    restore("exp_avg." + s.name, params.adam_m(i), i);
    restore("exp_avg_sq." + s.name, params.adam_v(i), i);
    if (params.trainable_is_master(i)) restore("master." + s.name, params.shard_value(i), i);
  }
  arena.enter_phase(Phase::Forward);
}

}  // namespace memtune
