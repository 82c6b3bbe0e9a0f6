// Checking a schedule without running it, and the task dependencies that
// both validation and lowering follow (from the task-kind table).
#pragma once

#include <cstdint>
#include <vector>

#include "schedule/pipeline_graph.h"
#include "schedule/task.h"

namespace torchmpmd::schedule {

// Where a task sits in a schedule.
struct Position {
  int32_t rank = -1;
  int32_t index = -1;
  bool present() const { return rank >= 0; }
};

// Where every task of a schedule sits, after the structural checks.
class TaskPositions {
 public:
  TaskPositions(int32_t num_stages, int32_t num_microbatches);
  size_t size() const { return where_.size(); }
  // Dense index over (stage, microbatch, kind).
  size_t index(const Task& t) const;
  const Position& at(const Task& t) const { return where_[index(t)]; }
  Position& at(const Task& t) { return where_[index(t)]; }
  bool has(const Task& t) const { return at(t).present(); }

 private:
  int32_t num_microbatches_ = 0;
  std::vector<Position> where_;
};

// Checks placement, task ranges, duplicates and completeness (each part of a
// fused task counts as a task of its own, at the fused task's position);
// returns where every task sits. Throws torchmpmd::Error naming the tasks, with
// the grid.
TaskPositions locate(const PipelineGraph& graph, const ScheduleSpec& spec);

// Tasks that must finish before `t` can start, following the `needs` of its
// kind; of a fused task, those of all its parts outside it (it starts with
// every input of every part there; a part that depends on an earlier part
// of its side runs after it inside the task). Sorted, without duplicates.
std::vector<Task> dependencies(const Task& t, const Flow& flow,
                               const TaskPositions& positions,
                               bool forward_only);

// Checks a schedule without running it: placement, every task present exactly
// once, tasks on the rank that holds their stage, and dependencies between
// tasks of one rank. A fused task needs two or more parts, none fused, none
// depending on another of its parts. Throws torchmpmd::Error with the offending
// tasks named and a per-rank grid marking the spot.
void validate(const PipelineGraph& graph, const ScheduleSpec& spec);

}  // namespace torchmpmd::schedule
