// Simulating a lowered program: when each task runs on each rank, the step
// time, the idle (bubble) fraction and the peak activation memory per rank.
// The runtime records measured runs in the same Timeline type.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "schedule/program.h"

namespace torchmpmd::schedule {

enum class EventKind : uint8_t {
  kCompute,   // a task
  kTransfer,  // a message in flight (send start to arrival)
  kWait,      // a rank blocked on a receive
};

struct Event {
  EventKind kind = EventKind::kCompute;
  int32_t rank = 0;
  Task task;          // kCompute (and kWait: the task that waits)
  int32_t peer = -1;  // kTransfer: destination rank
  std::string label;  // kTransfer: what travels
  double start = 0;
  double end = 0;
};

struct Timeline {
  int32_t num_ranks = 0;
  std::vector<Event> events;
  // Per rank: peak bytes of activations held (simulated runs only).
  std::vector<int64_t> peak_activation_bytes;

  double step_time() const;  // first start to last end
  // Fraction of rank-time not spent computing, over [0, step_time()].
  double bubble_fraction() const;
  // Compute time per rank.
  std::vector<double> busy_time() const;
};

// Runs the program on a model of the machine: each rank executes its
// instructions in order, compute takes `costs`, messages take latency plus
// bytes over bandwidth and overlap with compute. Throws torchmpmd::Error if
// the program cannot complete (which lower() already rules out).
Timeline simulate(const Program& program, const Costs& costs);

}  // namespace torchmpmd::schedule
