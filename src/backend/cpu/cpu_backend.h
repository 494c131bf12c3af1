// The cpu backend: the Backend interface over the kernels of ops.h (OpenBLAS + OpenMP, float32).
// Its "device" memory is ordinary process memory, so host and device views are interchangeable
// and transfers are memcpy.
#pragma once

#include "backend/backend.h"

namespace memtune {

Backend& cpu_backend();

}  // namespace memtune
