// What the executor's source files share (private to them): the step's
// state, the device timer and small helpers. The executor is split along
// its seams: executor.cpp (construction, the program index, the main loop),
// executor_messages.cpp (receives posted ahead, sends, the tied-gradient
// exchange) and executor_tasks.cpp (forward, recompute, backward and its
// input- and weight-gradient halves).
#pragma once

#include "runtime/executor.h"

#include <ATen/Context.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include "runtime/memory.h"
#include "runtime/profiling.h"

#include <algorithm>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <ATen/ThreadLocalState.h>

namespace torchmpmd::runtime::internal {

using Clock = std::chrono::steady_clock;
using schedule::Instruction;
using schedule::Op;
using schedule::Payload;
using schedule::Task;
using schedule::TaskKind;

inline std::string shape_str(at::IntArrayRef shape, at::ScalarType dtype) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  out << (shape.size() == 1 ? ",)" : ")") << " " << c10::toString(dtype);
  return out.str();
}

inline std::string seconds(std::chrono::milliseconds ms) {
  std::ostringstream out;
  out << ms.count() / 1000.0 << " s";
  return out.str();
}

// An error that already carries its context: rethrown untouched by run().
class ExecutorError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) {
    return c10->what_without_backtrace();
  }
  return e.what();
}

// Task times on a device (CUDA): events recorded on the current stream
// around each task, read once at the end of the step. On a device the host
// only queues work (receives are stream waits), so host clocks would time
// the queueing, not the work.
class DeviceTimer {
 public:
  explicit DeviceTimer(at::Device device)
      : device_(device), impl_(device.type()) {
    start_ = mark();
  }

  size_t mark() {
    marks_.emplace_back(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    marks_.back().record(impl_.getStream(device_));
    return marks_.size() - 1;
  }

  // Waits (on the host, polling) until the device reached the last mark,
  // at most until `deadline`; false if it did not. `stop` is called while
  // waiting and may throw (an abort). Polls at least every 50 us: the step
  // ends when the device does, and a longer nap would add to every step.
  template <typename Stop>
  bool reached_end(Clock::time_point deadline, Stop stop) const {
    return poll_until(
        [&] {
          if (marks_.back().query()) return true;
          stop();
          return false;
        },
        deadline, std::chrono::microseconds(50));
  }

  // Nanoseconds from the step's start to mark `i` (the device reached it).
  int64_t ns(size_t i) const {
    return static_cast<int64_t>(marks_[start_].elapsedTime(marks_[i]) * 1e6);
  }

 private:
  at::Device device_;
  c10::impl::VirtualGuardImpl impl_;
  std::deque<c10::Event> marks_;  // c10::Event is not copyable
  size_t start_ = 0;
};

// The first compute (or reduce) after receive `recv` of `code` that reads
// it; code.size() if none does.
inline size_t first_reader(const std::vector<Instruction>& code, size_t recv) {
  for (size_t j = recv + 1; j < code.size(); ++j) {
    if (schedule::reads(code[j], code[recv])) return j;
  }
  return code.size();
}

}  // namespace torchmpmd::runtime::internal

namespace torchmpmd::runtime {

struct Executor::State {
  using Key = std::pair<int32_t, int32_t>;  // (value or stage, microbatch)
  struct Activation {
    at::Tensor tensor;
    int32_t uses = 0;
  };
  struct Posted {
    std::unique_ptr<Request> request;
    at::Tensor buffer;
    bool early = false;
  };
  struct Sending {
    std::unique_ptr<Request> request;
    size_t index;
  };
  std::map<Key, Activation> acts;
  std::map<Key, std::vector<at::Tensor>> outputs;
  std::map<Key, std::vector<at::Tensor>> leaves;
  std::map<Key, std::vector<at::Tensor>> saved;    // split: F -> I
  std::map<Key, std::vector<at::Tensor>> saved_w;  // split: I -> W
  std::map<Key, std::vector<at::Tensor>> kept;     // recomputed: F -> R
  std::map<Key, at::Tensor> rng;                   // recomputed: F -> R
  std::map<Key, std::map<int32_t, at::Tensor>> grad_parts;
  std::map<int32_t, std::map<int32_t, at::Tensor>> tied_parts;
  // The .grad a tied parameter had before this step (earlier steps'
  // accumulation), held aside so that only this step's part is exchanged.
  std::map<int32_t, at::Tensor> tied_before;
  std::map<size_t, Posted> recvs;
  std::vector<Sending> sends;
  // Sends the peer's reply proved delivered (see delivered_by_).
  std::set<size_t> delivered;
  std::vector<bool> issued;
  int32_t early_outstanding = 0;
  internal::Clock::time_point t0;
  const StageFunctions* fns = nullptr;  // this step's stage callables
  // On a device: the marks around each record's task (start, end).
  std::optional<internal::DeviceTimer> device;
  std::vector<std::pair<size_t, size_t>> device_marks;
  HeldMemory* memory = nullptr;  // measuring: what the step holds
  // A fused task whose two sides run at once (Executor::run_sides): each
  // side holds `mu` while it touches this state and lets go of it around
  // its long calls and waits (Unlocked).
  std::mutex mu;
  bool concurrent = false;
  // The running fused task's parts as they ran, for its record.
  std::vector<TaskRecord::PartTime> part_times;
};

namespace internal {

// Lets the other side of a fused task at the step's state for the scope
// (a stage's callable, autograd, a wait), when the sides run at once.
// (A template: Executor::State is private to the executor's members.)
template <typename State>
class Unlocked {
 public:
  explicit Unlocked(State& st) : st_(st) {
    if (st_.concurrent) st_.mu.unlock();
  }
  ~Unlocked() {
    if (st_.concurrent) st_.mu.lock();
  }
  Unlocked(const Unlocked&) = delete;
  Unlocked& operator=(const Unlocked&) = delete;

 private:
  State& st_;
};

// Nanoseconds from the step's start to `t`.
template <typename State>
int64_t since(const State& st, Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t - st.t0)
      .count();
}

}  // namespace internal

}  // namespace torchmpmd::runtime
