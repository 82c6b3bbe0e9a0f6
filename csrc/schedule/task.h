// Tasks: the unit a schedule orders. A schedule is, per rank, an ordered list
// of tasks (JaxPP's model), each one piece of work (a kind of task_kinds.h)
// of one stage on one microbatch, or a fused (composite) task: two or more
// such simple tasks of one rank that run as one step (torch's OVERLAP_F_B
// action with sub-actions, JaxPP's FusedTask), as DualPipeV pairs a forward
// with a backward.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "schedule/task_kinds.h"

namespace torchmpmd::schedule {

struct Task {
  // A simple task: its kind, stage and microbatch. A fused task answers its
  // first part's, so that what needs only a representative (the rank, a
  // position) works on it; whatever acts on what a task computes (its
  // dependencies, messages, cost, memory, execution) iterates simple_parts().
  TaskKind kind = TaskKind::kForward;
  int32_t stage = 0;
  int32_t microbatch = 0;
  // A fused task's parts, simple tasks in the order they run; empty for a
  // simple task. Build fused tasks with fuse().
  std::vector<Task> parts;

  Task() = default;
  Task(TaskKind kind_, int32_t stage_, int32_t microbatch_)
      : kind(kind_), stage(stage_), microbatch(microbatch_) {}

  bool fused() const { return !parts.empty(); }
  // The simple tasks it runs: its parts, or itself alone. Valid while the
  // task lives and is not changed.
  struct Parts {
    const Task* first;
    const Task* last;
    const Task* begin() const { return first; }
    const Task* end() const { return last; }
    size_t size() const { return static_cast<size_t>(last - first); }
  };
  Parts simple_parts() const {
    if (parts.empty()) return {this, this + 1};
    return {parts.data(), parts.data() + parts.size()};
  }

  bool operator==(const Task& o) const {
    return kind == o.kind && stage == o.stage && microbatch == o.microbatch &&
           parts == o.parts;
  }
  bool operator!=(const Task& o) const { return !(*this == o); }
  bool operator<(const Task& o) const {
    return std::tie(stage, microbatch, kind, parts) <
           std::tie(o.stage, o.microbatch, o.kind, o.parts);
  }
  bool is_backward() const { return info(kind).backward; }
};

// A fused task of `parts`, run in that order. Throws torchmpmd::Error when
// it has fewer than two parts or a part is fused itself; the schedule's
// validation checks the rest (placement, dependencies between the parts).
Task fuse(std::vector<Task> parts);

// torch's computation type of an action with sub-actions.
constexpr const char* kFusedActionType = "OVERLAP_F_B";

// "F(stage=2, mb=5)", fused "F(stage=2, mb=5)+B(stage=3, mb=1)": for
// messages and profiler ranges.
std::string to_string(const Task& task);
// "2F5": torch.distributed.pipelining's action format (stage, kind, mb); a
// fused task as torch writes an action with sub-actions:
// "(2F5;3B1)OVERLAP_F_B".
std::string to_action(const Task& task);
// Parses either form; throws torchmpmd::Error naming the text when
// malformed.
Task parse_action(const std::string& text);
// A fused task's parts by kind and stage, without microbatches ("0F;3B"):
// the key of its measured time in Costs::fused_time.
std::string fused_cost_key(const Task& task);

// The side each of `task`'s parts runs on (in part order): 1 for the
// forward parts of a fused task that also has other parts (F beside B, I,
// W or R), 0 for the rest; a simple task is one part on side 0. The two
// sides of a fused task may run at once (the runtime's overlap; the
// simulator charges them so); the parts of one side run in order, and a
// part may depend on an earlier part of its own side (a recompute right
// before its backward), never on the other side.
std::vector<int32_t> lanes(const Task& task);

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
