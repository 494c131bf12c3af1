// One Vulkan device opened for compute: its queue, the device memory the arenas live in, the
// host staging that transfers pass through, the pipelines of the embedded shaders, and the
// command buffer that dispatches are recorded into.
//
// Memory: allocate(bytes) makes ONE device-local VkDeviceMemory with one VkBuffer over it and
// returns the buffer's device address (VK_KHR_buffer_device_address) as the arena's base; every
// tensor view's data pointer is such an address plus an offset, and shaders reach tensors through
// those 64-bit addresses in push constants, so maxStorageBufferRange (128 MiB on lavapipe) never
// limits a tensor. The host never dereferences these addresses.
//
// Submission: dispatches and device-side copies are recorded into command buffers, each submitted
// once it holds kSubmitEvery dispatches so the device runs while the host records the rest of the step; the
// host waits (flush) only where a value must come back or host memory is touched: a download,
// freeing memory.
//
// Barriers: a command states the device memory it reads and writes (Access: address ranges; a
// write may also read). A memory barrier (compute and transfer stages, both ways) is recorded
// before a command only where one of its ranges meets a range of a command since the last
// barrier and one of the two writes it (read after write, write after write, write after read);
// a barrier orders everything earlier in submission order, across command buffers. A command
// that states nothing (a shader reaching tensors through a table in device memory) is ordered
// after everything before it and before everything after it. Every address in a dispatch's push
// constants that lies in this context's memory must be inside one of its stated ranges (checked
// at each dispatch), so a tensor the shader is handed cannot be left out. The host stage is a
// barrier's destination only before the host reads what the device wrote (downloads, read_later). A large upload goes through the staging buffer's halves in turn and waits only
// to refill a half whose copy is still running; nothing waits after its last slice.
#pragma once

#include <vulkan/vulkan.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "backend/vulkan/device.h"
#include "backend/vulkan/geometry.h"

namespace memtune {

// The first memory type in `allowed` (a bit mask) with every flag of `wanted`, one that also has
// every flag of `preferred` before any other; -1 when none has `wanted`.
int choose_memory_type(const VkPhysicalDeviceMemoryProperties& memory, uint32_t allowed, VkMemoryPropertyFlags wanted,
                       VkMemoryPropertyFlags preferred = 0);

class VulkanContext {
 public:
  // Opens the device --backend vulkan takes (choose_vulkan_device); an Error naming it on failure.
  explicit VulkanContext(std::optional<int> requested_device = std::nullopt);
  ~VulkanContext();
  VulkanContext(const VulkanContext&) = delete;
  VulkanContext& operator=(const VulkanContext&) = delete;

  const VulkanDeviceInfo& info() const { return info_; }

  // Device memory a command reads, or writes (and may read): [address, address + bytes).
  struct Access {
    uint64_t address = 0;
    size_t bytes = 0;
    bool write = false;
  };

  // Device-local memory of `bytes`, zero-filled; returns its device address. An Error naming
  // the device's limit when one allocation cannot hold it.
  uint64_t allocate(size_t bytes);
  void deallocate(uint64_t address);

  // Transfers between host memory and device addresses, through the staging buffer. An upload
  // of at most kRecordedUploadBytes (whole 4-byte words) is recorded into the command buffer
  // instead (vkCmdUpdateBuffer's limit), so it does not wait for the work before it.
  static constexpr size_t kRecordedUploadBytes = 65536;
  void upload(uint64_t dst, const void* src, size_t bytes);
  void download(void* dst, uint64_t src, size_t bytes);
  // Several downloads with as few waits as the staging buffer allows: the ranges are copied into
  // it one after another (cut where it is full), and each time it is full, and at the end, one
  // flush and the host reads what it holds. Ranges that fit together cost one wait.
  struct Range {
    void* dst;
    uint64_t src;
    size_t bytes;
  };
  void download(std::initializer_list<Range> ranges);
  // Recorded: a device-to-device copy, and a fill of 4-byte words.
  void copy(uint64_t dst, uint64_t src, size_t bytes);
  void fill_words(uint64_t dst, uint32_t word, size_t bytes);
  // The barrier state as a pure function, for tests: whether a command of `accesses` (none: it
  // states nothing) needs a barrier after commands of `pending` since the last one.
  static bool needs_barrier(std::span<const Access> pending, bool pending_unstated, std::span<const Access> accesses,
                            bool unstated);

  // Records a dispatch of shaders/NAME.comp with `push` as its push constants (at most 128
  // bytes, laid out as the shader declares them). `constants` are its specialization constants
  // (constant_id 0, 1, ...: a head dimension, a tile size, a dtype), fixed when its pipeline is
  // made: each distinct set is a pipeline of its own, compiled on first use.
  // flops and bytes: what the dispatch is designed to do (VulkanDispatch), for the profile.
  // `accesses`: the memory it reads and writes (see Barriers above); empty: it states none.
  void dispatch(std::string_view shader, std::span<const uint32_t> constants, std::span<const std::byte> push,
                uint32_t groups_x, uint32_t groups_y, uint32_t groups_z, double flops, double bytes,
                std::span<const Access> accesses);
  // A dispatch as vulkan_geometry computed it (shader, constants, grid).
  template <class Push>
  void dispatch(const VulkanDispatch& d, const Push& push, std::initializer_list<Access> accesses = {}) {
    dispatch(d.shader, std::span<const uint32_t>(d.constants), std::as_bytes(std::span<const Push>(&push, 1)), d.x,
             d.y, d.z, d.flops, d.bytes, std::span<const Access>(accesses.begin(), accesses.size()));
  }
  // Reads the host collects later (a training step's result, read one step late): read_later
  // records a copy of `bytes` at device address `src` into one of kReadbackSlots host-visible
  // slots, with the current series of time marks (which it takes: marks() no longer returns
  // them), and submits; collect waits only for that copy's command buffer, if still running, and
  // returns the bytes and the marks' seconds since mark 0. A slot is reused after its collect.
  struct PendingRead {
    size_t slot = 0, batch = 0, bytes = 0;
    uint64_t submission = 0;
    uint32_t marks = 0;
  };
  static constexpr size_t kReadbackSlots = 2, kReadbackBytes = (size_t{1} << 20) + 256;
  // A slot: the series' timestamps, then the bytes.
  static constexpr size_t kMarkBytes = Backend::kTimeMarks * sizeof(uint64_t), kSlotBytes = kMarkBytes + kReadbackBytes;
  PendingRead read_later(uint64_t src, size_t bytes);
  std::span<const std::byte> collect(const PendingRead& read, std::vector<double>& marks);
  // Commands recorded once and submitted again (a decode step's forward, whose commands are a pure
  // function of a few shapes the caller puts in `key`). begin_commands(key) ... end_commands():
  // what is recorded between goes into command buffers that are kept under key (their first
  // command waits for all earlier work; the commands after them are ordered against their last
  // ones as after any others; they are submitted as they fill, as always); between the two, nothing may reach host memory (no
  // upload, download, read or flush: MT_ASSERT), so the commands read only device memory.
  // replay(key): where key has commands, submits them again (after the commands recorded before,
  // the step's uploads) and returns true; the caller then skips the work. Up to kKeptRecordings
  // keys, the least recently used given back first; all are given back when memory is freed
  // (their addresses could then be reused). MEMTUNE_VULKAN_REUSE=0 keeps nothing (replay is
  // always false; begin and end do nothing), MEMTUNE_VULKAN_REUSE=check records every time, and
  // end_commands then asserts that the
  // commands equal the key's earlier recording, command by command (pipeline, push constants,
  // grid, copies, fills, barriers), before it takes their place: the tests' proof that a key
  // decides the commands. Off under MEMTUNE_VULKAN_PROFILE.
  void begin_commands(std::span<const int64_t> key);
  void end_commands();
  bool replay(std::span<const int64_t> key);
  static constexpr size_t kKeptRecordings = 16;
  enum class Reuse { Off, On, Check };
  void set_reuse(Reuse reuse) { reuse_ = reuse; }  // the environment's choice, or a test's
  // Submits what is recorded and waits for everything submitted.
  void flush();
  // Submits what is recorded without waiting (the device starts on it; the next recording goes to
  // another command buffer). dispatch() does so every kSubmitEvery dispatches.
  void submit();
  static constexpr uint32_t kSubmitEvery = 64;
  // What the host asked of the device since the context opened: dispatches, command buffers
  // submitted, and waits for the device; and the dispatches by shader (summed over its pipelines
  // when asked: a dispatch only adds one to its pipeline's count).
  // overlapped_waits: the waits for a command buffer that later submissions followed (the device
  // had more work queued while the host waited: a pending read collected after the next step was
  // recorded).
  // replayed_*: the dispatches that replay() ran again and its recorded command buffers (the
  // dispatches include them; the host recorded dispatches - replayed_dispatches).
  struct Counters {
    uint64_t dispatches = 0, submissions = 0, waits = 0, overlapped_waits = 0, barriers = 0;
    uint64_t replayed_dispatches = 0, replayed_command_buffers = 0;
  };
  const Counters& counters() const { return counters_; }
  std::map<std::string, uint64_t> dispatches_by_shader() const;
  // Device timestamps (Backend::time_mark / time_marks): mark i is written when the work
  // recorded before it has finished (mark 0 starts a series); marks() waits for them (flushing
  // only if one is still unsubmitted) and returns the seconds of the series' marks 0..n-1 since
  // mark 0 (n: those made, from 0 without a gap), then forgets them. Empty without timestamps on the compute queue.
  void mark(int i);
  std::vector<double> marks();
  // The driver's figures for the device-local heaps (VK_EXT_memory_budget): what this process
  // uses and what it may use; none without the extension, or on a CPU implementation (lavapipe).
  struct MemoryBudget {
    uint64_t usage_bytes = 0, budget_bytes = 0;
  };
  std::optional<MemoryBudget> memory_budget() const;

 private:
  struct Allocation {
    VkBuffer buffer = VK_NULL_HANDLE;
    VkDeviceMemory memory = VK_NULL_HANDLE;
    size_t bytes = 0;
  };
  struct Pipeline {
    VkShaderModule module = VK_NULL_HANDLE;
    VkPipeline pipeline = VK_NULL_HANDLE;
    size_t push_bytes = 0;  // the shader's push-constant block (vulkan_push_constant_bytes)
    std::vector<uint32_t> address_offsets;  // its members that may hold addresses
    uint64_t dispatches = 0;
  };
  // Pipelines by (shader, specialization constants), found from views of both: a dispatch
  // allocates nothing to look its pipeline up.
  struct PipelineKey {
    std::string shader;
    std::vector<uint32_t> constants;
  };
  struct PipelineKeyView {
    std::string_view shader;
    std::span<const uint32_t> constants;
  };
  struct PipelineKeyLess {
    using is_transparent = void;
    static PipelineKeyView view(const PipelineKey& k) { return {k.shader, k.constants}; }
    static PipelineKeyView view(const PipelineKeyView& k) { return k; }
    template <class A, class B>
    bool operator()(const A& a, const B& b) const {
      const PipelineKeyView x = view(a), y = view(b);
      if (x.shader != y.shader) return x.shader < y.shader;
      return std::lexicographical_compare(x.constants.begin(), x.constants.end(), y.constants.begin(),
                                          y.constants.end());
    }
  };
  // The allocation holding [address, address + bytes) and the offset of address in it.
  std::pair<const Allocation*, size_t> locate(uint64_t address, size_t bytes) const;
  uint32_t memory_type(uint32_t allowed, VkMemoryPropertyFlags wanted, VkMemoryPropertyFlags preferred) const;
  Allocation make_buffer(size_t bytes, VkBufferUsageFlags usage, VkMemoryPropertyFlags properties,
                         VkMemoryPropertyFlags preferred = 0);
  void destroy(Allocation& a);
  // The primary command buffer being recorded (begun where none is); recording(): where the next
  // command goes, the primary or, between begin_commands and end_commands, the recording's chunk.
  VkCommandBuffer primary();
  VkCommandBuffer recording();
  // A barrier between device commands, or (host) also before the host reads.
  void barrier(bool host = false);
  // Records what the next command touches, with a barrier first where needs_barrier says.
  void order(std::span<const Access> accesses);
  void order(std::initializer_list<Access> accesses) { order(std::span<const Access>(accesses.begin(), accesses.size())); }
  // Every push-constant member that may hold an address (`offsets`) and holds one in this
  // context's memory lies in `accesses`.
  void check_stated(std::span<const std::byte> push, std::span<const uint32_t> offsets,
                    std::span<const Access> accesses) const;
  std::vector<Access> pending_;  // since the last barrier
  bool pending_unstated_ = false;  // a command since the last barrier stated nothing
  Pipeline& pipeline(std::string_view shader, std::span<const uint32_t> constants);

  VulkanDeviceInfo info_;
  VkInstance instance_ = VK_NULL_HANDLE;
  VkPhysicalDevice physical_ = VK_NULL_HANDLE;
  VkDevice device_ = VK_NULL_HANDLE;
  VkQueue queue_ = VK_NULL_HANDLE;
  uint32_t queue_family_ = 0;
  VkCommandPool pool_ = VK_NULL_HANDLE;
  // Command buffers with their fences: one being recorded, any number submitted and running
  // (in_flight until a flush waits for them), reused once done.
  struct Batch {
    VkCommandBuffer commands = VK_NULL_HANDLE;
    VkFence fence = VK_NULL_HANDLE;
    bool in_flight = false;
    uint64_t submission = 0;  // counters_.submissions when it was submitted
  };
  // A batch the device is done with: its fence and commands reset.
  void finished(Batch& b);
  // A recording's commands, as the check compares them: a dispatch (its pipeline, grid and push
  // constants), a copy, a fill, or a barrier.
  struct Command {
    enum Kind : uint32_t { Dispatch, Copy, Fill, Barrier } kind = Dispatch;
    const void* object = nullptr;  // the pipeline; the copy's source buffer
    VkBuffer buffer = VK_NULL_HANDLE;  // the copy's or fill's destination
    uint64_t a = 0, b = 0, c = 0;   // grid x y z; offsets and bytes; the fill's word; host
    uint32_t push_bytes = 0;
    std::byte push[128] = {};
    bool operator==(const Command& o) const;
  };
  // A key's commands: secondary command buffers (chunks of at most kSubmitEvery dispatches), which
  // primaries execute; the primaries up to the last that did (its submission number: they may
  // still run) are waited for before they are executed again or freed.
  struct Recording {
    std::vector<VkCommandBuffer> chunks;
    std::vector<Command> commands;
    uint64_t dispatches = 0, barriers = 0, last_use = 0;
    std::map<Pipeline*, uint64_t> by_pipeline;
    uint64_t user_submission = 0;
    // The barrier state they leave: the accesses since their last barrier.
    std::vector<Access> pending_after;
    bool unstated_after = false;
  };
  void note(const Command& c) {
    if (recording_key_) building_.commands.push_back(c);
  }
  // Ends the recording's open chunk, executed by the primary.
  void close_chunk();
  bool chunk_open_ = false;
  // Gives a recording's command buffers back (waiting for them where they still run).
  void release(Recording& r);
  // Waits for every submitted batch up to `submission` (submitting the open one if it is that).
  void wait_through(uint64_t submission);
  void release_recordings();
  void assert_not_recording(const char* what) const;
  Reuse reuse_ = Reuse::On;
  struct KeyLess {  // looks a key up from a span: a replay allocates nothing
    using is_transparent = void;
    bool operator()(std::span<const int64_t> a, std::span<const int64_t> b) const {
      return std::lexicographical_compare(a.begin(), a.end(), b.begin(), b.end());
    }
  };
  std::map<std::vector<int64_t>, Recording, KeyLess> recordings_;
  std::optional<std::vector<int64_t>> recording_key_;  // between begin_commands and end_commands
  Recording building_;
  Counters at_recording_start_;
  uint64_t recording_uses_ = 0;
  // Waits for one submitted batch (if still in flight) and makes it reusable.
  void retire(size_t batch, uint64_t submission);
  // Large uploads go through the staging buffer's two halves in turn: the batch that copies out
  // of each half, so that refilling a half waits only for its own copy.
  struct StagingHalf {
    size_t batch = 0;
    uint64_t submission = 0;  // 0: no copy out of it pending
  };
  StagingHalf staging_halves_[2];
  size_t next_half_ = 0;
  std::vector<Batch> batches_;
  std::vector<VkFence> fence_list_;  // flush()'s (kept: no allocation per flush)
  size_t current_ = 0;               // the batch being recorded, while recording_
  uint32_t recorded_ = 0;            // dispatches in it
  bool recording_ = false;
  VkPipelineLayout layout_ = VK_NULL_HANDLE;
  VkQueryPool timestamps_ = VK_NULL_HANDLE;  // Backend::kTimeMarks timestamp queries
  uint64_t timestamp_mask_ = 0;              // the queue's valid timestamp bits
  uint32_t marked_ = 0;                      // a bit per mark written since marks()
  bool marks_pending_ = false;               // a mark whose work no wait has seen through yet
  std::map<uint64_t, Allocation> allocations_;  // by device address
  uint64_t allocated_bytes_ = 0;
  Allocation staging_;
  void* staging_host_ = nullptr;
  struct StagedPiece {  // a download's piece in the staging buffer, read after the flush
    std::byte* dst;
    size_t at, bytes;
  };
  std::vector<StagedPiece> staged_;
  Allocation readback_;  // kReadbackSlots slots of kSlotBytes
  std::byte* readback_host_ = nullptr;
  size_t next_readback_ = 0;
  // The marks of the current series: 0..n-1 written without a gap.
  uint32_t series_length() const;
  // Converts a series of n timestamps to seconds since the first.
  std::vector<double> seconds_since_first(const uint64_t* ticks, uint32_t n) const;
  std::map<PipelineKey, Pipeline, PipelineKeyLess> pipelines_;
  // MEMTUNE_VULKAN_PROFILE=1: every dispatch runs alone and is timed by two device timestamps
  // around it (the host's clock without timestamps); per shader, the seconds, dispatches,
  // workgroups and the FLOPs and bytes by design go to stderr when the context closes, with the
  // rates they make (a diagnostic: it serializes the device).
  bool profile_ = false;
  VkQueryPool profile_queries_ = VK_NULL_HANDLE;
  struct ProfileEntry {
    double seconds = 0, flops = 0, bytes = 0;
    int64_t dispatches = 0;
    uint64_t workgroups = 0;
  };
  std::map<std::string, ProfileEntry> profile_entries_;
  Counters counters_;
};

}  // namespace memtune
