#include "runtime/executor.h"

#include <ATen/Context.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include "runtime/memory.h"

#include <algorithm>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

namespace torchmpmd::runtime {

namespace {

using Clock = std::chrono::steady_clock;
using schedule::Instruction;
using schedule::Op;
using schedule::Payload;
using schedule::Task;
using schedule::TaskKind;

std::string shape_str(at::IntArrayRef shape, at::ScalarType dtype) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "") << shape[i];
  }
  out << (shape.size() == 1 ? ",)" : ")") << " " << c10::toString(dtype);
  return out.str();
}

std::string seconds(std::chrono::milliseconds ms) {
  std::ostringstream out;
  out << ms.count() / 1000.0 << " s";
  return out.str();
}

// An error that already carries its context: rethrown untouched by run().
class ExecutorError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::string message_of(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) {
    return c10->what_without_backtrace();
  }
  return e.what();
}

// Task times on a device (CUDA): events recorded on the current stream
// around each task, read once at the end of the step. On a device the host
// only queues work (receives are stream waits), so host clocks would time
// the queueing, not the work.
class DeviceTimer {
 public:
  explicit DeviceTimer(at::Device device)
      : device_(device), impl_(device.type()) {
    start_ = mark();
  }

  size_t mark() {
    marks_.emplace_back(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    marks_.back().record(impl_.getStream(device_));
    return marks_.size() - 1;
  }

  // Waits (on the host, polling) until the device reached the last mark,
  // at most until `deadline`; false if it did not. `stop` is called while
  // waiting and may throw (an abort). Polls at least every 50 us: the step
  // ends when the device does, and a longer nap would add to every step.
  template <typename Stop>
  bool reached_end(Clock::time_point deadline, Stop stop) const {
    return poll_until(
        [&] {
          if (marks_.back().query()) return true;
          stop();
          return false;
        },
        deadline, std::chrono::microseconds(50));
  }

  // Nanoseconds from the step's start to mark `i` (the device reached it).
  int64_t ns(size_t i) const {
    return static_cast<int64_t>(marks_[start_].elapsedTime(marks_[i]) * 1e6);
  }

 private:
  at::Device device_;
  c10::impl::VirtualGuardImpl impl_;
  std::deque<c10::Event> marks_;  // c10::Event is not copyable
  size_t start_ = 0;
};

// The first compute (or reduce) after receive `recv` of `code` that reads
// it; code.size() if none does.
size_t first_reader(const std::vector<Instruction>& code, size_t recv) {
  for (size_t j = recv + 1; j < code.size(); ++j) {
    if (schedule::reads(code[j], code[recv])) return j;
  }
  return code.size();
}

}  // namespace

struct Executor::State {
  using Key = std::pair<int32_t, int32_t>;  // (value or stage, microbatch)
  struct Activation {
    at::Tensor tensor;
    int32_t uses = 0;
  };
  struct Posted {
    std::unique_ptr<Request> request;
    at::Tensor buffer;
    bool early = false;
  };
  struct Sending {
    std::unique_ptr<Request> request;
    size_t index;
  };
  std::map<Key, Activation> acts;
  std::map<Key, std::vector<at::Tensor>> outputs;
  std::map<Key, std::vector<at::Tensor>> leaves;
  std::map<Key, std::vector<at::Tensor>> saved;    // split: F -> I
  std::map<Key, std::vector<at::Tensor>> saved_w;  // split: I -> W
  std::map<Key, std::vector<at::Tensor>> kept;     // recomputed: F -> R
  std::map<Key, at::Tensor> rng;                   // recomputed: F -> R
  std::map<Key, std::map<int32_t, at::Tensor>> grad_parts;
  std::map<int32_t, std::map<int32_t, at::Tensor>> tied_parts;
  // The .grad a tied parameter had before this step (earlier steps'
  // accumulation), held aside so that only this step's part is exchanged.
  std::map<int32_t, at::Tensor> tied_before;
  std::map<size_t, Posted> recvs;
  std::vector<Sending> sends;
  // Sends the peer's reply proved delivered (see delivered_by_).
  std::set<size_t> delivered;
  std::vector<bool> issued;
  int32_t early_outstanding = 0;
  Clock::time_point t0;
  const StageFunctions* fns = nullptr;  // this step's stage callables
  // On a device: the marks around each record's task (start, end).
  std::optional<DeviceTimer> device;
  std::vector<std::pair<size_t, size_t>> device_marks;
  HeldMemory* memory = nullptr;  // measuring: what the step holds
};

Executor::Executor(int32_t rank, const schedule::Program& program,
                   std::vector<StageInfo> stages, std::vector<ValueInfo> values,
                   std::shared_ptr<Transport> transport,
                   std::map<int32_t, at::Tensor> tied_parameters,
                   ExecutorOptions options)
    : rank_(rank),
      program_(program),
      code_(program_.ranks.at(rank)),
      transport_(std::move(transport)),
      tied_(std::move(tied_parameters)),
      options_(options) {
  TORCH_CHECK(transport_, "torchmpmd: rank ", rank, ": no transport");
  TORCH_CHECK(transport_->size() == program_.num_ranks(), "torchmpmd: the ",
              transport_->name(), " group has ", transport_->size(),
              " ranks but the program was compiled for ", program_.num_ranks());
  TORCH_CHECK(transport_->rank() == rank, "torchmpmd: executor for rank ", rank,
              " got the transport of rank ", transport_->rank());
  for (auto& s : stages) stages_.emplace(s.id, std::move(s));
  for (auto& v : values) values_.emplace(v.id, std::move(v));
  for (int32_t s = 0; s < program_.num_stages(); ++s) {
    if (program_.rank_of(s) == rank_) {
      TORCH_CHECK(stages_.count(s), "torchmpmd: rank ", rank_, " holds stage ",
                  s, " but got no description of it");
    }
  }

  // Local readers of each value (consumer stages on this rank), and where
  // each value is produced.
  std::map<int32_t, int32_t> local_consumers;
  std::map<int32_t, int32_t> producer;
  for (const auto& e : program_.graph.edges) {
    producer[e.value] = e.src;
    if (program_.rank_of(e.dst) == rank_) ++local_consumers[e.value];
  }
  needs_.resize(code_.size());
  for (size_t i = 0; i < code_.size(); ++i) {
    const Instruction& ins = code_[i];
    if (ins.op == Op::kSend && ins.payload == Payload::kActivation &&
        ins.microbatch == 0) {
      ++activation_uses_[ins.value];
    }
    if (ins.op == Op::kRecv && ins.payload == Payload::kGrad &&
        ins.microbatch == 0) {
      ++grad_parts_expected_[ins.value];
    }
    if (ins.op == Op::kReduceTied) reduced_tied_.push_back(ins.value);
    if (ins.op == Op::kCompute) {
      task_fn(ins.task.kind);  // fail early
      if (schedule::info(ins.task.kind).recomputes) {
        recomputed_.emplace(ins.task.stage, ins.task.microbatch);
      }
    }
    if (ins.op != Op::kRecv) continue;
    const size_t reader = first_reader(code_, i);
    if (reader < code_.size()) needs_[reader].push_back(i);
  }
  for (const auto& [v, n] : local_consumers) {
    if (program_.rank_of(producer.at(v)) == rank_) {
      activation_uses_[v] += n;
      grad_parts_expected_[v] += n;
    }
  }
  std::map<int32_t, size_t> last_weight_grads;
  for (size_t i = 0; i < code_.size(); ++i) {
    const Instruction& ins = code_[i];
    if (ins.op == Op::kCompute &&
        schedule::info(ins.task.kind).finishes_weight_grads) {
      last_weight_grads[ins.task.stage] = i;
    }
  }
  for (const auto& [stage, pc] : last_weight_grads) stage_done_at_[pc] = stage;
  find_replies();
  for (const auto& [id, param] : tied_) {
    TORCH_CHECK(param.defined(), "torchmpmd: tied parameter ", id,
                " is undefined on rank ", rank_);
  }
}

Executor::~Executor() = default;

void Executor::find_replies() {
  // A pair-ordered (NCCL) transport's test() sees its sends complete, and
  // its receives return before the data is there (stream-ordered), so a
  // reply proves nothing there.
  if (transport_->pair_ordered()) return;
  // Our receives by (peer, tag).
  std::map<std::pair<int32_t, int64_t>, size_t> recv_at;
  for (size_t i = 0; i < code_.size(); ++i) {
    if (code_[i].op == Op::kRecv) recv_at[{code_[i].peer, code_[i].tag}] = i;
  }
  for (size_t i = 0; i < code_.size(); ++i) {
    const Instruction& send = code_[i];
    if (send.op != Op::kSend) continue;
    const auto& theirs = program_.ranks.at(send.peer);
    // The peer's receive of it, the task that reads it, and the first
    // message to us after that task.
    size_t j = 0;
    while (j < theirs.size() &&
           !(theirs[j].op == Op::kRecv && theirs[j].peer == rank_ &&
             theirs[j].tag == send.tag)) {
      ++j;
    }
    if (j == theirs.size()) continue;
    size_t m = first_reader(theirs, j) + 1;
    while (m < theirs.size() &&
           !(theirs[m].op == Op::kSend && theirs[m].peer == rank_)) {
      ++m;
    }
    if (m >= theirs.size()) continue;
    const auto reply = recv_at.find({send.peer, theirs[m].tag});
    if (reply != recv_at.end()) delivered_by_[reply->second].push_back(i);
  }
}

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

const ValueInfo& Executor::value(int32_t id) const {
  const auto it = values_.find(id);
  TORCH_INTERNAL_ASSERT(it != values_.end(), "no description of value ", id);
  return it->second;
}

const std::vector<int64_t>& Executor::shape_of(int32_t value_id, int32_t mb,
                                               const State& st) const {
  const auto it = st.fns->shapes.find({value_id, mb});
  return it != st.fns->shapes.end() ? it->second : value(value_id).shape;
}

const StageInfo& Executor::stage(int32_t id) const {
  const auto it = stages_.find(id);
  TORCH_INTERNAL_ASSERT(it != stages_.end(), "no description of stage ", id);
  return it->second;
}

std::string Executor::describe(const Instruction& ins) const {
  std::ostringstream out;
  switch (ins.payload) {
    case Payload::kActivation:
      out << "the activation '" << value(ins.value).name << "' (stage "
          << ins.src_stage << " -> stage";
      for (const int32_t s : ins.stages) out << " " << s;
      out << ") of microbatch " << ins.microbatch;
      break;
    case Payload::kGrad:
      out << "the gradient of '" << value(ins.value).name << "' (stage";
      for (const int32_t s : ins.stages) out << " " << s;
      out << " -> stage " << ins.src_stage << ") of microbatch "
          << ins.microbatch;
      break;
    case Payload::kTiedGrad:
      out << "the gradient of tied parameter #" << ins.value;
      break;
  }
  return out.str();
}

void Executor::post_recv(size_t index, State& st) {
  const Instruction& ins = code_[index];
  at::Tensor buffer;
  if (ins.payload == Payload::kTiedGrad) {
    buffer = at::empty_like(tied_.at(ins.value), at::MemoryFormat::Contiguous);
  } else {
    const ValueInfo& v = value(ins.value);
    buffer =
        at::empty(shape_of(v.id, ins.microbatch, st),
                  at::TensorOptions().dtype(v.dtype).device(options_.device));
  }
  State::Posted posted;
  posted.request = transport_->irecv(buffer, ins.peer, ins.tag);
  posted.buffer = buffer;
  st.recvs.emplace(index, std::move(posted));
  st.issued[index] = true;
}

void Executor::post_early(size_t pc, State& st) {
  // Peers with an earlier message not yet issued: on a pair-ordered
  // transport (NCCL) a receive waits behind them; Gloo matches by tag, so a
  // receive is posted as early as the budget allows, and the sender's data
  // goes out as soon as it is sent instead of a round trip after the
  // receiver gets to it.
  const bool ordered = transport_->pair_ordered();
  std::set<int32_t> blocked;
  const size_t end = std::min(code_.size(), pc + 256);
  for (size_t j = pc; j < end; ++j) {
    if (st.early_outstanding >= options_.max_early_recvs) return;
    const Instruction& ins = code_[j];
    if (ins.op != Op::kSend && ins.op != Op::kRecv) continue;
    if (st.issued[j]) continue;
    if (ins.op == Op::kRecv && !(ordered && blocked.count(ins.peer))) {
      post_recv(j, st);
      st.recvs.at(j).early = true;
      ++st.early_outstanding;
    } else {
      blocked.insert(ins.peer);
    }
  }
}

void Executor::wait_recv(size_t index, State& st, const Instruction& user) {
  const Instruction& ins = code_[index];
  if (!st.issued[index]) post_recv(index, st);
  auto& posted = st.recvs.at(index);
  const std::string task = user.op == Op::kCompute
                               ? schedule::to_string(user.task)
                               : std::string("the tied-gradient sum");
  try {
    posted.request->wait(options_.timeout);
  } catch (const TransportError& e) {
    std::ostringstream msg;
    msg << "torchmpmd: rank " << rank_ << " ";
    if (e.aborted()) {
      msg << "stopped waiting for " << describe(ins) << " from rank "
          << ins.peer << ", needed by " << task << ", because " << e.what();
    } else {
      msg << (e.timed_out() ? "timed out after " : "failed ")
          << (e.timed_out() ? seconds(options_.timeout) + " " : std::string())
          << "waiting for " << describe(ins) << " from rank " << ins.peer
          << ", needed by " << task << " (" << transport_->name()
          << "): " << e.what() << ". Rank " << ins.peer
          << " may have died or be stuck"
          << (e.timed_out() ? "; if it is only slow, raise the timeout" : "");
    }
    throw ExecutorError(msg.str());
  }
  at::Tensor buffer = std::move(posted.buffer);
  if (posted.early) --st.early_outstanding;
  st.recvs.erase(index);
  const auto replied = delivered_by_.find(index);
  if (replied != delivered_by_.end()) {
    st.delivered.insert(replied->second.begin(), replied->second.end());
  }
  switch (ins.payload) {
    case Payload::kActivation:
      // From here it is the reading stage's input (kept if its backward
      // needs it), no longer a posted receive.
      if (st.memory && user.op == Op::kCompute) {
        st.memory->adopt(buffer.storage().data_ptr().get(),
                         {user.task.stage, ins.microbatch});
      }
      st.acts[{ins.value, ins.microbatch}] = {
          buffer, static_cast<int32_t>(ins.stages.size())};
      break;
    case Payload::kGrad:
      st.grad_parts[{ins.value, ins.microbatch}][ins.stages.front()] = buffer;
      break;
    case Payload::kTiedGrad:
      st.tied_parts[ins.value][ins.peer] = buffer;
      break;
  }
}

void Executor::reap_sends(State& st, bool all) {
  auto& sends = st.sends;
  for (size_t i = 0; i < sends.size();) {
    const Instruction& ins = code_[sends[i].index];
    bool done = false;
    try {
      done = !all && sends[i].request->test();
      // Gloo's send reports completion only to a wait: one the peer's
      // reply proved delivered is waited for now (it returns at once), so
      // its tensor is freed here, not at the end of the step.
      if (!done && (all || st.delivered.count(sends[i].index))) {
        sends[i].request->wait(options_.timeout);
        done = true;
      }
    } catch (const TransportError& e) {
      std::ostringstream msg;
      msg << "torchmpmd: rank " << rank_ << " ";
      if (e.aborted()) {
        msg << "stopped sending " << describe(ins) << " to rank " << ins.peer
            << ", because " << e.what();
      } else {
        msg << (e.timed_out() ? "timed out sending " : "failed sending ")
            << describe(ins) << " to rank " << ins.peer << " ("
            << transport_->name() << "): " << e.what() << ". Rank " << ins.peer
            << " may have died or be stuck";
      }
      throw ExecutorError(msg.str());
    }
    if (done) {
      sends[i] = std::move(sends.back());
      sends.pop_back();
    } else {
      ++i;
    }
  }
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
  std::vector<at::Tensor> outs =
      call_forward(task, std::move(inputs), /*keep=*/!recomputed, st);
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
  if (si.split) {
    if (task.kind != TaskKind::kWeightGrad) input_grad(task, st);
    if (task.kind != TaskKind::kInputGrad) weight_grad(task, st);
    return;
  }
  if (task.kind != TaskKind::kBackward) {
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
  std::vector<at::Tensor> result =
      st.fns->input_grad(task.stage, mb, saved, grads);
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
  st.fns->weight_grad(task.stage, task.microbatch, saved);
}

void Executor::send(const Instruction& ins, State& st) {
  at::Tensor payload;
  switch (ins.payload) {
    case Payload::kActivation:
      payload = take_activation(ins.value, ins.microbatch, st).detach();
      break;
    case Payload::kGrad: {
      auto& parts = st.grad_parts.at({ins.value, ins.microbatch});
      for (const int32_t s : ins.stages) {
        at::Tensor part = parts.at(s);
        payload = payload.defined() ? payload.add(part) : part;
        parts.erase(s);
      }
      if (parts.empty()) st.grad_parts.erase({ins.value, ins.microbatch});
      break;
    }
    case Payload::kTiedGrad: {
      const at::Tensor& param = tied_.at(ins.value);
      payload = param.grad().defined() ? param.grad().detach().clone()
                                       : at::zeros_like(param);
      break;
    }
  }
  State::Sending sending;
  sending.request = transport_->isend(payload.contiguous(), ins.peer, ins.tag);
  sending.index = static_cast<size_t>(&ins - code_.data());
  st.sends.push_back(std::move(sending));
}

void Executor::reduce_tied(const Instruction& ins, State& st) {
  at::Tensor param = tied_.at(ins.value);
  auto parts = std::move(st.tied_parts[ins.value]);
  st.tied_parts.erase(ins.value);
  parts[rank_] =
      param.grad().defined() ? param.grad().detach() : at::zeros_like(param);
  // The sum in ascending rank order, equal on every holder. It accumulates
  // in place into a received buffer (ours to write), never into our own
  // part, which may still be on its way to the other holders: with two
  // parts, into the other one (a + b == b + a exactly); with more, into the
  // first when it was received, else into a copy.
  at::Tensor total;
  auto it = parts.begin();
  if (it->first != rank_) {
    total = it->second;
    ++it;
  } else if (parts.size() == 2) {
    total = std::next(it)->second;
    total.add_(it->second);
    it = parts.end();
  } else {
    total = it->second.clone();
    ++it;
  }
  for (; it != parts.end(); ++it) total.add_(it->second);
  parts.clear();
  // Earlier steps' gradient, equal on every holder, goes back on top.
  const auto before = st.tied_before.find(ins.value);
  if (before != st.tied_before.end()) {
    total.add_(before->second);
    st.tied_before.erase(before);
  }
  param.mutable_grad() = total;
}

void Executor::execute(size_t pc, State& st) {
  const Instruction& ins = code_[pc];
  switch (ins.op) {
    case Op::kSend:
      send(ins, st);
      st.issued[pc] = true;
      return;
    case Op::kRecv:
      if (!st.issued[pc]) post_recv(pc, st);
      return;
    case Op::kReduceTied:
    case Op::kCompute:
      break;
  }
  post_early(pc + 1, st);
  const auto wait_start = Clock::now();
  for (const size_t r : needs_[pc]) wait_recv(r, st, ins);
  const auto start = Clock::now();
  if (ins.op == Op::kReduceTied) {
    reduce_tied(ins, st);
    return;
  }
  const size_t device_start = st.device ? st.device->mark() : 0;
  const Task& task = ins.task;
  const HeldMemory::Owner owner{task.stage, task.microbatch};
  const auto& kind = schedule::info(task.kind);
  int64_t kept = -1;
  if (st.memory) {
    st.memory->sample();
    if (kind.backward) kept = st.memory->of(owner);
    // Forward-side tasks own what they allocate: what outlives them is
    // what the stage keeps for its backward (I: for its W).
    const bool keeps = !kind.backward || task.kind == TaskKind::kInputGrad;
    if (keeps) st.memory->own(owner);
  }
  try {
    (this->*task_fn(ins.task.kind))(ins.task, st);
  } catch (const ExecutorError&) {
    throw;
  } catch (const std::exception& e) {
    throw ExecutorError("torchmpmd: rank " + std::to_string(rank_) + ": " +
                        schedule::to_string(ins.task) +
                        " failed: " + message_of(e));
  }
  const auto end = Clock::now();
  if (st.device) st.device_marks.emplace_back(device_start, st.device->mark());
  int64_t held = -1;
  if (st.memory) {
    st.memory->own(std::nullopt);
    if (!kind.backward) kept = st.memory->of(owner);
    held = st.memory->sample();
  }
  records_.push_back(
      {ins.task,
       std::chrono::duration_cast<std::chrono::nanoseconds>(start - st.t0)
           .count(),
       std::chrono::duration_cast<std::chrono::nanoseconds>(end - st.t0)
           .count(),
       std::chrono::duration_cast<std::chrono::nanoseconds>(start - wait_start)
           .count(),
       held, kept});
}

void Executor::finish_on_device(State& st) {
  // Receives were stream waits: a dead peer shows as device work that never
  // ends. Bound it by the timeout (and any abort) before reading the times.
  // A mark of its own: the last task's came before the sends' stream waits
  // (reap_sends), which the step's end must cover too.
  st.device->mark();
  const auto deadline = Clock::now() + options_.timeout;
  const bool done = st.device->reached_end(deadline, [this] {
    if (auto reason = transport_->abort_reason()) {
      throw ExecutorError(c10::str("torchmpmd: rank ", rank_,
                                   " stopped waiting for its device work, "
                                   "because ",
                                   *reason));
    }
  });
  if (!done) {
    throw ExecutorError(c10::str(
        "torchmpmd: rank ", rank_, " timed out after ",
        seconds(options_.timeout), " waiting for the step's ", options_.device,
        " work to finish (", transport_->name(),
        "): a peer may have died or be stuck; its transfers are still queued "
        "on the device, so restart the job"));
  }
  for (size_t i = 0; i < records_.size(); ++i) {
    const auto& [first, last] = st.device_marks.at(i);
    records_[i].start_ns = st.device->ns(first);
    records_[i].end_ns = st.device->ns(last);
  }
}

void Executor::run(const StageFunctions& functions) {
  TORCH_CHECK(functions.forward, "torchmpmd: no forward function");
  for (const auto& [id, s] : stages_) {
    TORCH_CHECK(!s.split || (functions.input_grad && functions.weight_grad),
                "torchmpmd: stage ", id,
                " is split but no input/weight gradient functions were given");
  }
  peak_held_bytes_ = -1;
  std::optional<HeldMemoryScope> measuring;
  if (options_.measure_memory) measuring.emplace(options_.device);
  State st;
  st.fns = &functions;
  st.memory = measuring ? measuring->get() : nullptr;
  st.issued.assign(code_.size(), false);
  st.t0 = Clock::now();
  step_start_unix_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
  records_.clear();
  if (options_.device.type() != at::kCPU &&
      options_.device.type() != at::kMeta) {
    st.device.emplace(options_.device);
  }
  // Tied parameters start the step without their earlier gradient; a step
  // that fails before its sum gives it back under what it accumulated.
  for (const int32_t id : reduced_tied_) {
    at::Tensor& grad = tied_.at(id).mutable_grad();
    if (grad.defined()) st.tied_before[id] = std::move(grad);
    grad = at::Tensor();
  }
  struct RestoreTied {
    State& st;
    std::map<int32_t, at::Tensor>& tied;
    ~RestoreTied() {
      for (auto& [id, before] : st.tied_before) {
        at::Tensor& grad = tied.at(id).mutable_grad();
        grad = grad.defined() ? before.add(grad) : before;
      }
    }
  } restore_tied{st, tied_};
  try {
    for (size_t pc = 0; pc < code_.size(); ++pc) {
      execute(pc, st);
      reap_sends(st, /*all=*/false);
      if (functions.stage_done) {
        const auto done = stage_done_at_.find(pc);
        if (done != stage_done_at_.end()) {
          try {
            functions.stage_done(done->second);
          } catch (const std::exception& e) {
            throw ExecutorError(c10::str(
                "torchmpmd: rank ", rank_, ": what runs once stage ",
                done->second,
                "'s weight gradients are done failed: ", message_of(e)));
          }
        }
      }
    }
    reap_sends(st, /*all=*/true);
    if (st.device) finish_on_device(st);
  } catch (const ExecutorError& e) {
    throw PipelineError(e.what());
  } catch (const TransportError& e) {  // posting a send or receive
    throw PipelineError(c10::str("torchmpmd: rank ", rank_,
                                 " stopped its step, because ", e.what()));
  }
  TORCH_INTERNAL_ASSERT(
      st.acts.empty() && st.outputs.empty() && st.leaves.empty() &&
          st.grad_parts.empty() && st.saved.empty() && st.saved_w.empty() &&
          st.kept.empty() && st.rng.empty() && st.recvs.empty(),
      "torchmpmd: rank ", rank_, " kept tensors past the end of the step");
  if (st.memory) peak_held_bytes_ = st.memory->peak_held();
}

}  // namespace torchmpmd::runtime
