#include "train/training_checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"

namespace memtune {

namespace fs = std::filesystem;

namespace {

bool is_run_output(const std::string& name) {
  static const char* const kFiles[] = {"run_args.json", "trainer_state.json", "log.jsonl", "memory.json",
                                       "memory.jsonl", "report.html", "config.json", "generation_config.json",
                                       "adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json", "model.safetensors.index.json"};
  for (const char* file : kFiles)
    if (name == file) return true;
  return name.starts_with("checkpoint-") || name.starts_with("tmp-checkpoint-") ||
         (name.starts_with("model") && name.ends_with(".safetensors"));
}

}  // namespace

std::vector<std::string> earlier_run_outputs(const fs::path& output_dir) {
  std::vector<std::string> out;
  if (!fs::is_directory(output_dir)) return out;
  for (const auto& e : fs::directory_iterator(output_dir))
    if (const std::string name = e.path().filename().string(); is_run_output(name)) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

void remove_earlier_run_outputs(const fs::path& output_dir) {
  for (const std::string& name : earlier_run_outputs(output_dir)) fs::remove_all(output_dir / name);
}

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

void remove_checkpoint(const fs::path& dir) {
  if (!fs::exists(dir)) return;
  const fs::path doomed = dir.parent_path() / ("tmp-" + dir.filename().string() + ".removing");
  fs::remove_all(doomed);
  fs::rename(dir, doomed);
  fs::remove_all(doomed);
}

void rotate_checkpoints(const fs::path& output_dir, int64_t limit, const std::string& keep) {
  if (limit <= 0) return;
  const auto all = list_checkpoints(output_dir);
  size_t excess = all.size() > static_cast<size_t>(limit) ? all.size() - static_cast<size_t>(limit) : 0;
  for (size_t i = 0; i + 1 < all.size() && excess > 0; ++i) {
    if (all[i].second.string() == keep) continue;
    remove_checkpoint(all[i].second);
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

namespace {
constexpr const char* kDataFingerprintField = "train_data_fingerprint";
}  // namespace

nlohmann::json run_identity_json(const RunIdentity& r) {
  return {{"global_batch_size", r.global_batch_size},
          {"seed", r.seed},
          {"data_seed", r.data_seed},
          {"max_length", r.max_length},
          {"packing", r.packing},
          {kDataFingerprintField, r.train_data_fingerprint}};
}

void check_resume_compatible(const JsonReader& state, const RunIdentity& now, bool ignore_data_mismatch) {
  state.as_object();
  std::string differences;
  const nlohmann::json identity = run_identity_json(now);
  for (const auto& [field, value] : identity.items()) {
    if (ignore_data_mismatch && field == kDataFingerprintField) continue;
    const JsonReader saved = state.get(field);
    if (saved.value() != value)
      differences += fmt::format("\n  {}: saved {}, now {}", field, json_excerpt(saved.value()), json_excerpt(value));
  }
  if (!differences.empty())
    throw Error(
        fmt::format("{}: cannot resume: this run differs from the one that saved the checkpoint "
                    "(a resumed run must see the same data in the same batches):{}",
                    state.where(), differences));
}

SavedPosition read_saved_position(const JsonReader& state, const RunIdentity& now, bool ignore_data_mismatch) {
  check_resume_compatible(state, now, ignore_data_mismatch);
  SavedPosition p;
  p.global_step = state.integer("global_step", 0);
  p.optimizer_steps = state.optional_integer("optimizer_steps", 0).value_or(p.global_step);
  p.loss_scale = state.optional_number("loss_scale");
  p.good_steps = state.optional_integer("good_steps", 0).value_or(0);
  p.epoch = state.integer("epoch", 0);
  p.batches_in_epoch = state.integer("batches_in_epoch", 0);
  p.num_input_tokens_seen = state.integer("num_input_tokens_seen", 0);
  return p;
}

std::string file_fingerprint(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open: {}", path.string(), std::strerror(errno)));
  uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a offset basis and prime
  std::array<char, 1 << 16> buffer;
  while (in) {
    in.read(buffer.data(), buffer.size());
    const auto n = static_cast<size_t>(in.gcount());
    for (size_t i = 0; i < n; ++i) hash = (hash ^ static_cast<unsigned char>(buffer[i])) * 0x100000001b3ull;
  }
  if (in.bad()) throw Error(fmt::format("{}: read failed", path.string()));
  return fmt::format("fnv1a64:{:016x}", hash);
}

}  // namespace memtune
