#include "schedule/task_kinds.h"

#include "util/check.h"

namespace torchmpmd::schedule {

namespace {

TaskKindInfo row(TaskKind kind, char letter, const char* name) {
  TaskKindInfo k;
  k.kind = kind;
  k.letter = letter;
  k.name = name;
  k.charged_as = kind;
  return k;
}

std::vector<TaskKindInfo> make_table() {
  std::vector<TaskKindInfo> table;

  TaskKindInfo f = row(TaskKind::kForward, 'F', "forward");
  f.needs = {{Need::kProducerForwards, TaskKind::kForward}};
  f.required = true;
  f.in_forward_only = true;
  f.reads_activations = true;
  f.emits_activations = true;
  f.memory = {+1, 0, 0};
  // A recomputed forward keeps only its inputs: the simulator charges the
  // activations the stage received, from its forward to the end of its
  // backward (the task that finishes its weight gradients), not a share of
  // the stage's activations.
  f.memory_if_recomputed = {0, 0, +1};
  table.push_back(f);

  TaskKindInfo b = row(TaskKind::kBackward, 'B', "backward");
  b.default_cost = {{TaskKind::kForward, 2.0}};
  b.needs = {{Need::kOwn, TaskKind::kForward},
             {Need::kOwnIfScheduled, TaskKind::kRecompute},
             {Need::kConsumerInputGrads, TaskKind::kBackward}};
  b.backward = true;
  b.backward_parts = kWholeBackward;
  b.reads_grads = true;
  b.emits_input_grads = true;
  b.finishes_weight_grads = true;
  b.memory = {-1, 0, 0};
  b.memory_if_recomputed = {-1, 0, -1};
  table.push_back(b);

  TaskKindInfo i = row(TaskKind::kInputGrad, 'I', "input grad");
  i.default_cost = {{TaskKind::kBackward, 0.5}};
  i.needs = b.needs;
  i.backward = true;
  i.backward_parts = kInputGradPart;
  i.reads_grads = true;
  i.emits_input_grads = true;
  i.memory = i.memory_if_recomputed = {-1, +1, 0};
  table.push_back(i);

  TaskKindInfo w = row(TaskKind::kWeightGrad, 'W', "weight grad");
  w.default_cost = {{TaskKind::kBackward, 0.5}};
  w.needs = {{Need::kOwn, TaskKind::kInputGrad}};
  w.backward = true;
  w.backward_parts = kWeightGradPart;
  w.finishes_weight_grads = true;
  w.memory = {0, -1, 0};
  w.memory_if_recomputed = {0, -1, -1};
  table.push_back(w);

  TaskKindInfo r = row(TaskKind::kRecompute, 'R', "recompute");
  r.charged_as = TaskKind::kForward;
  r.needs = {{Need::kOwn, TaskKind::kForward}};
  r.recomputes = true;
  r.memory = r.memory_if_recomputed = {+1, 0, 0};
  table.push_back(r);

  for (size_t k = 0; k < table.size(); ++k) {
    MPMD_INTERNAL_ASSERT(static_cast<size_t>(table[k].kind) == k,
                         "task kinds must be listed in enum order");
    MPMD_INTERNAL_ASSERT(table[k].backward == (table[k].backward_parts != 0),
                         "a backward kind computes a part of the backward");
    for (const auto& [term, factor] : table[k].default_cost) {
      MPMD_INTERNAL_ASSERT(static_cast<size_t>(term) < k && factor >= 0,
                           "a default cost reads kinds listed before it");
    }
  }
  MPMD_INTERNAL_ASSERT(table.size() == kNumTaskKinds);
  return table;
}

}  // namespace

const std::vector<TaskKindInfo>& task_kinds() {
  static const std::vector<TaskKindInfo> table = make_table();
  return table;
}

const TaskKindInfo& info(TaskKind kind) {
  return task_kinds().at(static_cast<size_t>(kind));
}

char kind_letter(TaskKind kind) { return info(kind).letter; }

bool is_kind_letter(char letter) {
  for (const TaskKindInfo& k : task_kinds()) {
    if (k.letter == letter) return true;
  }
  return false;
}

std::string kind_list() {
  const auto& kinds = task_kinds();
  std::string out;
  for (size_t k = 0; k < kinds.size(); ++k) {
    if (k > 0) out += k + 1 == kinds.size() ? " or " : ", ";
    out += detail::str_cat(kinds[k].letter, " (", kinds[k].name, ")");
  }
  return out;
}

std::string kind_letters() {
  std::string out;
  for (const TaskKindInfo& k : task_kinds()) {
    out += out.empty() ? "" : "|";
    out += k.letter;
  }
  return out;
}

TaskKind kind_from_letter(char letter) {
  for (const TaskKindInfo& k : task_kinds()) {
    if (k.letter == letter) return k.kind;
  }
  MPMD_CHECK(false, "schedule: unknown task kind '", letter, "'; use ",
             kind_list());
  return TaskKind::kForward;
}

}  // namespace torchmpmd::schedule
