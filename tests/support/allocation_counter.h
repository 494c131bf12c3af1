// Counts C++ heap allocations (global operator new) between start and stop, so tests can prove
// that a compute step takes all its memory from the arena.
#pragma once

namespace memtune::testing_support {

void start_counting_allocations();
// Returns the number of operator new calls since start.
long stop_counting_allocations();

}  // namespace memtune::testing_support
