// Timelines: when each task ran on each rank, predicted (simulate.h) or
// measured (the runtime), and the one definition of their step time and
// bubble fraction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "schedule/task.h"

namespace torchmpmd::schedule {

struct TimelineStats {
  double step_time = 0;
  double bubble_fraction = 0;
};

// Over task intervals (compute only, not transfers or waits), one per entry
// of the three lists: step time = last end - first start; bubble fraction =
// 1 - busy / (step time * number of distinct ranks with tasks). Both 0 for
// no tasks. Predicted and measured timelines both use this. Intervals whose
// entry of `busy` is false (data-parallel collectives) count toward the step
// time only (empty `busy`: all count as busy).
TimelineStats timeline_stats(const std::vector<int32_t>& ranks,
                             const std::vector<double>& starts,
                             const std::vector<double>& ends,
                             const std::vector<bool>& busy = {});

enum class EventKind : uint8_t {
  kCompute,   // a task
  kTransfer,  // a message in flight (send start to arrival)
  kWait,      // a rank blocked on a receive
  // A data-parallel collective of stage `task.stage` (label: "unshard" or
  // "reduce_grads").
  kCollective,
};

struct Event {
  EventKind kind = EventKind::kCompute;
  int32_t rank = 0;
  Task task;          // kCompute (and kWait: the task that waits)
  int32_t peer = -1;  // kTransfer: destination rank
  std::string label;  // kTransfer: what travels; kCollective: which
  double start = 0;
  double end = 0;
};

struct Timeline {
  int32_t num_ranks = 0;
  std::vector<Event> events;
  // Per rank: peak bytes of activations held (simulated runs only), and of
  // activations plus unsharded parameters (Costs::unsharded_bytes).
  std::vector<int64_t> peak_activation_bytes;
  std::vector<int64_t> peak_bytes;

  // timeline_stats() of the compute and collective events.
  double step_time() const;
  double bubble_fraction() const;
  // Compute time per rank.
  std::vector<double> busy_time() const;

 private:
  TimelineStats stats() const;
};

}  // namespace torchmpmd::schedule
