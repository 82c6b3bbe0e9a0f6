#include "runtime/executor_internal.h"

namespace torchmpmd::runtime {

using namespace internal;

Executor::TaskFn Executor::task_fn(TaskKind kind) {
  // Split stages run B as I then W; backward() tells the kinds apart.
  static const std::pair<TaskKind, TaskFn> fns[] = {
      {TaskKind::kForward, &Executor::forward},
      {TaskKind::kBackward, &Executor::backward},
      {TaskKind::kInputGrad, &Executor::backward},
      {TaskKind::kWeightGrad, &Executor::backward},
      {TaskKind::kRecompute, &Executor::recompute},
  };
  for (const auto& [k, fn] : fns) {
    if (k == kind) return fn;
  }
  TORCH_CHECK(false, "torchmpmd: the executor cannot run ",
              schedule::info(kind).name, " tasks (",
              schedule::kind_letter(kind), ")");
}

at::Tensor Executor::generator_state() const {
  at::Generator gen = at::globalContext().defaultGenerator(options_.device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

at::Tensor Executor::take_activation(int32_t v, int32_t mb, State& st) {
  const auto it = st.acts.find({v, mb});
  TORCH_INTERNAL_ASSERT(it != st.acts.end(), "rank ", rank_,
                        ": activation of value ", v, " microbatch ", mb,
                        " is not available");
  at::Tensor t = it->second.tensor;
  if (--it->second.uses <= 0) st.acts.erase(it);
  return t;
}

at::Tensor Executor::sum_grad_parts(int32_t v, int32_t mb, State& st) {
  const auto it = st.grad_parts.find({v, mb});
  const auto expected =
      grad_parts_expected_.count(v) ? grad_parts_expected_.at(v) : 0;
  const size_t have = it == st.grad_parts.end() ? 0 : it->second.size();
  TORCH_INTERNAL_ASSERT(static_cast<int32_t>(have) == expected, "rank ", rank_,
                        ": value ", v, " microbatch ", mb, " has ", have,
                        " of ", expected, " gradient parts");
  // Ascending contributor order: the same sum on every run.
  at::Tensor total;
  for (auto& [key, part] : it->second) {
    total = total.defined() ? total.add(part) : part;
  }
  st.grad_parts.erase(it);
  return total;
}

void Executor::forward(const Task& task, State& st) {
  const StageInfo& si = stage(task.stage);
  const int32_t mb = task.microbatch;
  const State::Key key{task.stage, mb};
  std::vector<at::Tensor> inputs;
  inputs.reserve(si.inputs.size());
  for (const int32_t v : si.inputs) {
    inputs.push_back(take_activation(v, mb, st));
  }
  const bool recomputed = options_.training && recomputed_.count(key);
  if (recomputed) {
    // R replays this forward: same inputs, same random numbers (dropout).
    auto& kept = st.kept[key];
    for (const at::Tensor& t : inputs) kept.push_back(t.detach());
    if (st.fns->replay_rng) {
      at::Generator gen = at::globalContext().defaultGenerator(options_.device);
      std::lock_guard<std::mutex> lock(gen.mutex());
      st.rng[key] = gen.get_state();
    }
  }
  // Whether the stage draws random numbers, learnt from its first forward
  // run alone: a fused task's sides run at once only if at most one of
  // them draws (Executor::overlaps).
  const bool learn = options_.training && st.fns->overlap &&
                     st.fns->replay_rng && !st.concurrent &&
                     options_.device.is_cpu() && !draws_.count(task.stage);
  const at::Tensor rng_before = learn ? generator_state() : at::Tensor();
  std::vector<at::Tensor> outs =
      call_forward(task, std::move(inputs), /*keep=*/!recomputed, st);
  if (learn) draws_[task.stage] = !at::equal(rng_before, generator_state());
  for (size_t i = 0; i < si.outputs.size(); ++i) {
    const ValueInfo& v = value(si.outputs[i]);
    const at::Tensor& out = outs[i];
    const std::vector<int64_t>& shape = shape_of(v.id, mb, st);
    if (out.sizes().vec() != shape || out.scalar_type() != v.dtype) {
      throw ExecutorError(c10::str(
          "torchmpmd: rank ", rank_, ": ", schedule::to_string(task),
          " produced '", v.name, "' with shape ",
          shape_str(out.sizes(), out.scalar_type()),
          " but the stage plan expects ", shape_str(shape, v.dtype),
          "; it was not sent. Every microbatch must have the shape of the "
          "traced example (trace again for another shape)"));
    }
    const auto uses = activation_uses_.find(v.id);
    if (uses != activation_uses_.end() && uses->second > 0) {
      st.acts[{v.id, mb}] = {out, uses->second};
    }
  }
}

void Executor::recompute(const Task& task, State& st) {
  const State::Key key{task.stage, task.microbatch};
  std::vector<at::Tensor> inputs = std::move(st.kept.at(key));
  st.kept.erase(key);
  if (!st.fns->replay_rng) {
    call_forward(task, std::move(inputs), /*keep=*/true, st);
    return;
  }
  at::Tensor state = std::move(st.rng.at(key));
  st.rng.erase(key);
  const auto draws = draws_.find(task.stage);
  if (draws != draws_.end() && !draws->second) {
    // Nothing to replay: the generator is left alone (the other side of a
    // fused task may be drawing from it).
    call_forward(task, std::move(inputs), /*keep=*/true, st);
    return;
  }
  at::Generator gen = at::globalContext().defaultGenerator(options_.device);
  at::Tensor current;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    current = gen.get_state();
    gen.set_state(state);
  }
  // The forward takes the generator's lock itself: not held across the call.
  struct Restore {
    at::Generator& gen;
    const at::Tensor& state;
    ~Restore() {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  } restore{gen, current};
  call_forward(task, std::move(inputs), /*keep=*/true, st);
}

std::vector<at::Tensor> Executor::call_forward(const Task& task,
                                               std::vector<at::Tensor> inputs,
                                               bool keep, State& st) {
  const StageInfo& si = stage(task.stage);
  const int32_t mb = task.microbatch;
  // Autograd stages take their inputs as leaves of a graph of their own;
  // split stages compute their backward from what forward saves.
  const bool autograd = keep && options_.training && !si.split;
  if (autograd) {
    for (size_t j = 0; j < inputs.size(); ++j) {
      inputs[j] = inputs[j].detach();
      if (value(si.inputs[j]).requires_grad) inputs[j].requires_grad_(true);
    }
  }
  std::vector<at::Tensor> outs;
  {
    at::AutoGradMode grad_mode(autograd);
    const Unlocked calling(st);
    outs = st.fns->forward(task.stage, mb, inputs);
  }
  const size_t want = si.outputs.size() + (options_.training && si.has_loss);
  if (options_.training && si.split && outs.size() >= want) {
    if (keep)
      st.saved[{task.stage, mb}].assign(outs.begin() + want, outs.end());
    outs.resize(want);
  }
  if (outs.size() != want) {
    throw ExecutorError(c10::str("torchmpmd: rank ", rank_, ": ",
                                 schedule::to_string(task), " returned ",
                                 outs.size(), " tensors, expected ", want));
  }
  if (autograd) {
    check_gradient_path(task, outs);
    st.leaves[{task.stage, mb}] = std::move(inputs);
    st.outputs[{task.stage, mb}] = outs;
  }
  return outs;
}

void Executor::check_gradient_path(const Task& task,
                                   const std::vector<at::Tensor>& outs) const {
  const StageInfo& si = stage(task.stage);
  for (size_t i = 0; i <= si.outputs.size() && i < outs.size(); ++i) {
    const bool is_loss = i == si.outputs.size();
    if (is_loss ? !si.has_loss : !value(si.outputs[i]).requires_grad) continue;
    if (outs[i].requires_grad()) continue;
    const std::string what =
        is_loss ? std::string("its loss")
                : c10::str("'", value(si.outputs[i]).name, "'");
    throw ExecutorError(c10::str(
        "torchmpmd: rank ", rank_, ": ", schedule::to_string(task),
        " produced ", what,
        " without a gradient path, but the stage plan says gradients flow "
        "back through it: the parameters and inputs before it would "
        "silently get none. The stage ran without autograd (torch.no_grad, "
        ".detach() or a non-differentiable call) where the traced model "
        "had it; make that part of stage ",
        task.stage, " differentiable, or detach it in the model itself"));
  }
}

void Executor::backward(const Task& task, State& st) {
  const StageInfo& si = stage(task.stage);
  const uint8_t parts = schedule::info(task.kind).backward_parts;
  if (si.split) {
    if (parts & schedule::kInputGradPart) input_grad(task, st);
    if (parts & schedule::kWeightGradPart) weight_grad(task, st);
    return;
  }
  if (parts != schedule::kWholeBackward) {
    throw ExecutorError(c10::str(
        "torchmpmd: rank ", rank_, ": ", schedule::to_string(task),
        " needs stage ", task.stage,
        " split into input- and weight-gradient graphs (the runner splits "
        "stages whose schedule has I/W tasks)"));
  }
  const int32_t mb = task.microbatch;
  const State::Key key{task.stage, mb};
  auto outs = std::move(st.outputs.at(key));
  auto leaves = std::move(st.leaves.at(key));
  st.outputs.erase(key);
  st.leaves.erase(key);
  std::vector<at::Tensor> roots;
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < si.outputs.size(); ++i) {
    const ValueInfo& v = value(si.outputs[i]);
    if (!v.requires_grad) continue;
    at::Tensor g = sum_grad_parts(v.id, mb, st);
    if (outs[i].requires_grad()) {
      roots.push_back(outs[i]);
      grads.push_back(g);
    }
  }
  if (si.has_loss) {
    roots.push_back(outs.back());
    grads.push_back(at::ones_like(outs.back()));
  }
  if (!roots.empty()) {
    const Unlocked calling(st);
    torch::autograd::backward(roots, grads);
  }
  for (size_t j = 0; j < si.inputs.size(); ++j) {
    const ValueInfo& v = value(si.inputs[j]);
    if (!v.requires_grad) continue;
    at::Tensor g = leaves[j].grad();
    st.grad_parts[{v.id, mb}][task.stage] =
        g.defined() ? g : at::zeros_like(leaves[j]);
  }
}

void Executor::input_grad(const Task& task, State& st) {
  const StageInfo& si = stage(task.stage);
  const int32_t mb = task.microbatch;
  const State::Key key{task.stage, mb};
  auto saved = std::move(st.saved.at(key));
  st.saved.erase(key);
  std::vector<at::Tensor> grads(si.outputs.size());
  for (size_t i = 0; i < si.outputs.size(); ++i) {
    const ValueInfo& v = value(si.outputs[i]);
    if (v.requires_grad) grads[i] = sum_grad_parts(v.id, mb, st);
  }
  std::vector<at::Tensor> result;
  {
    const Unlocked calling(st);
    result = st.fns->input_grad(task.stage, mb, saved, grads);
  }
  size_t k = 0;
  for (const int32_t v : si.inputs) k += value(v).requires_grad;
  if (result.size() < k) {
    throw ExecutorError(c10::str("torchmpmd: rank ", rank_, ": ",
                                 schedule::to_string(task), " returned ",
                                 result.size(), " tensors, expected at least ",
                                 k, " input gradients"));
  }
  size_t next = 0;
  for (const int32_t v : si.inputs) {
    if (!value(v).requires_grad) continue;
    // An input gradient is on its way out, not kept for W.
    if (st.memory && result[next].defined()) {
      st.memory->disown(result[next].storage().data_ptr().get());
    }
    st.grad_parts[{v, mb}][task.stage] = std::move(result[next++]);
  }
  st.saved_w[key].assign(std::make_move_iterator(result.begin() + k),
                         std::make_move_iterator(result.end()));
}

void Executor::weight_grad(const Task& task, State& st) {
  const State::Key key{task.stage, task.microbatch};
  auto saved = std::move(st.saved_w.at(key));
  st.saved_w.erase(key);
  const Unlocked calling(st);
  st.fns->weight_grad(task.stage, task.microbatch, saved);
}

}  // namespace torchmpmd::runtime
