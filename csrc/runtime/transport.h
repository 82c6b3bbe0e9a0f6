// Point-to-point transports the executor sends and receives through.
//
// Contract: isend/irecv start an operation and never block. Messages between
// a pair of ranks are matched by tag; the executor issues them in the order
// the lowering fixed (the same on both ends), which NCCL requires and Gloo
// tolerates. Every wait takes a timeout and throws TransportError (naming
// what happened) when it expires or the peer fails: nothing waits forever.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace c10d {
class ProcessGroup;
class Store;
class Work;
}  // namespace c10d

namespace torchmpmd::runtime {

class TransportError : public std::runtime_error {
 public:
  enum class Kind {
    kFailed,    // the operation failed (a peer closed its connection, ...)
    kTimedOut,  // nothing happened before the timeout
    kAborted,   // the transport was aborted: what() is the reason
  };
  TransportError(const std::string& what, Kind kind)
      : std::runtime_error(what), kind_(kind) {}
  Kind kind() const { return kind_; }
  bool timed_out() const { return kind_ == Kind::kTimedOut; }
  bool aborted() const { return kind_ == Kind::kAborted; }

 private:
  Kind kind_;
};

// Whether, and why, a transport was aborted. Set once (the first reason
// wins); read without a lock on every wait. Thread-safe.
class AbortState {
 public:
  // True if this call set the reason (the transport was not aborted yet).
  bool set(const std::string& reason);
  bool is_set() const { return set_.load(std::memory_order_acquire); }
  std::optional<std::string> reason() const;
  // Throws TransportError(kAborted) if set.
  void check() const;

 private:
  std::atomic<bool> set_{false};
  mutable std::mutex mutex_;
  std::string reason_;
};

// One posted send or receive. Not thread-safe: owned by one executor.
class Request {
 public:
  virtual ~Request() = default;
  // Non-blocking: true once complete. Throws TransportError if it failed.
  virtual bool test() = 0;
  // Blocks until complete or `timeout` passes; throws TransportError on
  // failure or timeout. On a device (NCCL) it is stream-ordered instead:
  // the current stream waits for the operation, the host returns at once.
  virtual void wait(std::chrono::milliseconds timeout) = 0;
};

// Calls `done` with a growing pause between calls (1 us doubling to
// `max_pause`) until it returns true (then true) or `deadline` passes (then
// false). For host waits on device work, which has no blocking wait with
// a timeout.
template <typename Done>
bool poll_until(
    Done done, std::chrono::steady_clock::time_point deadline,
    std::chrono::microseconds max_pause = std::chrono::microseconds(500)) {
  auto pause = std::chrono::microseconds(1);
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, max_pause);
  }
  return true;
}

// Blocks the host until `request` (an operation on `tensor`) completed,
// also on a device, where Request::wait only orders the current stream.
void wait_on_host(Request& request, const at::Tensor& tensor,
                  std::chrono::milliseconds timeout);

class Transport {
 public:
  Transport() : abort_(std::make_shared<AbortState>()) {}
  explicit Transport(std::shared_ptr<AbortState> abort)
      : abort_(std::move(abort)) {}
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
  // Whether operations between two ranks must be issued in the same order
  // on both ends (NCCL), rather than matched by tag whatever the order
  // (Gloo, in-process). Only then does the executor hold a receive back
  // behind an earlier send to the same peer.
  virtual bool issues_in_pair_order() const { return false; }
  // Whether a completed request means the data has arrived (Gloo,
  // in-process). A stream-ordered transport (NCCL) completes a receive
  // before its data is there, so a peer's reply proves nothing about an
  // earlier send.
  virtual bool completion_means_delivered() const { return true; }
  // The device whose tensors it exchanges: where a runner over it computes
  // unless told otherwise.
  virtual c10::DeviceType device_type() const { return c10::DeviceType::CPU; }

  // Failure handling (thread-safe). abort() makes every wait of this
  // transport, pending or later, fail at once with a TransportError of kind
  // kAborted carrying `reason` (the first reason wins). What was posted is
  // abandoned, so an aborted transport cannot run another step.
  void abort(const std::string& reason);
  // This rank failed: tells the other ranks (c10d: a key in the group's
  // store; local: the shared world), so they abort too, then aborts.
  virtual void fail(const std::string& reason) { abort(reason); }
  // While armed (arm() calls outnumber disarm() calls), the transport
  // watches for another rank's fail() and aborts itself when it sees one.
  virtual void arm() {}
  virtual void disarm() {}
  std::optional<std::string> abort_reason() const { return abort_->reason(); }

 protected:
  // Called once, by the abort() that set the reason: wake blocked waits.
  virtual void on_abort() {}
  const std::shared_ptr<AbortState>& abort_state() const { return abort_; }

 private:
  std::shared_ptr<AbortState> abort_;
};

// torch.distributed process groups: Gloo on CPU, NCCL on CUDA. Pipeline
// rank r is rank r of the group.
//
// With a store (the group's c10d store, shared by its ranks), a failing rank
// writes its reason under `key`; armed peers poll the key every
// `poll_interval` from a background thread and abort when it appears.
class C10dTransport : public Transport {
 public:
  explicit C10dTransport(
      c10::intrusive_ptr<c10d::ProcessGroup> group,
      c10::intrusive_ptr<c10d::Store> store = {}, std::string key = {},
      std::chrono::milliseconds poll_interval = std::chrono::milliseconds(50));
  ~C10dTransport() override;
  int rank() const override;
  int size() const override;
  std::unique_ptr<Request> isend(const at::Tensor& tensor, int peer,
                                 int64_t tag) override;
  std::unique_ptr<Request> irecv(const at::Tensor& tensor, int peer,
                                 int64_t tag) override;
  std::string name() const override;
  bool issues_in_pair_order() const override;
  bool completion_means_delivered() const override;
  c10::DeviceType device_type() const override;
  void fail(const std::string& reason) override;
  void arm() override;
  void disarm() override;

  // Posted requests, so that abort() can interrupt their waits.
  struct Live;

 protected:
  void on_abort() override;

 private:
  struct Watch;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::shared_ptr<Live> live_;
  std::shared_ptr<Watch> watch_;  // null without a store
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
  // A sent tensor's copy; on a device, with an event recorded behind the
  // copy on the sender's stream (the receiver's stream waits for it).
  struct Message {
    at::Tensor tensor;
    std::optional<c10::Event> ready;
  };
  const int size_;
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::map<Key, std::deque<Message>> mailbox_;  // FIFO per key, as Gloo
  std::set<int> dead_;
  // Shared by every rank's transport: one rank's fail() aborts them all.
  std::shared_ptr<AbortState> abort_ = std::make_shared<AbortState>();
};

}  // namespace torchmpmd::runtime
