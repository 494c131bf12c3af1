// The reference backend: every op as the plainest loop that states it, single-threaded, sums in
// float64, no BLAS. It is slow on purpose and is the oracle for the op tests (every other
// backend is compared with it) and for whole-model runs.
//
// It also plays a device: its memory is mapped PROT_NONE outside its own calls, so host code
// that dereferences arena memory instead of going through copy_to_host / copy_to_device
// crashes (SIGSEGV) in tests, before any GPU exists. Host losses and observers get the logits
// chunk through host staging, exactly as they would from a GPU.
#pragma once

#include "backend/backend.h"

namespace memtune {

Backend& reference_backend();

}  // namespace memtune
