// Tasks: the unit a schedule orders. A schedule is, per rank, an ordered list
// of tasks (JaxPP's model), each one piece of work (a kind of task_kinds.h)
// of one stage on one microbatch.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "schedule/task_kinds.h"

namespace torchmpmd::schedule {

struct Task {
  TaskKind kind = TaskKind::kForward;
  int32_t stage = 0;
  int32_t microbatch = 0;

  bool operator==(const Task& o) const {
    return kind == o.kind && stage == o.stage && microbatch == o.microbatch;
  }
  bool operator!=(const Task& o) const { return !(*this == o); }
  bool operator<(const Task& o) const {
    return std::tie(stage, microbatch, kind) <
           std::tie(o.stage, o.microbatch, o.kind);
  }
  bool is_backward() const { return info(kind).backward; }
};

// "F(stage=2, mb=5)": for messages.
std::string to_string(const Task& task);
// "2F5": torch.distributed.pipelining's action format (stage, kind, mb).
std::string to_action(const Task& task);
// Parses "2F5"; throws torchmpmd::Error naming the text when malformed.
Task parse_action(const std::string& text);

// What a stage's data parallelism does around its tasks of a training step,
// as torch.distributed.pipelining's UNSHARD / RESHARD / REDUCE_GRAD actions:
// the lowering places them in the program (Op::kUnshard, Op::kReduceGrads),
// the simulator charges them (Costs) and the executor runs them.
struct StageCollectives {
  // Gather the stage's parameters before its first task (FSDP's unshard).
  bool unshard = false;
  // Reduce the stage's gradients right after its last task that finishes
  // them, beside the rest of the schedule (and reshard an unsharded stage).
  bool reduce_grads = false;
};

struct ScheduleSpec {
  int32_t num_ranks = 0;
  int32_t num_microbatches = 0;
  std::vector<int32_t> placement;        // stage -> rank
  std::vector<std::vector<Task>> tasks;  // per rank, in execution order
  bool forward_only = false;             // F tasks only (evaluation)
  // Per stage, or empty: no data parallelism. Forward-only programs get
  // none (a data parallelism gathers for evaluation by itself).
  std::vector<StageCollectives> collectives;
};

}  // namespace torchmpmd::schedule
