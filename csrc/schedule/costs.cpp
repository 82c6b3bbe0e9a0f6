#include "schedule/costs.h"

#include <algorithm>
#include <cctype>

#include "schedule/task.h"
#include "util/check.h"

namespace torchmpmd::schedule {

namespace {

// A key of Costs::fused_time: two or more "<stage><kind>" parts joined by
// ';', each on a stage of the pipeline.
void check_fused_cost_key(const std::string& key, int32_t num_stages) {
  size_t parts = 0;
  size_t start = 0;
  while (start <= key.size()) {
    size_t end = key.find(';', start);
    if (end == std::string::npos) end = key.size();
    const std::string part = key.substr(start, end - start);
    size_t digits = 0;
    while (digits < part.size() &&
           std::isdigit(static_cast<unsigned char>(part[digits]))) {
      ++digits;
    }
    const bool ok = digits > 0 && digits <= 9 && digits + 1 == part.size() &&
                    is_kind_letter(part.back());
    MPMD_CHECK(ok, "schedule: costs.fused_time key '", key,
               "' is not a fused task's parts: write each part as "
               "<stage><kind> (kinds ",
               kind_letters(), "), joined by ';', e.g. '0F;3B'");
    const int64_t stage = std::stoll(part.substr(0, digits));
    MPMD_CHECK(stage < num_stages, "schedule: costs.fused_time key '", key,
               "' names stage ", stage, ", but the pipeline has stages 0..",
               num_stages - 1);
    ++parts;
    start = end + 1;
  }
  MPMD_CHECK(parts >= 2, "schedule: costs.fused_time key '", key,
             "' has one part; a fused task has two or more, e.g. '0F;3B'");
}

}  // namespace

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

bool Costs::shares_cores(int32_t num_ranks) const {
  return shared_cores > 0 && num_ranks * demand_per_rank > shared_cores;
}

double Costs::sharing(double computing, int32_t num_ranks) const {
  if (!shares_cores(num_ranks)) return 1.0;
  const auto slowdown = [&](double ranks) {
    return std::max(1.0, ranks * demand_per_rank / shared_cores);
  };
  return slowdown(computing) / slowdown(num_ranks);
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
  MPMD_CHECK(shared_cores >= 0,
             "schedule: costs.shared_cores must be >= 0 (0: ",
             "a device per rank), got ", shared_cores);
  MPMD_CHECK(demand_per_rank > 0,
             "schedule: costs.demand_per_rank must be > 0 (cores one rank's "
             "compute takes), got ",
             demand_per_rank);
  for (const auto& [key, value] : fused_time) {
    MPMD_CHECK(value >= 0, "schedule: the fused time of '", key,
               "' must not be negative, got ", value);
    check_fused_cost_key(key, num_stages);
  }
  MPMD_CHECK(latency >= 0 && bytes_per_unit >= 0,
             "schedule: latency and bandwidth must not be negative");
}

bool Costs::has_fused_time(const Task& task) const {
  return task.fused() && !fused_time.empty() &&
         fused_time.count(fused_cost_key(task)) > 0;
}

bool Costs::overlaps(const Task& task) const {
  if (!overlap_sides || comm.empty() || !task.fused() || has_fused_time(task)) {
    return false;
  }
  const std::vector<int32_t> side = lanes(task);
  return std::count(side.begin(), side.end(), 1) > 0;
}

double Costs::comm_of(const Task& task) const {
  const auto kind = static_cast<size_t>(info(task.kind).charged_as);
  if (kind >= comm.size() || comm[kind].empty()) return 0.0;
  return comm[kind].at(task.stage);
}

double Costs::of(const Task& task) const {
  if (task.fused()) {
    if (has_fused_time(task)) return fused_time.at(fused_cost_key(task));
    if (overlaps(task)) {
      // Each side's parts one after the other; the two sides at once, each
      // one's communication under the other's compute where it can be.
      const std::vector<int32_t> side = lanes(task);
      double compute = 0;
      double sides[2] = {0, 0};
      for (size_t k = 0; k < task.parts.size(); ++k) {
        const double t = of(task.parts[k]);
        compute += t - std::min(t, comm_of(task.parts[k]));
        sides[side[k]] += t;
      }
      return std::max({compute, sides[0], sides[1]});
    }
    double sum = 0;
    for (const Task& part : task.parts) sum += of(part);
    return sum;
  }
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
