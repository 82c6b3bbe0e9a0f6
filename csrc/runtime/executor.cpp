#include "runtime/executor_internal.h"

namespace torchmpmd::runtime {

using namespace internal;

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
      for (const Task& part : ins.task.simple_parts()) {
        task_fn(part.kind);  // fail early
        if (schedule::info(part.kind).recomputes) {
          recomputed_.emplace(part.stage, part.microbatch);
        }
      }
    }
    if (ins.op != Op::kRecv) continue;
    const size_t reader = first_reader(code_, i);
    if (reader >= code_.size()) continue;
    // A fused task waits for each part's receives right before that part
    // (as the simulator runs it): its first part's before it starts.
    const Task& task = code_[reader].task;
    size_t part = 0;
    if (code_[reader].op == Op::kCompute && task.fused()) {
      while (part < task.parts.size() &&
             !schedule::reads(task.parts[part], ins)) {
        ++part;
      }
      TORCH_INTERNAL_ASSERT(part < task.parts.size());
    }
    if (part == 0) {
      needs_[reader].push_back(i);
    } else {
      auto& later = later_needs_[reader];
      later.resize(task.parts.size());
      later[part].push_back(i);
    }
  }
  for (const auto& [v, n] : local_consumers) {
    if (program_.rank_of(producer.at(v)) == rank_) {
      activation_uses_[v] += n;
      grad_parts_expected_[v] += n;
    }
  }
  // The lowering puts a stage's REDUCE_grads after the task (its sends
  // between) whose part finishes the stage's weight gradients for the step.
  for (size_t j = 0; j < code_.size(); ++j) {
    if (code_[j].op != Op::kReduceGrads) continue;
    for (size_t i = j; i-- > 0;) {
      if (code_[i].op != Op::kCompute) continue;
      const schedule::Task::Parts parts = code_[i].task.simple_parts();
      for (size_t k = parts.size(); k-- > 0;) {
        const Task& part = parts.begin()[k];
        if (part.stage == code_[j].value &&
            schedule::info(part.kind).finishes_weight_grads) {
          finishes_grads_.emplace(std::make_pair(i, k), part.stage);
          break;
        }
      }
      break;
    }
  }
  find_replies();
  for (const auto& [id, param] : tied_) {
    TORCH_CHECK(param.defined(), "torchmpmd: tied parameter ", id,
                " is undefined on rank ", rank_);
  }
}

Executor::~Executor() = default;

void Executor::find_replies() {
  // On a stream-ordered (NCCL) transport, test() sees sends complete and
  // receives return before the data is there, so a reply proves nothing.
  if (!transport_->completion_means_delivered()) return;
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
    // Sends right after a fused task leave between its parts, maybe before
    // the part that reads ours: no proof.
    while (m < theirs.size() && theirs[m].op == Op::kSend &&
           theirs[m].part >= 0) {
      ++m;
    }
    while (m < theirs.size() &&
           !(theirs[m].op == Op::kSend && theirs[m].peer == rank_)) {
      ++m;
    }
    if (m >= theirs.size()) continue;
    const auto reply = recv_at.find({send.peer, theirs[m].tag});
    if (reply != recv_at.end()) delivered_by_[reply->second].push_back(i);
  }
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

std::string Executor::wait_name(const Instruction& ins) const {
  switch (ins.payload) {
    case Payload::kActivation:
    case Payload::kGrad:
      return c10::str("wait recv(",
                      ins.payload == Payload::kGrad ? "grad '" : "act '",
                      value(ins.value).name, "', mb=", ins.microbatch,
                      ", from rank ", ins.peer, ")");
    case Payload::kTiedGrad:
      break;
  }
  return c10::str("wait recv(tied grad #", ins.value, ", from rank ", ins.peer,
                  ")");
}

void Executor::execute(size_t pc, State& st) {
  const Instruction& ins = code_[pc];
  switch (ins.op) {
    case Op::kSend:
      if (!st.issued[pc]) send(ins, st);  // else sent after a fused part
      st.issued[pc] = true;
      return;
    case Op::kRecv:
      if (!st.issued[pc]) post_recv(pc, st);
      return;
    case Op::kUnshard:
    case Op::kReduceGrads:
      collective(ins, st);
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
    const ProfilerRange range([&] { return schedule::to_string(ins); });
    reduce_tied(ins, st);
    return;
  }
  const size_t device_start = st.device ? st.device->mark() : 0;
  const Task& task = ins.task;
  const auto later = later_needs_.find(pc);
  if (later != later_needs_.end()) {
    // Its later parts' receives are posted now, before any of its sends
    // leaves: a pair-ordered transport sees them in program order.
    for (const auto& part : later->second) {
      for (const size_t r : part) {
        if (!st.issued[r]) post_recv(r, st);
      }
    }
  }
  int64_t kept = -1;
  {
    // The task's range in torch.profiler, named as errors name it; on a
    // device it holds the launches of the task's work. A fused task is one
    // range and one record: its parts run inside them, each after the
    // receives it reads (their waits inside its range) and followed by the
    // sends of what it produced (Instruction::part), as simulate() has it.
    const ProfilerRange range([&] { return schedule::to_string(task); });
    const std::vector<int32_t> lanes = schedule::lanes(task);
    if (overlaps(task, lanes, st)) {
      run_sides(pc, lanes, st);
    } else {
      const schedule::Task::Parts parts = task.simple_parts();
      for (size_t k = 0; k < parts.size(); ++k) {
        const LaneScope lane(lanes[k]);
        before_part(pc, k, st);
        const auto part_start = Clock::now();
        kept = run_part(task, parts.begin()[k], st);
        if (task.fused()) {
          st.part_times.emplace_back(since(st, part_start),
                                     since(st, Clock::now()), lanes[k]);
        }
        send_part(pc, k, st);
      }
    }
  }
  const auto end = Clock::now();
  if (st.device) st.device_marks.emplace_back(device_start, st.device->mark());
  // A fused task's parts keep for different (stage, microbatch): its
  // record gives what every stage holds, not one part's share.
  if (task.fused()) kept = -1;
  const int64_t held = st.memory ? st.memory->sample() : -1;
  records_.push_back(
      {ins.task, Op::kCompute,
       std::chrono::duration_cast<std::chrono::nanoseconds>(start - st.t0)
           .count(),
       std::chrono::duration_cast<std::chrono::nanoseconds>(end - st.t0)
           .count(),
       std::chrono::duration_cast<std::chrono::nanoseconds>(start - wait_start)
           .count(),
       held, kept});
  records_.back().parts = std::move(st.part_times);
  st.part_times.clear();
}

namespace {
thread_local int32_t tls_lane = 0;
}  // namespace

int32_t current_lane() { return tls_lane; }

LaneScope::LaneScope(int32_t lane) : before_(tls_lane) { tls_lane = lane; }
LaneScope::~LaneScope() { tls_lane = before_; }

bool Executor::overlaps(const Task& task, const std::vector<int32_t>& lanes,
                        const State& st) const {
  if (!st.fns->overlap || !st.fns->replay_rng || st.memory || st.device ||
      std::count(lanes.begin(), lanes.end(), 1) == 0) {
    return false;
  }
  // The sides share the device's random generator: at most one of them may
  // draw from it (a stage not yet seen drawing nothing counts as drawing).
  bool drawing[2] = {false, false};
  const schedule::Task::Parts parts = task.simple_parts();
  for (size_t k = 0; k < parts.size(); ++k) {
    const Task& part = parts.begin()[k];
    const auto d = draws_.find(part.stage);
    if (d == draws_.end() || d->second ||
        (schedule::info(part.kind).backward &&
         st.fns->backward_rng.count(part.stage))) {
      drawing[lanes[k]] = true;
    }
  }
  return !(drawing[0] && drawing[1]);
}

void Executor::before_part(size_t pc, size_t k, State& st) {
  const auto later = later_needs_.find(pc);
  if (later != later_needs_.end()) {
    for (const size_t r : later->second.at(k)) wait_recv(r, st, code_[pc]);
  }
  if (st.fns->grads_start) {
    const auto last = finishes_grads_.find({pc, k});
    if (last != finishes_grads_.end()) grads_start(last->second, st);
  }
}

void Executor::send_part(size_t pc, size_t k, State& st) {
  if (!code_[pc].task.fused()) return;
  for (size_t j = pc + 1; j < code_.size() && code_[j].op == Op::kSend; ++j) {
    if (code_[j].part != static_cast<int32_t>(k)) continue;
    send(code_[j], st);
    st.issued[j] = true;
  }
}

void Executor::run_sides(size_t pc, const std::vector<int32_t>& lanes,
                         State& st) {
  const Task& task = code_[pc].task;
  const schedule::Task::Parts parts = task.simple_parts();
  const size_t n = parts.size();
  // The forward side's receives (and any gradient start) first, here: only
  // this thread posts and waits for receives.
  for (size_t k = 0; k < n; ++k) {
    if (lanes[k] == 1) before_part(pc, k, st);
  }
  // Sends leave in program order (a pair-ordered transport matches them to
  // receives in that order), each as soon as its part and every earlier
  // part are done; by whichever side finishes the last of those.
  std::vector<bool> done(n, false);
  std::vector<std::optional<TaskRecord::PartTime>> times(n);
  size_t next_send = 0;
  const auto finished = [&](size_t k, Clock::time_point t0) {
    times[k].emplace(since(st, t0), since(st, Clock::now()), lanes[k]);
    done[k] = true;
    for (; next_send < n && done[next_send]; ++next_send) {
      send_part(pc, next_send, st);
    }
  };
  // Each side holds the step's state while it touches it, and lets go of
  // it around its long calls (the stage's callables, autograd) and waits.
  std::unique_lock<std::mutex> lock(st.mu);
  st.concurrent = true;
  std::exception_ptr side_error;
  const at::ThreadLocalState tls;  // grad mode, profiler callbacks, ...
  std::thread side([&] {
    try {
      const at::ThreadLocalStateGuard guard(tls);
      const LaneScope lane(1);
      std::unique_lock<std::mutex> held(st.mu);
      for (size_t k = 0; k < n; ++k) {
        if (lanes[k] != 1) continue;
        const auto t0 = Clock::now();
        run_part(task, parts.begin()[k], st);
        finished(k, t0);
      }
    } catch (...) {
      side_error = std::current_exception();
    }
  });
  std::exception_ptr own_error;
  try {
    const LaneScope lane(0);
    for (size_t k = 0; k < n; ++k) {
      if (lanes[k] != 0) continue;
      before_part(pc, k, st);
      const auto t0 = Clock::now();
      run_part(task, parts.begin()[k], st);
      finished(k, t0);
    }
  } catch (...) {
    own_error = std::current_exception();
  }
  {
    const Unlocked waiting(st);
    side.join();
  }
  st.concurrent = false;
  // A failed side stops the step; the other side's parts were run to
  // their end (or their own failure) first, so nothing is left running.
  if (own_error) std::rethrow_exception(own_error);
  if (side_error) std::rethrow_exception(side_error);
  for (auto& t : times) st.part_times.push_back(*t);
}

int64_t Executor::run_part(const Task& task, const Task& part, State& st) {
  const HeldMemory::Owner owner{part.stage, part.microbatch};
  const auto& kind = schedule::info(part.kind);
  int64_t kept = -1;
  if (st.memory) {
    st.memory->sample();
    if (kind.backward) kept = st.memory->of(owner);
    // Forward-side tasks own what they allocate: what outlives them is
    // what the stage keeps for its backward (I: for its W, the W-only
    // bytes the table says it leaves).
    const bool keeps = !kind.backward || kind.memory.weight_only > 0;
    if (keeps) st.memory->own(owner);
  }
  try {
    (this->*task_fn(part.kind))(part, st);
  } catch (const ExecutorError&) {
    throw;
  } catch (const std::exception& e) {
    const std::string what =
        task.fused() ? c10::str(schedule::to_string(part), " (part of fused ",
                                schedule::to_action(task), ")")
                     : schedule::to_string(part);
    throw ExecutorError("torchmpmd: rank " + std::to_string(rank_) + ": " +
                        what + " failed: " + message_of(e));
  }
  if (st.memory) {
    st.memory->own(std::nullopt);
    if (!kind.backward) kept = st.memory->of(owner);
  }
  return kept;
}

void Executor::grads_start(int32_t stage, State& st) {
  try {
    st.fns->grads_start(stage);
  } catch (const std::exception& e) {
    throw ExecutorError(c10::str("torchmpmd: rank ", rank_,
                                 ": preparing to reduce the gradients of "
                                 "stage ",
                                 stage,
                                 " as its last backward makes them (its data "
                                 "parallelism) failed: ",
                                 message_of(e)));
  }
}

void Executor::collective(const Instruction& ins, State& st) {
  const bool unshard = ins.op == Op::kUnshard;
  const auto& fn = unshard ? st.fns->unshard : st.fns->stage_done;
  if (!fn) return;
  const auto start = Clock::now();
  const size_t device_start = st.device ? st.device->mark() : 0;
  try {
    const ProfilerRange range([&] { return schedule::to_string(ins); });
    fn(ins.value);
  } catch (const std::exception& e) {
    throw ExecutorError(
        c10::str("torchmpmd: rank ", rank_, ": ",
                 unshard ? "gathering" : "reducing the gradients of", " stage ",
                 ins.value, " (its data parallelism, ",
                 schedule::to_string(ins), ") failed: ", message_of(e)));
  }
  const auto end = Clock::now();
  if (st.device) st.device_marks.emplace_back(device_start, st.device->mark());
  schedule::Task task;
  task.stage = ins.value;
  task.microbatch = -1;
  const auto ns = [&](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t - st.t0)
        .count();
  };
  records_.push_back({task, ins.op, ns(start), ns(end), 0, -1, -1});
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
  sent_bytes_ = 0;
  received_bytes_ = 0;
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
