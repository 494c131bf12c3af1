// Tensor views: what the backend interface passes instead of raw pointers. A view does not own
// memory; it says where the bytes are (in the backend's memory: host code only forms views and
// hands them to the backend), what they hold (dtype) and their shape (up to three dimensions,
// row-major). Ops check views against what they expect, so a float32 op handed a bfloat16
// weight fails loudly instead of computing garbage. That host code never dereferences a view is
// enforced by the reference backend, whose memory is locked outside its own calls.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "core/dtype.h"
#include "core/error.h"

namespace memtune {

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  std::array<int64_t, 3> dims{0, 0, 0};
  int rank = 0;

  Tensor() = default;
  Tensor(void* data, DType dtype, std::initializer_list<int64_t> shape) : data(data), dtype(dtype) {
    MT_ASSERT(shape.size() >= 1 && shape.size() <= 3, "a tensor view has 1 to 3 dimensions");
    for (int64_t d : shape) dims[static_cast<size_t>(rank++)] = d;
  }
  explicit operator bool() const { return data != nullptr; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= dims[static_cast<size_t>(i)];
    return n;
  }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  // A matrix's rows (all leading dimensions) and columns (the last one).
  int64_t cols() const { return rank ? dims[static_cast<size_t>(rank - 1)] : 0; }
  int64_t rows() const { return cols() ? numel() / cols() : 0; }
  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
  // Checked element pointers for the kernels: a float32 view (or none), an int32 view.
  float* f32() const {
    MT_ASSERT(!data || dtype == DType::F32, "expected a float32 view");
    return as<float>();
  }
  const int32_t* i32() const {
    MT_ASSERT(data && dtype == DType::I32, "expected an int32 view");
    return as<const int32_t>();
  }
  // Elements [begin, begin + n) as a flat view.
  Tensor flat_range(int64_t begin, int64_t n) const {
    MT_ASSERT(begin >= 0 && begin + n <= numel(), "range outside the tensor");
    return Tensor(static_cast<std::byte*>(data) + static_cast<size_t>(begin) * dtype_size(dtype), dtype, {n});
  }
};

}  // namespace memtune
