// Collectives between the processes of a data-parallel run. One interface, two implementations:
// a single process (every collective is the identity) and MPI (Open MPI), selected by how the
// process was started: under `mpirun -np N` world size and rank come from MPI, otherwise the run
// is a single process and MPI is never initialized. NCCL will implement the same interface for
// GPU buffers, bootstrapped through MPI.
//
// Every collective must be called by all ranks in the same order with the same sizes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace memtune {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  bool is_root() const { return rank() == 0; }

  // In place: every rank ends with the elementwise sum over ranks.
  virtual void allreduce_sum(std::span<double> data) = 0;
  virtual void allreduce_sum(std::span<int64_t> data) = 0;
  virtual int64_t allreduce_max(int64_t value) = 0;
  // Non-blocking in-place sum: starts the reduction and returns; the data must not be touched
  // until wait_all(). progress() lets pending reductions advance (MPI progresses them only
  // inside MPI calls); wait_all() completes every started one.
  virtual void start_allreduce_sum(std::span<float> data) = 0;
  virtual void progress() = 0;
  virtual void wait_all() = 0;
  // Blocks: element range r of n is shard_of(n, r, world_size) (core/shard.h), i.e.
  // [n r / W, n (r+1) / W). In place: this rank's block of `data` ends as the sum over ranks
  // of that block; the other blocks are left unspecified.
  virtual void reduce_scatter_sum(std::span<float> data) = 0;
  // In place: each rank contributes its block of `data` (elements of elem_size bytes); every
  // rank ends with all blocks.
  virtual void allgather(std::span<std::byte> data, size_t elem_size) = 0;
  // Rank 0 receives every rank's block of n elements into `whole` (n floats; ignored elsewhere).
  virtual void gather_to_root(std::span<const float> block, size_t n, float* whole) = 0;
  virtual void barrier() = 0;
  // Stops every rank: the job ends with `code` (MPI_Abort); returns only for a single process.
  virtual void abort(int code) = 0;

  // Payload bytes this rank handed to collectives so far (what the algorithm must move is a
  // function of it: a ring allreduce sends 2 (N-1)/N of the payload per rank).
  uint64_t payload_bytes() const { return payload_bytes_; }

 protected:
  uint64_t payload_bytes_ = 0;
};

// The process's communicator: MPI when launched by mpirun (OMPI_COMM_WORLD_SIZE, PMIX_RANK or
// PMI_SIZE in the environment), else a single process. MPI is initialized on first use and
// finalized at exit.
Communicator& world();

// A single process, for tests and for code paths that never communicate.
std::unique_ptr<Communicator> make_single_process_communicator();

}  // namespace memtune
