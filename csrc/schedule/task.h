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

struct ScheduleSpec {
  int32_t num_ranks = 0;
  int32_t num_microbatches = 0;
  std::vector<int32_t> placement;        // stage -> rank
  std::vector<std::vector<Task>> tasks;  // per rank, in execution order
  bool forward_only = false;             // F tasks only (evaluation)
};

}  // namespace torchmpmd::schedule
