// 16-bit products through oneDNN's matmul (half_gemm.h).
#include "backend/cpu/half_gemm.h"

#include <sys/mman.h>

#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "core/error.h"

namespace memtune::cpu {
namespace {

using dnnl::memory;

memory::data_type onednn_type(DType dtype) {
  MT_ASSERT(dtype == DType::BF16 || dtype == DType::F16, "16-bit products take bfloat16 or float16 operands");
  return dtype == DType::BF16 ? memory::data_type::bf16 : memory::data_type::f16;
}

// One product's shape and layout: what a primitive is made for.
struct Shape {
  DType dtype;
  int64_t M, N, K, a_row, a_col, b_row, b_col, ldc;
  bool accumulate;
  size_t scratchpad_limit;
  auto key() const { return std::tuple(dtype, M, N, K, a_row, a_col, b_row, b_col, ldc, accumulate, scratchpad_limit); }
  bool operator<(const Shape& o) const { return key() < o.key(); }
};

class Engine {
 public:
  static Engine& get() {
    static Engine engine;
    return engine;
  }

  // The primitive descriptor of `rows` output rows of `s`.
  dnnl::matmul::primitive_desc describe(const Shape& s, int64_t rows) const {
    const memory::data_type t = onednn_type(s.dtype);
    const memory::desc a({rows, s.K}, t, memory::dims{s.a_row, s.a_col});
    const memory::desc b({s.K, s.N}, t, memory::dims{s.b_row, s.b_col});
    const memory::desc c({rows, s.N}, memory::data_type::f32, memory::dims{s.ldc, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    if (s.accumulate) {
      dnnl::post_ops sum;
      sum.append_sum(1.0f);
      attr.set_post_ops(sum);
    }
    return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, engine_);
  }

  const std::string& kernel(DType dtype) {
    std::lock_guard lock(mutex_);
    return kernel_locked(dtype);
  }
  const std::string& kernel(const Shape& s) {
    std::lock_guard lock(mutex_);
    return entry(s).kernel;
  }

  int64_t run(ProductFamily family, const Shape& s, HalfMatrix A, HalfMatrix B, float* C) {
    std::lock_guard lock(mutex_);
    Entry& e = entry(s);
    const ProductTimer timer(family, e.counted_as, 2.0 * static_cast<double>(s.M * s.N * s.K));
    const int64_t element = static_cast<int64_t>(dtype_size(s.dtype));
    for (int64_t r0 = 0; r0 < s.M; r0 += e.piece_rows) {
      Call& call = std::min(e.piece_rows, s.M - r0) == e.piece_rows ? e.piece : e.last;
      // The memory objects were made with the primitive: a call only points them at its data.
      call.args.at(DNNL_ARG_SRC).set_data_handle(
          const_cast<char*>(static_cast<const char*>(A.data)) + r0 * s.a_row * element);
      call.args.at(DNNL_ARG_WEIGHTS).set_data_handle(const_cast<void*>(B.data));
      call.args.at(DNNL_ARG_DST).set_data_handle(C + r0 * s.ldc);
      call.matmul.execute(stream_, call.args);
    }
    stream_.wait();
    return e.piece_rows;
  }

 private:
  // Asked once per dtype (under the lock), then remembered.
  const std::string& kernel_locked(DType dtype) {
    const auto [it, first] = kernels_.try_emplace(dtype);
    std::string& name = it->second;
    if (first) {
      try {
        // A training-sized product: oneDNN may pick differently for tiny ones.
        const Shape s{dtype, 256, 256, 256, 256, 1, 1, 256, 256, false, kHalfGemmScratchpadBytes};
        const std::string impl = describe(s, s.M).impl_info_str();
        const bool native = impl.find("amx") != std::string::npos ||
                            impl.find(dtype == DType::BF16 ? "bf16" : "fp16") != std::string::npos;
        if (native && impl.find("ref") == std::string::npos) name = impl;
      } catch (const dnnl::error&) {
        // No 16-bit matmul at all on this ISA (oneDNN refuses to make one).
      }
    }
    return name;
  }

  // One primitive with its arguments (the operands' memory objects and the shared scratchpad).
  struct Call {
    dnnl::matmul matmul;
    std::unordered_map<int, memory> args;
  };
  struct Entry {
    int64_t piece_rows;
    Call piece, last;
    std::string kernel;      // the primitive's implementation name
    std::string counted_as;  // "oneDNN <kernel>" (products.h)
  };
  // Shapes change with every micro-batch's token count; a long run meets many, so the cache is
  // bounded (making a primitive costs a fraction of a millisecond).
  static constexpr size_t kMaxPrimitives = 512;

  Engine() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) {
    scratchpad_ = mmap(nullptr, kHalfGemmScratchpadBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (scratchpad_ == MAP_FAILED) throw Error("could not map the 16-bit products' scratchpad");
    scratchpad_memory_ = memory(memory::desc({static_cast<int64_t>(kHalfGemmScratchpadBytes)}, memory::data_type::u8,
                                             memory::dims{1}),
                                engine_, scratchpad_);
  }

  Call call(const Shape& s, const dnnl::matmul::primitive_desc& pd, int64_t rows) {
    const memory::data_type t = onednn_type(s.dtype);
    std::unordered_map<int, memory> args;
    args.emplace(DNNL_ARG_SRC, memory(memory::desc({rows, s.K}, t, memory::dims{s.a_row, s.a_col}), engine_, nullptr));
    args.emplace(DNNL_ARG_WEIGHTS, memory(memory::desc({s.K, s.N}, t, memory::dims{s.b_row, s.b_col}), engine_, nullptr));
    args.emplace(DNNL_ARG_DST,
                 memory(memory::desc({rows, s.N}, memory::data_type::f32, memory::dims{s.ldc, 1}), engine_, nullptr));
    args.emplace(DNNL_ARG_SCRATCHPAD, scratchpad_memory_);
    return {dnnl::matmul(pd), std::move(args)};
  }

  Entry& entry(const Shape& s) {
    auto it = cache_.find(s);
    if (it != cache_.end()) return it->second;
    MT_ASSERT(!kernel_locked(s.dtype).empty(), "a 16-bit product where oneDNN has no 16-bit kernel");
    if (cache_.size() >= kMaxPrimitives) cache_.clear();
    // Halve the rows a primitive computes until its scratchpad fits ours (oneDNN sizes it by
    // threads and blocking: a reduction split over K can want threads x M x N floats).
    int64_t rows = s.M;
    dnnl::matmul::primitive_desc pd = describe(s, rows);
    const size_t limit = std::min(s.scratchpad_limit, kHalfGemmScratchpadBytes);
    while (pd.scratchpad_desc().get_size() > limit) {
      if (rows <= 16)
        throw Error(fmt::format("oneDNN's {}x{}x{} product wants a scratchpad of {} bytes, more than the {} planned",
                                rows, s.N, s.K, pd.scratchpad_desc().get_size(), limit));
      rows = (rows + 1) / 2;
      pd = describe(s, rows);
    }
    const int64_t tail = s.M % rows;
    Entry e{rows, call(s, pd, rows), call(s, tail ? describe(s, tail) : pd, tail ? tail : rows), pd.impl_info_str(),
            std::string("oneDNN ") + pd.impl_info_str()};
    return cache_.emplace(s, std::move(e)).first->second;
  }

  dnnl::engine engine_;
  dnnl::stream stream_;
  void* scratchpad_ = nullptr;
  memory scratchpad_memory_;
  std::mutex mutex_;
  std::map<Shape, Entry> cache_;
  std::map<DType, std::string> kernels_;  // empty: no native kernel
};

}  // namespace

const std::string& half_gemm_kernel(DType dtype) { return Engine::get().kernel(dtype); }

const std::string& half_gemm_kernel(DType dtype, int64_t M, int64_t N, int64_t K, int64_t ldc) {
  return Engine::get().kernel(Shape{dtype, M, N, K, K, 1, N, 1, ldc, false, kHalfGemmScratchpadBytes});
}

bool tile_unit_kernel(const std::string& implementation) {
  return implementation.find("amx") != std::string::npos;
}

int64_t half_gemm(ProductFamily family, DType dtype, int64_t M, int64_t N, int64_t K, HalfMatrix A, HalfMatrix B,
                  float* C, int64_t ldc, bool accumulate, size_t scratchpad_limit) {
  if (M <= 0 || N <= 0) return M;
  MT_ASSERT(K > 0, "a 16-bit product over K = 0");
  return Engine::get().run(
      family,
      {dtype, M, N, K, A.row_stride, A.col_stride, B.row_stride, B.col_stride, ldc, accumulate, scratchpad_limit}, A,
      B, C);
}

namespace {
// out[i] = in[i] x scale rounded to bfloat16 (bf16) or float16.
inline void round_scaled(const float* in, uint16_t* out, int64_t n, bool bf16, float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16 ? f32_to_bf16(in[i] * scale) : f32_to_f16(in[i] * scale);
}
}  // namespace

void round_rows(const float* rows, int64_t count, int64_t n, int64_t stride, uint16_t* out, int64_t out_stride,
                DType dtype, float scale) {
  const bool bf16 = dtype == DType::BF16;
  MT_ASSERT(bf16 || dtype == DType::F16);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < count; ++r) round_scaled(rows + r * stride, out + r * out_stride, n, bf16, scale);
}

void round_rows_in_place(float* rows, int64_t count, int64_t n, int64_t stride, DType dtype, float scale) {
  const bool bf16 = dtype == DType::BF16;
  MT_ASSERT(bf16 || dtype == DType::F16);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < count; ++r) {
    char* row = reinterpret_cast<char*>(rows + r * stride);
    // A block of values is read whole before its 16-bit values are written: a block's writes
    // reach only bytes of values read in it or before it, so front to back is safe in place.
    constexpr int64_t kBlock = 64;
    float in[kBlock];
    uint16_t out[kBlock];
    for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
      const int64_t b = std::min(kBlock, n - i0);
      std::memcpy(in, row + 4 * i0, static_cast<size_t>(4 * b));
      round_scaled(in, out, b, bf16, scale);
      std::memcpy(row + 2 * i0, out, static_cast<size_t>(2 * b));
    }
  }
}

}  // namespace memtune::cpu
