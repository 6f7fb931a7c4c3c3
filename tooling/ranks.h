// Tensor-parallel ranks as processes on one host, for `decodepack run` of a tensor_parallel > 1 bundle:
// rank 0 is the calling process, which forks one child per other rank before anything touches the GPU
// driver (a forked child must not inherit a CUDA context); each rank then opens its own context on the
// device (several ranks may share one GPU: CUDA IPC works within one device, and the driver time-slices
// the contexts).
//
// The ranks meet in a rendezvous directory: a rank publishes a named blob as a file written aside and
// renamed into place (so a reader never sees half of one), and gathers a name by waiting until every
// rank's file exists. A gather also watches the other processes: rank 0 reaps a child that exited (and
// fails with the error the child left behind), a child fails when rank 0 is gone; past the wait bound
// the gather fails naming the ranks still missing. Rank 0 kills and reaps the children when it leaves
// (normally or by an exception), so no rank outlives the run.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace dp::tools {

class RankGroup {
 public:
  // Forks ranks 1..size-1; each child runs child(rank) and exits 0, or, on an exception, leaves its
  // message in the directory for rank 0 and exits 1. Returns in rank 0 only. `dir` is created and
  // removed with the group.
  RankGroup(int size, const std::function<void(int rank, RankGroup& group)>& child);
  ~RankGroup();
  RankGroup(const RankGroup&) = delete;
  RankGroup& operator=(const RankGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // How long a gather waits for the slowest rank (rank 0's layer checks can take minutes).
  std::chrono::seconds wait_bound{900};

  void publish(const std::string& name, const void* data, size_t bytes);
  void publish(const std::string& name, const std::vector<uint8_t>& b) { publish(name, b.data(), b.size()); }
  // Every rank's blob of `name`, in rank order (this rank's too). Throws dp::Error(device) when a rank
  // died or the bound passed.
  std::vector<std::vector<uint8_t>> gather(const std::string& name);
  // Only rank `from`'s blob of `name`.
  std::vector<uint8_t> receive(const std::string& name, int from);
  void barrier(const std::string& name) { publish(name, nullptr, 0), gather(name); }

  // Rank 0: waits (up to the bound) for every child to exit; throws naming a child that failed.
  void join();

 private:
  std::filesystem::path file(const std::string& name, int rank) const;
  void watch() const;  // throws when a peer process is gone
  bool wait_for(const std::string& name, const std::vector<int>& ranks);

  int size_ = 1, rank_ = 0;
  std::filesystem::path dir_;
  std::vector<pid_t> children_;  // rank 0: pid of rank r at r - 1
  mutable std::vector<bool> reaped_;
  pid_t parent_ = 0;
};

}  // namespace dp::tools
