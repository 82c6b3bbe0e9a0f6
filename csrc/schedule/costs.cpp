#include "schedule/costs.h"

#include "schedule/task.h"
#include "util/check.h"

namespace torchmpmd::schedule {

Costs Costs::uniform(int32_t num_stages, double forward, double backward,
                     double input_grad, double weight_grad) {
  Costs c;
  c.forward.assign(num_stages, forward);
  c.backward.assign(num_stages, backward);
  c.input_grad.assign(num_stages, input_grad);
  c.weight_grad.assign(num_stages, weight_grad);
  c.activation_bytes.assign(num_stages, 1);
  c.weight_grad_bytes.assign(num_stages, 0);
  return c;
}

void Costs::check(int32_t num_stages) const {
  const auto ok = [&](size_t n) {
    return static_cast<int32_t>(n) == num_stages;
  };
  MPMD_CHECK(ok(forward.size()) && ok(backward.size()) &&
                 ok(input_grad.size()) && ok(weight_grad.size()) &&
                 ok(activation_bytes.size()) && ok(weight_grad_bytes.size()),
             "schedule: costs must give one value per stage (", num_stages,
             " stages) for forward, backward, input_grad, weight_grad, "
             "activation_bytes and weight_grad_bytes");
  for (int32_t s = 0; s < num_stages; ++s) {
    MPMD_CHECK(forward[s] >= 0 && backward[s] >= 0 && input_grad[s] >= 0 &&
                   weight_grad[s] >= 0,
               "schedule: costs of stage ", s, " must not be negative");
  }
  MPMD_CHECK(latency >= 0 && bytes_per_unit >= 0,
             "schedule: latency and bandwidth must not be negative");
}

double Costs::of(const Task& task) const {
  return (this->*info(task.kind).cost).at(task.stage);
}

double Costs::wire_time(int64_t bytes) const {
  return bytes_per_unit > 0 ? bytes / bytes_per_unit : 0.0;
}

}  // namespace torchmpmd::schedule
