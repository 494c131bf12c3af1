// Byte-level BPE merging (see bpe.h).
#include "tokenizer/bpe.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <queue>

namespace memtune::tokenizer_detail {
namespace {

// Words up to this many bytes use the flat scan: quadratic, but branch-light and allocation-free,
// which beats the heap for the short words that make up nearly all text.
constexpr size_t kShortWord = 64;
constexpr int32_t kNoMerge = std::numeric_limits<int32_t>::max();

}  // namespace

BytePairMerger::BytePairMerger(const std::array<int32_t, 256>& byte_ids) : byte_ids_(byte_ids) {
  slots_.assign(16, Slot{kEmpty, {0, 0}});
  mask_ = slots_.size() - 1;
  shift_ = 64 - 4;
}

void BytePairMerger::grow() {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(old.size() * 2, Slot{kEmpty, {0, 0}});
  mask_ = slots_.size() - 1;
  --shift_;
  for (const Slot& s : old) {
    if (s.key == kEmpty) continue;
    size_t i = slot_of(s.key);
    while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
    slots_[i] = s;
  }
}

void BytePairMerger::add_merge(int32_t left, int32_t right, int32_t rank, int32_t merged) {
  // Keep the load factor at or below one half so that probe sequences stay short.
  if ((count_ + 1) * 2 > slots_.size()) grow();
  const uint64_t k = key(left, right);
  size_t i = slot_of(k);
  while (slots_[i].key != kEmpty && slots_[i].key != k) i = (i + 1) & mask_;
  if (slots_[i].key == kEmpty) ++count_;
  slots_[i] = Slot{k, {rank, merged}};
}

void BytePairMerger::encode(std::string_view bytes, std::vector<int32_t>& out) const {
  if (bytes.size() == 1) {
    out.push_back(byte_ids_[static_cast<uint8_t>(bytes[0])]);
  } else if (bytes.size() <= kShortWord) {
    encode_short(bytes, out);
  } else {
    encode_long(bytes, out);
  }
}

void BytePairMerger::encode_short(std::string_view bytes, std::vector<int32_t>& out) const {
  // ids[0..len) is the current word; rank[i] / merged[i] describe the pair (ids[i], ids[i+1]).
  int32_t ids[kShortWord], rank[kShortWord], merged[kShortWord];
  size_t len = bytes.size();
  for (size_t i = 0; i < len; ++i) ids[i] = byte_ids_[static_cast<uint8_t>(bytes[i])];
  auto set_pair = [&](size_t i) {
    const Merge* m = find(ids[i], ids[i + 1]);
    rank[i] = m ? m->rank : kNoMerge;
    merged[i] = m ? m->merged : -1;
  };
  for (size_t i = 0; i + 1 < len; ++i) set_pair(i);

  while (len > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < len; ++i)
      if (rank[i] < rank[best]) best = i;  // strict: the leftmost pair wins ties
    if (rank[best] == kNoMerge) break;
    ids[best] = merged[best];
    // Drop ids[best + 1]; pairs right of the merge shift down by one.
    const size_t tail = len - best - 2;
    std::memmove(ids + best + 1, ids + best + 2, tail * sizeof(int32_t));
    if (tail > 0) {
      std::memmove(rank + best + 1, rank + best + 2, (tail - 1) * sizeof(int32_t));
      std::memmove(merged + best + 1, merged + best + 2, (tail - 1) * sizeof(int32_t));
    }
    --len;
    if (best > 0) set_pair(best - 1);
    if (best + 1 < len) set_pair(best);
  }
  out.insert(out.end(), ids, ids + len);
}

void BytePairMerger::encode_long(std::string_view bytes, std::vector<int32_t>& out) const {
  // A doubly linked list of symbols (a merge keeps the left one) and a min-heap of candidate
  // merges ordered by (rank, left position). Entries go stale when a neighbour merges first;
  // they are recognized on pop by the ids they were made for no longer being there.
  struct Symbol {
    int32_t id;  // -1 once merged into its left neighbour
    int32_t prev;
    int32_t next;
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t left_id;
    int32_t right_id;
    int32_t merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const auto n = static_cast<int32_t>(bytes.size());
  std::vector<Symbol> symbols(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i)
    symbols[static_cast<size_t>(i)] = {byte_ids_[static_cast<uint8_t>(bytes[static_cast<size_t>(i)])], i - 1,
                                       i + 1 < n ? i + 1 : -1};
  std::vector<Candidate> storage;
  storage.reserve(static_cast<size_t>(n));
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap(std::greater<>{}, std::move(storage));
  auto push_pair = [&](int32_t left) {
    const int32_t right = symbols[static_cast<size_t>(left)].next;
    if (right < 0) return;
    const int32_t left_id = symbols[static_cast<size_t>(left)].id, right_id = symbols[static_cast<size_t>(right)].id;
    if (const Merge* m = find(left_id, right_id)) heap.push({m->rank, left, left_id, right_id, m->merged});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push_pair(i);

  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Symbol& left = symbols[static_cast<size_t>(c.pos)];
    if (left.id != c.left_id || left.next < 0) continue;
    Symbol& right = symbols[static_cast<size_t>(left.next)];
    if (right.id != c.right_id) continue;
    left.id = c.merged;
    right.id = -1;
    left.next = right.next;
    if (left.next >= 0) symbols[static_cast<size_t>(left.next)].prev = c.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(c.pos);
  }
  // Symbol 0 is never merged away: merges always keep the left symbol.
  for (int32_t i = 0; i >= 0; i = symbols[static_cast<size_t>(i)].next) out.push_back(symbols[static_cast<size_t>(i)].id);
}

}  // namespace memtune::tokenizer_detail
