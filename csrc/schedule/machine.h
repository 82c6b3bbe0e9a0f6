// The one machine model: lower() runs a schedule on it to choose the global
// order of tasks, simulate() runs the lowered program on it to predict the
// timeline, so the order is chosen by the same times that are predicted.
//
// Each rank runs one task at a time; a task takes its cost (Costs::of). A
// message occupies the link from its sender to its receiver for its wire
// time (bytes over bandwidth), one message at a time per link, and arrives
// `latency` after it leaves the wire. With `overlap_comm` the sender goes on
// computing meanwhile; without it, the sender is busy for the wire time. A
// task starts when its rank is free and every message it reads has arrived.
// A data-parallel unshard blocks its rank for its cost; a gradient reduction
// occupies the rank's collective channel (one at a time) and, with
// `overlap_comm`, leaves the rank computing meanwhile.
//
// A fused task with a measured time of its own (Costs::fused_time: its
// parts overlap) starts when the messages all its parts read have arrived,
// takes that time, and its messages leave when it ends. Without one it runs
// as the executor runs it now: its parts one after the other, each part's
// messages leaving as that part ends (Instruction::part), so that it takes
// the sum of its parts' times; simulate() starts each part once its own
// inputs have arrived, as the executor does, and lower() orders the task
// as one step that needs all its parts' inputs (so that overlapping them
// cannot deadlock).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "schedule/costs.h"
#include "schedule/instruction.h"

namespace torchmpmd::schedule {

class Machine {
 public:
  struct Interval {
    double start = 0;
    double end = 0;
  };

  Machine(int32_t num_ranks, Costs costs);

  // When `rank` is next free.
  double clock(int32_t rank) const { return clock_.at(rank); }
  double compute_time(const Task& task) const { return costs_.of(task); }
  // Whether `task` is fused and runs part by part (no measured time).
  bool runs_parts(const Task& task) const {
    return task.fused() && !costs_.has_fused_time(task) &&
           !costs_.overlaps(task);
  }
  // Starts the send `ins` of `rank` once the rank and the link are free;
  // returns when it left and when it arrives.
  Interval send(int32_t rank, const Instruction& ins);
  // Posts the receive `ins` of `rank`.
  void post(int32_t rank, const Instruction& ins);
  // Earliest start of the compute or reduce `ins` on `rank`: its clock and
  // the arrival of every posted receive it reads; nullopt while one of them
  // has not been sent yet.
  std::optional<double> ready(int32_t rank, const Instruction& ins) const;
  // Runs the compute, tied reduce or unshard `ins` from `start` (at least
  // ready()), consuming the receives it reads; returns its end (a tied
  // reduce takes no time). A fused task that runs_parts() is run one part
  // at a time, each as a compute of its own. A compute takes `scale` x its
  // cost (the cores' share it gets: Costs::sharing).
  double run(int32_t rank, const Instruction& ins, double start,
             double scale = 1.0);
  // ready() and run() of a compute of the simple task `task` alone: a part
  // of a fused task that runs part by part.
  std::optional<double> ready(int32_t rank, const Task& task) const;
  double run(int32_t rank, const Task& task, double start, double scale = 1.0);
  // Starts the gradient reduction `ins` of `rank` once the rank and its
  // collective channel are free; returns when it runs.
  Interval reduce_grads(int32_t rank, const Instruction& ins);

 private:
  // When the receives of `rank` that `user` reads have arrived (with its
  // clock); nullopt while one has not been sent.
  template <typename Reads>
  std::optional<double> arrivals(int32_t rank, Reads user) const;
  // Forgets the receives of `rank` that `user` reads (it consumed them).
  template <typename Reads>
  void consume(int32_t rank, Reads user);

  Costs costs_;
  std::vector<double> clock_;
  std::vector<double> collective_free_;                      // per rank
  std::map<std::pair<int32_t, int32_t>, double> link_free_;  // (src, dst)
  std::map<std::tuple<int32_t, int32_t, int64_t>, double> arrival_;
  std::vector<std::vector<Instruction>> posted_;  // per rank, not yet read
};

}  // namespace torchmpmd::schedule
