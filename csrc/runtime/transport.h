// Point-to-point transports the executor sends and receives through.
//
// Contract: isend/irecv start an operation and never block. Messages between
// a pair of ranks are matched by tag; the executor issues them in the order
// the lowering fixed (the same on both ends), which NCCL requires and Gloo
// tolerates. Every wait takes a timeout and throws TransportError (naming
// what happened) when it expires or the peer fails: nothing waits forever.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace torchmpmd::runtime {

class TransportError : public std::runtime_error {
 public:
  TransportError(const std::string& what, bool timed_out)
      : std::runtime_error(what), timed_out_(timed_out) {}
  bool timed_out() const { return timed_out_; }

 private:
  bool timed_out_;
};

// One posted send or receive. Not thread-safe: owned by one executor.
class Request {
 public:
  virtual ~Request() = default;
  // Non-blocking: true once complete. Throws TransportError if it failed.
  virtual bool test() = 0;
  // Blocks until complete or `timeout` passes; throws TransportError on
  // failure or timeout.
  virtual void wait(std::chrono::milliseconds timeout) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Starts sending `tensor` (contiguous) to `peer`. The tensor must not be
  // modified until the request completes. Never blocks.
  virtual std::unique_ptr<Request> isend(const at::Tensor& tensor, int peer,
                                         int64_t tag) = 0;
  // Starts receiving into `tensor` (contiguous, preallocated). Never blocks.
  virtual std::unique_ptr<Request> irecv(const at::Tensor& tensor, int peer,
                                         int64_t tag) = 0;
  virtual std::string name() const = 0;
};

// torch.distributed process groups: Gloo on CPU, NCCL on CUDA. Pipeline
// rank r is rank r of the group.
class C10dTransport : public Transport {
 public:
  explicit C10dTransport(c10::intrusive_ptr<c10d::ProcessGroup> group);
  ~C10dTransport() override;
  int rank() const override;
  int size() const override;
  std::unique_ptr<Request> isend(const at::Tensor& tensor, int peer,
                                 int64_t tag) override;
  std::unique_ptr<Request> irecv(const at::Tensor& tensor, int peer,
                                 int64_t tag) override;
  std::string name() const override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

// Ranks as threads of one process, exchanging tensors in memory with the
// same matching rules. Thread-safe; shared by every rank's transport.
class LocalWorld : public std::enable_shared_from_this<LocalWorld> {
 public:
  explicit LocalWorld(int size);
  int size() const { return size_; }
  std::shared_ptr<Transport> transport(int rank);
  // Marks `rank` as gone: its peers' pending and future receives from it
  // fail at once, as a dead process's would.
  void kill(int rank);

 private:
  friend class LocalTransport;
  friend class LocalRecv;
  using Key = std::tuple<int, int, int64_t>;  // src, dst, tag
  const int size_;
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::map<Key, std::deque<at::Tensor>> mailbox_;  // FIFO per key, as Gloo
  std::set<int> dead_;
};

}  // namespace torchmpmd::runtime
