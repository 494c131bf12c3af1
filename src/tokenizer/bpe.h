// Byte-level BPE merging on token ids. A pre-token's bytes start as the ids of their single-byte
// tokens; then, exactly as Hugging Face's BPE does, the adjacent pair with the lowest merge rank
// (the leftmost one on ties) is merged until no adjacent pair has a merge. Short words use a flat
// array scan; long ones a heap over a linked list, so a megabyte-long "word" stays O(n log n).
// The merge table is an open-addressing hash on the (left, right) id pair.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

namespace memtune::tokenizer_detail {

class BytePairMerger {
 public:
  // byte_ids[b]: id of the token for the single byte b.
  explicit BytePairMerger(const std::array<int32_t, 256>& byte_ids);

  // Records that (left, right) merge into `merged` with priority `rank` (lower merges first).
  // A pair given again replaces the earlier entry, as in Hugging Face's loader.
  void add_merge(int32_t left, int32_t right, int32_t rank, int32_t merged);

  // Appends the ids of one pre-token, given as its raw bytes.
  void encode(std::string_view bytes, std::vector<int32_t>& out) const;

 private:
  struct Merge {
    int32_t rank;
    int32_t merged;
  };
  struct Slot {
    uint64_t key;
    Merge merge;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static uint64_t key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  size_t slot_of(uint64_t k) const {
    return static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  // The merge of (left, right), or nullptr when the pair does not merge.
  const Merge* find(int32_t left, int32_t right) const {
    const uint64_t k = key(left, right);
    for (size_t i = slot_of(k);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == k) return &s.merge;
      if (s.key == kEmpty) return nullptr;
    }
  }
  void grow();
  void encode_short(std::string_view bytes, std::vector<int32_t>& out) const;
  void encode_long(std::string_view bytes, std::vector<int32_t>& out) const;

  std::array<int32_t, 256> byte_ids_;
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  int shift_ = 64;
  size_t count_ = 0;
};

}  // namespace memtune::tokenizer_detail
