#include "distributed/communicator.h"

// The C API only (Open MPI's header would otherwise pull in its deprecated C++ bindings).
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/shard.h"

namespace memtune {

namespace {

class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  void allreduce_sum(std::span<double>) override {}
  void allreduce_sum(std::span<int64_t>) override {}
  int64_t allreduce_max(int64_t value) override { return value; }
  void start_allreduce_sum(std::span<float>) override {}
  void progress() override {}
  void wait_all() override {}
  void reduce_scatter_sum(std::span<float>) override {}
  void allgather(std::span<std::byte>, size_t) override {}
  void gather_to_root(std::span<const float> block, size_t n, float* whole) override {
    MT_ASSERT(block.size() == n);
    std::memcpy(whole, block.data(), block.size_bytes());
  }
  void barrier() override {}
  void abort(int) override {}
};

void check(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw Error(fmt::format("MPI {} failed: {}", what, std::string(text, static_cast<size_t>(length))));
}

// Large buffers go in pieces: MPI counts are int.
constexpr size_t kMaxCount = size_t{1} << 30;

class Mpi final : public Communicator {
 public:
  Mpi() {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
    // Errors come back as codes (turned into memtune errors) instead of aborting inside MPI.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  ~Mpi() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }
  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  void allreduce_sum(std::span<double> data) override { allreduce(data.data(), data.size(), MPI_DOUBLE, 8); }
  void allreduce_sum(std::span<int64_t> data) override { allreduce(data.data(), data.size(), MPI_INT64_T, 8); }
  int64_t allreduce_max(int64_t value) override {
    payload_bytes_ += 8;
    check(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD), "allreduce");
    return value;
  }
  void start_allreduce_sum(std::span<float> data) override {
    payload_bytes_ += data.size_bytes();
    for (size_t at = 0; at < data.size(); at += kMaxCount) {
      pending_.emplace_back();
      check(MPI_Iallreduce(MPI_IN_PLACE, data.data() + at, static_cast<int>(std::min(kMaxCount, data.size() - at)),
                           MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &pending_.back()),
            "allreduce");
    }
  }
  void progress() override {
    if (pending_.empty()) return;
    int done = 0;
    check(MPI_Testall(static_cast<int>(pending_.size()), pending_.data(), &done, MPI_STATUSES_IGNORE), "test");
  }
  void wait_all() override {
    if (pending_.empty()) return;
    check(MPI_Waitall(static_cast<int>(pending_.size()), pending_.data(), MPI_STATUSES_IGNORE), "wait");
    pending_.clear();
  }
  void reduce_scatter_sum(std::span<float> data) override {
    blocks(data.size());
    payload_bytes_ += data.size_bytes();
    // In place, MPI leaves this rank's result at the start of the buffer: move it to its block.
    check(MPI_Reduce_scatter(MPI_IN_PLACE, data.data(), counts_.data(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
          "reduce_scatter");
    std::memmove(data.data() + displs_[rank_], data.data(), static_cast<size_t>(counts_[rank_]) * sizeof(float));
  }
  void allgather(std::span<std::byte> data, size_t elem_size) override {
    MT_ASSERT(data.size() % elem_size == 0);
    blocks(data.size() / elem_size);
    payload_bytes_ += data.size();
    MPI_Datatype element;
    check(MPI_Type_contiguous(static_cast<int>(elem_size), MPI_BYTE, &element), "type");
    MPI_Type_commit(&element);
    const int code = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data.data(), counts_.data(), displs_.data(),
                                    element, MPI_COMM_WORLD);
    MPI_Type_free(&element);
    check(code, "allgather");
  }
  void gather_to_root(std::span<const float> block, size_t n, float* whole) override {
    blocks(n);
    MT_ASSERT(static_cast<int>(block.size()) == counts_[rank_]);
    payload_bytes_ += block.size_bytes();
    check(MPI_Gatherv(block.data(), counts_[rank_], MPI_FLOAT, whole, counts_.data(), displs_.data(), MPI_FLOAT, 0,
                      MPI_COMM_WORLD),
          "gather");
  }
  void barrier() override { check(MPI_Barrier(MPI_COMM_WORLD), "barrier"); }
  void abort(int code) override { MPI_Abort(MPI_COMM_WORLD, code); }

 private:
  void allreduce(void* data, size_t count, MPI_Datatype type, size_t elem) {
    payload_bytes_ += count * elem;
    for (size_t at = 0; at < count; at += kMaxCount)
      check(MPI_Allreduce(MPI_IN_PLACE, static_cast<char*>(data) + at * elem,
                          static_cast<int>(std::min(kMaxCount, count - at)), type, MPI_SUM, MPI_COMM_WORLD),
            "allreduce");
  }
  // counts_ and displs_ of the blocks of n elements (see Communicator::reduce_scatter_sum).
  void blocks(size_t n) {
    MT_ASSERT(n < (size_t{1} << 31), "a tensor of 2^31 or more elements");
    counts_.resize(static_cast<size_t>(size_));
    displs_.resize(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      const Shard s = shard_of(n, r, size_);
      displs_[r] = static_cast<int>(s.begin);
      counts_[r] = static_cast<int>(s.size());
    }
  }
  int rank_ = 0, size_ = 1;
  std::vector<int> counts_, displs_;
  std::vector<MPI_Request> pending_;
};

bool launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE"})
    if (std::getenv(var)) return true;
  return false;
}

}  // namespace

Communicator& world() {
  static const std::unique_ptr<Communicator> instance =
      launched_by_mpi() ? std::unique_ptr<Communicator>(new Mpi()) : make_single_process_communicator();
  return *instance;
}

std::unique_ptr<Communicator> make_single_process_communicator() {
  return std::make_unique<SingleProcess>();
}

}  // namespace memtune
