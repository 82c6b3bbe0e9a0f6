// The executor in torch.profiler: each task, and each wait for a receive,
// is a range of the trace, as `torch.profiler.record_function(name)` opens
// one (a RecordFunction of USER_SCOPE, "user_annotation" in the Chrome /
// Perfetto trace), so the schedule shows next to the ops it ran.
//
// torch.profiler records RecordFunction ranges through callbacks that are
// thread-local to the thread that started it (as is its state, in the
// PROFILER_STATE slot of ThreadLocalDebugInfo). The executor runs on the
// thread that calls `run()`, so a profiler around a step sees it; work run
// for that thread on another one (ranks as threads of one process) joins
// its profiler under a ProfilerContextGuard, as torch's autograd engine
// carries the caller's thread-local state into its device threads.
#pragma once

#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <memory>
#include <string>

namespace torchmpmd::runtime {

// A profiler range for the lifetime of the object. `name()` (a callable
// returning the name) is called only when a profiler records: without one
// the range costs the check RecordFunction makes for every op.
class ProfilerRange {
 public:
  template <typename NameFn>
  explicit ProfilerRange(NameFn&& name) : range_(at::RecordScope::USER_SCOPE) {
    if (range_.isActive()) {
      const std::string text = name();
      range_.before(text, c10::ArrayRef<const c10::IValue>{});
    }
  }
  ProfilerRange(const ProfilerRange&) = delete;
  ProfilerRange& operator=(const ProfilerRange&) = delete;

 private:
  at::RecordFunction range_;
};

// What makes a thread record into a profiler: its RecordFunction callbacks
// and the profiler state they write to (ThreadLocalDebugInfo).
class ProfilerContext {
 public:
  // The calling thread's.
  static ProfilerContext current();
  // Whether a profiler records on that thread (it has thread-local
  // RecordFunction callbacks; global ones reach every thread anyway).
  bool active() const { return !callbacks_.sorted_tls_callbacks_.empty(); }

 private:
  friend class ProfilerContextGuard;
  at::RecordFunctionTLS callbacks_;
  std::shared_ptr<c10::ThreadLocalDebugInfo> debug_info_;
};

// Makes the calling thread record into `context`'s profiler until it goes
// out of scope; the thread's own callbacks and state come back then.
class ProfilerContextGuard {
 public:
  explicit ProfilerContextGuard(const ProfilerContext& context);
  ~ProfilerContextGuard();
  ProfilerContextGuard(const ProfilerContextGuard&) = delete;
  ProfilerContextGuard& operator=(const ProfilerContextGuard&) = delete;

 private:
  at::RecordFunctionTLS saved_callbacks_;
  c10::DebugInfoGuard debug_info_;
};

}  // namespace torchmpmd::runtime
