#include "schedule/costs.h"

#include "schedule/task.h"
#include "util/check.h"

namespace torchmpmd::schedule {

Costs Costs::uniform(int32_t num_stages, double forward, double backward,
                     double input_grad, double weight_grad) {
  Costs c;
  const auto& kinds = task_kinds();
  c.time.resize(kinds.size());
  const std::pair<TaskKind, double> given[] = {
      {TaskKind::kForward, forward},
      {TaskKind::kBackward, backward},
      {TaskKind::kInputGrad, input_grad},
      {TaskKind::kWeightGrad, weight_grad}};
  for (const auto& [kind, value] : given) {
    c.time[static_cast<size_t>(kind)].assign(num_stages, value);
  }
  // Other kinds of their own: their defaults, in table order (a default
  // reads kinds listed before it).
  for (const TaskKindInfo& k : kinds) {
    auto& row = c.time[static_cast<size_t>(k.kind)];
    if (!row.empty() || k.charged_as != k.kind) continue;
    for (int32_t s = 0; s < num_stages; ++s) {
      double t = 0;
      for (const auto& [term, factor] : k.default_cost) {
        t += factor * c.time[static_cast<size_t>(term)].at(s);
      }
      row.push_back(t);
    }
  }
  c.activation_bytes.assign(num_stages, 1);
  c.weight_grad_bytes.assign(num_stages, 0);
  return c;
}

void Costs::check(int32_t num_stages) const {
  const auto ok = [&](size_t n) {
    return static_cast<int32_t>(n) == num_stages;
  };
  const auto& kinds = task_kinds();
  MPMD_CHECK(time.size() == kinds.size(),
             "schedule: costs must give a time "
             "row per task kind (",
             kind_list(), "), got ", time.size());
  for (const TaskKindInfo& k : kinds) {
    if (k.charged_as != k.kind) continue;
    const auto& row = time[static_cast<size_t>(k.kind)];
    MPMD_CHECK(ok(row.size()), "schedule: costs must give one ", k.name,
               " time per stage (", num_stages, " stages), got ", row.size());
    for (int32_t s = 0; s < num_stages; ++s) {
      MPMD_CHECK(row[s] >= 0, "schedule: costs of stage ", s,
                 " must not be negative (", k.name, ": ", row[s], ")");
    }
  }
  MPMD_CHECK(ok(activation_bytes.size()) && ok(weight_grad_bytes.size()),
             "schedule: costs must give one value per stage (", num_stages,
             " stages) for activation_bytes and weight_grad_bytes");
  const auto per_stage_or_none = [&](size_t n, const char* name) {
    MPMD_CHECK(n == 0 || ok(n), "schedule: costs.", name,
               " must give one value per stage (", num_stages,
               " stages) or none, got ", n);
  };
  per_stage_or_none(unshard.size(), "unshard");
  per_stage_or_none(reduce_grads.size(), "reduce_grads");
  per_stage_or_none(unsharded_bytes.size(), "unsharded_bytes");
  for (size_t s = 0; s < unshard.size(); ++s) {
    MPMD_CHECK(unshard[s] >= 0, "schedule: unshard cost of stage ", s,
               " must not be negative");
  }
  for (size_t s = 0; s < reduce_grads.size(); ++s) {
    MPMD_CHECK(reduce_grads[s] >= 0, "schedule: reduce_grads cost of stage ", s,
               " must not be negative");
  }
  for (size_t s = 0; s < unsharded_bytes.size(); ++s) {
    MPMD_CHECK(unsharded_bytes[s] >= 0, "schedule: unsharded_bytes of stage ",
               s, " must not be negative");
  }
  MPMD_CHECK(latency >= 0 && bytes_per_unit >= 0,
             "schedule: latency and bandwidth must not be negative");
}

double Costs::of(const Task& task) const {
  const TaskKind charged = info(task.kind).charged_as;
  return time.at(static_cast<size_t>(charged)).at(task.stage);
}

double Costs::unshard_time(int32_t stage) const {
  return unshard.empty() ? 0.0 : unshard.at(stage);
}

double Costs::reduce_grads_time(int32_t stage) const {
  return reduce_grads.empty() ? 0.0 : reduce_grads.at(stage);
}

int64_t Costs::unsharded_bytes_of(int32_t stage) const {
  return unsharded_bytes.empty() ? 0 : unsharded_bytes.at(stage);
}

double Costs::wire_time(int64_t bytes) const {
  return bytes_per_unit > 0 ? bytes / bytes_per_unit : 0.0;
}

}  // namespace torchmpmd::schedule
