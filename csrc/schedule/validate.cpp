#include "schedule/validate.h"

#include <algorithm>

#include "schedule/grid.h"
#include "util/check.h"

namespace torchmpmd::schedule {

namespace {

// The task of (stage, mb) that emits its input gradients: the first kind of
// the table that does and that the schedule has (B, else I).
Task input_grad_producer(const TaskPositions& pos, int32_t stage, int32_t mb) {
  Task last{TaskKind::kForward, stage, mb};
  for (const TaskKindInfo& k : task_kinds()) {
    if (!k.emits_input_grads) continue;
    last.kind = k.kind;
    if (pos.has(last)) return last;
  }
  return last;
}

std::string kind_list_of(bool whole);

// Each part of (stage, mb)'s backward (input and weight gradients) is
// computed by exactly one of its tasks: the table's `backward_parts`.
void check_backward_parts(const ScheduleSpec& spec, const TaskPositions& pos,
                          int32_t s, int32_t m) {
  const int32_t r = spec.placement[s];
  uint8_t covered = kNoBackwardPart;
  std::vector<Task> present;
  std::string whole, split;  // "B(...)", "I(...) and W(...)": for messages
  for (const TaskKindInfo& k : task_kinds()) {
    if (k.backward_parts == kNoBackwardPart) continue;
    const Task t{k.kind, s, m};
    const bool full = k.backward_parts == kWholeBackward;
    std::string& names = full ? whole : split;
    names += detail::str_cat(names.empty() ? ""
                             : full        ? " or "
                                           : " and ",
                             to_string(t));
    if (!pos.has(t)) continue;
    if (covered & k.backward_parts) {
      const Task& other = present.front();
      const bool other_full = info(other.kind).backward_parts == kWholeBackward;
      const Task& shown = other_full ? other : t;
      MPMD_CHECK(false, "schedule: stage ", s, " microbatch ", m,
                 " has both a full backward ", to_string(shown),
                 " and a split one (", kind_list_of(false),
                 "); use one or the other",
                 grid_for(spec, {{pos.at(shown).rank, pos.at(shown).index}}));
    }
    covered |= k.backward_parts;
    present.push_back(t);
  }
  if (covered == kWholeBackward) return;
  std::string has = "no backward";
  if (!present.empty()) {
    std::string got, missing;
    for (const TaskKindInfo& k : task_kinds()) {
      if (k.backward_parts == kNoBackwardPart ||
          k.backward_parts == kWholeBackward) {
        continue;
      }
      std::string& into = pos.has(Task{k.kind, s, m}) ? got : missing;
      into += detail::str_cat(into.empty() ? "" : " and ", k.letter);
    }
    has = detail::str_cat(got, " but no ", missing);
  }
  MPMD_CHECK(false, "schedule: stage ", s, " microbatch ", m, " has ", has,
             ": rank ", r, " must run ", whole, " or both ", split,
             grid_for(spec, {}));
}

// The letters of the kinds that compute part of the backward ("I/W"), or
// all of it.
std::string kind_list_of(bool whole) {
  std::string out;
  for (const TaskKindInfo& k : task_kinds()) {
    if (k.backward_parts == kNoBackwardPart) continue;
    if ((k.backward_parts == kWholeBackward) != whole) continue;
    out += detail::str_cat(out.empty() ? "" : "/", k.letter);
  }
  return out;
}

// A fused task's shape: two or more parts, none fused itself.
void check_fused(const ScheduleSpec& spec, int32_t r, int32_t i) {
  const Task& t = spec.tasks[r][i];
  if (!t.fused()) return;
  MPMD_CHECK(t.parts.size() >= 2, "schedule: rank ", r, " position ", i,
             ": fused task ", to_string(t), " has ", t.parts.size(),
             " part; a fused task needs two or more, schedule a single task "
             "as itself",
             grid_for(spec, {{r, i}}));
  for (size_t k = 0; k < t.parts.size(); ++k) {
    MPMD_CHECK(!t.parts[k].fused(), "schedule: rank ", r, " position ", i,
               ": part ", k + 1, " of fused task ", to_action(t),
               " is fused itself; fused tasks do not nest, list its parts in "
               "the outer one",
               grid_for(spec, {{r, i}}));
  }
}

// Where one simple task (or part of a fused one) of rank r, position i sits.
void locate_part(const ScheduleSpec& spec, int32_t S, int32_t M, int32_t r,
                 int32_t i, const Task& t, TaskPositions& pos) {
  const Task& whole = spec.tasks[r][i];
  // "task F(stage=0, mb=3)" or "part B(stage=1, mb=2) of fused task
  // (0F3;1B2)OVERLAP_F_B"; built only for a message.
  const auto what = [&] {
    return whole.fused() ? detail::str_cat("part ", to_string(t),
                                           " of fused task ", to_action(whole))
                         : detail::str_cat("task ", to_string(t));
  };
  MPMD_CHECK(t.stage >= 0 && t.stage < S, "schedule: rank ", r, " position ", i,
             ": ", what(), " names a stage outside 0..", S - 1,
             grid_for(spec, {{r, i}}));
  MPMD_CHECK(t.microbatch >= 0 && t.microbatch < M, "schedule: rank ", r,
             " position ", i, ": ", what(), " names a microbatch outside 0..",
             M - 1, grid_for(spec, {{r, i}}));
  MPMD_CHECK(!spec.forward_only || info(t.kind).in_forward_only,
             "schedule: rank ", r, " position ", i, ": ", what(),
             " in a forward-only program", grid_for(spec, {{r, i}}));
  MPMD_CHECK(spec.placement[t.stage] == r, "schedule: ",
             whole.fused() ? detail::str_cat("rank ", r, " position ", i, ": ")
                           : std::string(),
             what(), " is on rank ", r, ", but stage ", t.stage,
             " is placed on rank ", spec.placement[t.stage],
             whole.fused() ? ": all parts of a fused task run on one rank, "
                             "the one holding their stages"
                           : ": all tasks of a stage run on the rank that "
                             "holds it",
             grid_for(spec, {{r, i}}));
  Position& slot = pos.at(t);
  MPMD_CHECK(!slot.present(), "schedule: task ", to_string(t),
             " appears twice (rank ", slot.rank, " position ", slot.index,
             " and rank ", r, " position ", i, ")",
             grid_for(spec, {{slot.rank, slot.index}, {r, i}}));
  slot = {r, i};
}

}  // namespace

TaskPositions::TaskPositions(int32_t num_stages, int32_t num_microbatches)
    : num_microbatches_(num_microbatches),
      where_(static_cast<size_t>(num_stages) * num_microbatches *
             kNumTaskKinds) {}

size_t TaskPositions::index(const Task& t) const {
  return (static_cast<size_t>(t.stage) * num_microbatches_ + t.microbatch) *
             kNumTaskKinds +
         static_cast<size_t>(t.kind);
}

namespace {

void add_dependencies(const Task& t, const Flow& flow, const TaskPositions& pos,
                      bool forward_only, std::vector<Task>& deps) {
  const int32_t mb = t.microbatch;
  for (const Dependency& d : info(t.kind).needs) {
    switch (d.need) {
      case Need::kOwn:
        deps.push_back({d.kind, t.stage, mb});
        break;
      case Need::kOwnIfScheduled:
        if (pos.has({d.kind, t.stage, mb}))
          deps.push_back({d.kind, t.stage, mb});
        break;
      case Need::kProducerForwards:
        for (const int32_t v : flow.reads[t.stage]) {
          deps.push_back({d.kind, flow.producer.at(v), mb});
        }
        break;
      case Need::kConsumerInputGrads:
        if (forward_only) break;
        for (const int32_t v : flow.produces[t.stage]) {
          if (!flow.requires_grad.at(v)) continue;
          for (const int32_t c : flow.consumers.at(v)) {
            deps.push_back(input_grad_producer(pos, c, mb));
          }
        }
        break;
    }
  }
}

}  // namespace

std::vector<Task> dependencies(const Task& t, const Flow& flow,
                               const TaskPositions& pos, bool forward_only) {
  std::vector<Task> deps;
  const Task::Parts parts = t.simple_parts();
  for (const Task& part : parts) {
    add_dependencies(part, flow, pos, forward_only, deps);
  }
  // A part's dependency on an earlier part of its own side runs inside the
  // task (validate() checks that it is one).
  deps.erase(std::remove_if(deps.begin(), deps.end(),
                            [&](const Task& d) {
                              return t.fused() &&
                                     std::find(parts.begin(), parts.end(), d) !=
                                         parts.end();
                            }),
             deps.end());
  std::sort(deps.begin(), deps.end());
  deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
  return deps;
}

TaskPositions locate(const PipelineGraph& graph, const ScheduleSpec& spec) {
  const int32_t S = graph.num_stages;
  const int32_t M = spec.num_microbatches;
  const int32_t R = spec.num_ranks;
  MPMD_CHECK(R > 0, "schedule: num_ranks must be positive, got ", R);
  MPMD_CHECK(M > 0, "schedule: num_microbatches must be positive, got ", M);
  MPMD_CHECK(static_cast<int32_t>(spec.placement.size()) == S,
             "schedule: the placement has ", spec.placement.size(),
             " entries but the pipeline has ", S,
             " stages; give one rank per stage");
  MPMD_CHECK(spec.collectives.empty() ||
                 static_cast<int32_t>(spec.collectives.size()) == S,
             "schedule: the data-parallel collectives give ",
             spec.collectives.size(), " entries but the pipeline has ", S,
             " stages; give one per stage, or none");
  MPMD_CHECK(static_cast<int32_t>(spec.tasks.size()) == R,
             "schedule: got task lists for ", spec.tasks.size(),
             " ranks but num_ranks is ", R);
  std::vector<int32_t> stages_on(R, 0);
  for (int32_t s = 0; s < S; ++s) {
    const int32_t r = spec.placement[s];
    MPMD_CHECK(r >= 0 && r < R, "schedule: the placement puts stage ", s,
               " on rank ", r, ", but there are only ", R, " ranks");
    ++stages_on[r];
  }
  for (int32_t r = 0; r < R; ++r) {
    MPMD_CHECK(stages_on[r] > 0, "schedule: rank ", r,
               " holds no stage; use at most as many ranks as stages (", S,
               ")");
  }

  TaskPositions pos(S, M);
  for (int32_t r = 0; r < R; ++r) {
    const auto& list = spec.tasks[r];
    for (int32_t i = 0; i < static_cast<int32_t>(list.size()); ++i) {
      check_fused(spec, r, i);
      for (const Task& t : list[i].simple_parts()) {
        locate_part(spec, S, M, r, i, t, pos);
      }
    }
  }

  for (int32_t s = 0; s < S; ++s) {
    for (int32_t m = 0; m < M; ++m) {
      const int32_t r = spec.placement[s];
      for (const TaskKindInfo& k : task_kinds()) {
        const Task t{k.kind, s, m};
        MPMD_CHECK(!k.required || pos.has(t), "schedule: task ", to_string(t),
                   " is missing: rank ", r, " must run it", grid_for(spec, {}));
      }
      if (!spec.forward_only) check_backward_parts(spec, pos, s, m);
    }
  }
  return pos;
}

void validate(const PipelineGraph& graph, const ScheduleSpec& spec) {
  const TaskPositions pos = locate(graph, spec);
  const Flow flow(graph);
  for (int32_t r = 0; r < spec.num_ranks; ++r) {
    const auto& list = spec.tasks[r];
    for (int32_t i = 0; i < static_cast<int32_t>(list.size()); ++i) {
      const Task& whole = list[i];
      // Each part's dependencies: on earlier tasks of the rank or on other
      // ranks, or on an earlier part of its own side of the same fused task
      // (a recompute right before its backward); never on the other side
      // (the two may run at once) nor on a later part.
      const Task::Parts parts = whole.simple_parts();
      const std::vector<int32_t> side = lanes(whole);
      for (size_t k = 0; k < parts.size(); ++k) {
        const Task& part = parts.begin()[k];
        const auto what = [&] {
          return whole.fused()
                     ? detail::str_cat(to_string(part), " (part of fused ",
                                       to_action(whole), ")")
                     : to_string(part);
        };
        for (const Task& dep :
             dependencies(part, flow, pos, spec.forward_only)) {
          const Position& p = pos.at(dep);
          MPMD_CHECK(p.present(), "schedule: ", what(), " depends on ",
                     to_string(dep), ", which no rank runs",
                     grid_for(spec, {{r, i}}));
          if (p.rank == r && p.index == i) {
            const auto at = std::find(parts.begin(), parts.end(), dep);
            const size_t j = static_cast<size_t>(at - parts.begin());
            if (j < k && side[j] == side[k]) continue;
          }
          MPMD_CHECK(
              p.rank != r || p.index != i, "schedule: rank ", r, " position ",
              i, ": fused task ", to_action(whole), " has part ",
              to_string(part), " depending on its part ", to_string(dep),
              "; a part may depend only on an earlier part of its own side "
              "(the forward parts are one side, the rest the other: the "
              "two may run at once): schedule ",
              to_action(dep), " as a task before it", grid_for(spec, {{r, i}}));
          MPMD_CHECK(p.rank != r || p.index < i, "schedule: rank ", r, " runs ",
                     what(), " (position ", i, ") before ", to_string(dep),
                     " (position ", p.index, "), which it depends on",
                     grid_for(spec, {{r, i}, {r, p.index}}));
        }
      }
    }
  }
}

}  // namespace torchmpmd::schedule
