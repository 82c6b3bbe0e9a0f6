#include "schedule/lower.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>

#include "schedule/grid.h"
#include "schedule/machine.h"
#include "schedule/validate.h"
#include "util/check.h"

namespace torchmpmd::schedule {

namespace {

int64_t pair_key(int32_t a, int32_t b) {
  return static_cast<int64_t>(std::min(a, b)) * (1LL << 31) + std::max(a, b);
}

Instruction compute(const Task& t) {
  Instruction ins;
  ins.op = Op::kCompute;
  ins.task = t;
  return ins;
}

// A parameter several ranks hold, with the tasks after which each holder
// rank's gradient of it is final.
struct TiedState {
  const TiedGroup* group;
  std::vector<int32_t> holders;          // ranks, ascending
  std::map<int32_t, int32_t> remaining;  // rank -> weight-grad tasks left
};

// One lowering: runs the schedule's tasks on the machine model in the order
// they can start, and emits each task with the messages its completion sends
// (the table's `emits_*`) on both ends.
class Lowering {
 public:
  Lowering(const PipelineGraph& graph, const ScheduleSpec& spec,
           const Costs& costs);
  Program run() &&;

 private:
  int32_t rank_of(int32_t stage) const { return spec_.placement[stage]; }
  // Consumer stages of a value on one rank.
  std::vector<int32_t> consumers_on(int32_t value, int32_t rank) const;
  // Whether every task the next task of `rank` depends on has run.
  bool deps_done(int32_t rank) const;
  // The rank whose next task can start earliest, and when; -1 if none can.
  int32_t next_rank(double* start) const;
  // Throws the deadlock error: where each rank stopped, what it waits for.
  void deadlock() const;
  void emit(int32_t rank, Instruction ins);
  void message(int32_t from, int32_t to, Instruction ins);
  void send_activations(int32_t rank, const Task& t);
  void send_input_grads(int32_t rank, const Task& t);
  void send_tied_grads(int32_t rank, const Task& t);
  // The stage's data-parallel collectives around task `t` (spec.collectives).
  void unshard_before(int32_t rank, const Task& t);
  void reduce_grads_after(int32_t rank, const Task& t);

  const ScheduleSpec& spec_;
  const TaskPositions positions_;
  const Flow flow_;
  Machine machine_;
  Program prog_;
  std::map<int64_t, int64_t> pair_tags_;
  std::vector<TiedState> tied_;
  std::vector<bool> done_;
  std::vector<int32_t> pos_;  // per rank, its next task
  // Per rank and position: the dependencies of that task (of all its parts)
  // as indices into done_, computed once.
  std::vector<std::vector<std::vector<size_t>>> deps_;
  // The part of the fused task being lowered whose messages are sent now
  // (Instruction::part); -1 otherwise.
  int32_t part_ = -1;
  // Per stage: whether it was unsharded yet; its tasks left that finish
  // weight gradients (the last one reduces them).
  std::vector<bool> unsharded_;
  std::vector<int32_t> weight_grads_left_;
  // (value, mb, rank) -> backward tasks of local consumers still to run.
  std::map<std::tuple<int32_t, int32_t, int32_t>, int32_t> grads_pending_;
};

Lowering::Lowering(const PipelineGraph& graph, const ScheduleSpec& spec,
                   const Costs& costs)
    : spec_(spec),
      positions_(locate(graph, spec)),
      flow_(graph),
      machine_(spec.num_ranks, costs),
      done_(positions_.size(), false),
      pos_(spec.num_ranks, 0) {
  prog_.spec = spec;
  prog_.graph = graph;
  prog_.ranks.assign(spec.num_ranks, {});
  deps_.resize(spec.num_ranks);
  for (int32_t r = 0; r < spec.num_ranks; ++r) {
    for (const Task& t : spec.tasks[r]) {
      std::vector<size_t>& deps = deps_[r].emplace_back();
      for (const Task& dep :
           dependencies(t, flow_, positions_, spec.forward_only)) {
        deps.push_back(positions_.index(dep));
      }
    }
  }
  if (spec.forward_only) return;
  unsharded_.assign(graph.num_stages, false);
  weight_grads_left_.assign(graph.num_stages, 0);
  for (const auto& tasks : spec.tasks) {
    for (const Task& task : tasks) {
      for (const Task& t : task.simple_parts()) {
        if (info(t.kind).finishes_weight_grads) ++weight_grads_left_[t.stage];
      }
    }
  }
  for (const TiedGroup& g : graph.tied) {
    TiedState st{&g, {}, {}};
    for (const int32_t s : g.stages) {
      st.holders.push_back(rank_of(s));
      st.remaining[rank_of(s)] += spec.num_microbatches;
    }
    std::sort(st.holders.begin(), st.holders.end());
    st.holders.erase(std::unique(st.holders.begin(), st.holders.end()),
                     st.holders.end());
    if (st.holders.size() > 1) tied_.push_back(std::move(st));
  }
}

std::vector<int32_t> Lowering::consumers_on(int32_t value, int32_t rank) const {
  std::vector<int32_t> out;
  for (const int32_t c : flow_.consumers.at(value)) {
    if (rank_of(c) == rank) out.push_back(c);
  }
  return out;
}

bool Lowering::deps_done(int32_t rank) const {
  for (const size_t dep : deps_[rank][pos_[rank]]) {
    if (!done_[dep]) return false;
  }
  return true;
}

int32_t Lowering::next_rank(double* start) const {
  int32_t best = -1;
  double best_start = std::numeric_limits<double>::infinity();
  for (int32_t r = 0; r < spec_.num_ranks; ++r) {
    if (pos_[r] >= static_cast<int32_t>(spec_.tasks[r].size())) continue;
    const Task& t = spec_.tasks[r][pos_[r]];
    if (!deps_done(r)) continue;
    // Every message it reads was sent when the dependency that produced it
    // finished.
    const std::optional<double> ready = machine_.ready(r, compute(t));
    MPMD_INTERNAL_ASSERT(ready.has_value(), to_string(t));
    if (*ready < best_start) {
      best_start = *ready;
      best = r;
    }
  }
  *start = best_start;
  return best;
}

void Lowering::deadlock() const {
  std::string why;
  std::vector<std::pair<int32_t, int32_t>> marks;
  for (int32_t r = 0; r < spec_.num_ranks; ++r) {
    if (pos_[r] >= static_cast<int32_t>(spec_.tasks[r].size())) continue;
    const Task& t = spec_.tasks[r][pos_[r]];
    marks.emplace_back(r, pos_[r]);
    for (const Task& dep :
         dependencies(t, flow_, positions_, spec_.forward_only)) {
      if (done_[positions_.index(dep)]) continue;
      const Position& p = positions_.at(dep);
      why += detail::str_cat("\n  rank ", r, " waits at ", to_action(t),
                             " for ", to_action(dep), " (rank ", p.rank,
                             " position ", p.index, ")");
    }
  }
  MPMD_CHECK(false,
             "schedule: deadlock: no rank can run its next task, each waits "
             "for a task that runs later on another rank:",
             why, grid_for(spec_, marks));
}

void Lowering::emit(int32_t rank, Instruction ins) {
  prog_.order.emplace_back(rank,
                           static_cast<int32_t>(prog_.ranks[rank].size()));
  prog_.ranks[rank].push_back(std::move(ins));
}

// The send leaves when the sender is done with the task that produced it,
// as it will in simulate() and on the real machine.
void Lowering::message(int32_t from, int32_t to, Instruction ins) {
  ins.tag = pair_tags_[pair_key(from, to)]++;
  Instruction recv = ins;
  ins.op = Op::kSend;
  ins.part = part_;
  ins.peer = to;
  recv.op = Op::kRecv;
  recv.peer = from;
  machine_.send(from, ins);
  machine_.post(to, recv);
  emit(from, std::move(ins));
  emit(to, std::move(recv));
}

// Each value `t` produces, once to every other rank holding a consumer.
void Lowering::send_activations(int32_t rank, const Task& t) {
  for (const int32_t v : flow_.produces[t.stage]) {
    std::set<int32_t> dests;
    for (const int32_t c : flow_.consumers.at(v)) {
      if (rank_of(c) != rank) dests.insert(rank_of(c));
    }
    for (const int32_t d : dests) {
      Instruction ins;
      ins.payload = Payload::kActivation;
      ins.value = v;
      ins.microbatch = t.microbatch;
      ins.src_stage = t.stage;
      ins.stages = consumers_on(v, d);
      ins.bytes = flow_.bytes.at(v);
      message(rank, d, std::move(ins));
    }
  }
}

// The gradient of each value `t`'s stage read from another rank, once this
// rank's last consumer stage of it has contributed its part.
void Lowering::send_input_grads(int32_t rank, const Task& t) {
  for (const int32_t v : flow_.reads[t.stage]) {
    const int32_t p = flow_.producer.at(v);
    if (!flow_.requires_grad.at(v) || rank_of(p) == rank) continue;
    const auto key = std::make_tuple(v, t.microbatch, rank);
    auto it = grads_pending_.find(key);
    if (it == grads_pending_.end()) {
      const auto n = static_cast<int32_t>(consumers_on(v, rank).size());
      it = grads_pending_.emplace(key, n).first;
    }
    if (--it->second > 0) continue;
    Instruction ins;
    ins.payload = Payload::kGrad;
    ins.value = v;
    ins.microbatch = t.microbatch;
    ins.src_stage = p;
    ins.stages = consumers_on(v, rank);
    ins.bytes = flow_.bytes.at(v);
    message(rank, rank_of(p), std::move(ins));
  }
}

// A tied parameter's gradient, to every other holder, after this rank's last
// task that finishes weight gradients of a stage holding it.
void Lowering::send_tied_grads(int32_t rank, const Task& t) {
  for (auto& st : tied_) {
    const auto& stages = st.group->stages;
    if (!std::binary_search(stages.begin(), stages.end(), t.stage)) continue;
    if (--st.remaining[rank] > 0) continue;
    for (const int32_t h : st.holders) {
      if (h == rank) continue;
      Instruction ins;
      ins.payload = Payload::kTiedGrad;
      ins.value = st.group->id;
      for (const int32_t s : stages) {
        if (rank_of(s) == rank) ins.stages.push_back(s);
      }
      ins.bytes = st.group->bytes;
      message(rank, h, std::move(ins));
    }
  }
}

void Lowering::unshard_before(int32_t rank, const Task& t) {
  if (spec_.forward_only || spec_.collectives.empty()) return;
  if (!spec_.collectives[t.stage].unshard || unsharded_[t.stage]) return;
  unsharded_[t.stage] = true;
  Instruction ins;
  ins.op = Op::kUnshard;
  ins.value = t.stage;
  emit(rank, std::move(ins));
}

void Lowering::reduce_grads_after(int32_t rank, const Task& t) {
  if (spec_.forward_only || spec_.collectives.empty()) return;
  if (!info(t.kind).finishes_weight_grads) return;
  if (--weight_grads_left_[t.stage] > 0) return;
  if (!spec_.collectives[t.stage].reduce_grads) return;
  Instruction ins;
  ins.op = Op::kReduceGrads;
  ins.value = t.stage;
  emit(rank, std::move(ins));
}

Program Lowering::run() && {
  size_t total = 0;
  for (const auto& l : spec_.tasks) total += l.size();
  for (size_t step = 0; step < total; ++step) {
    double start = 0;
    const int32_t r = next_rank(&start);
    if (r < 0) deadlock();
    // A fused task is one step: it starts once every part's inputs are
    // there (deps_done, ready) and its parts' messages leave after it.
    const Task& task = spec_.tasks[r][pos_[r]++];
    for (const Task& t : task.simple_parts()) {
      done_[positions_.index(t)] = true;
      unshard_before(r, t);
    }
    emit(r, compute(task));
    // Part by part (no measured time of its own), each part's messages
    // leave as it ends; else all after the task (machine.h).
    const bool by_part = machine_.runs_parts(task);
    if (!by_part) machine_.run(r, compute(task), start);
    const Task::Parts parts = task.simple_parts();
    for (size_t k = 0; k < parts.size(); ++k) {
      const Task& t = parts.begin()[k];
      if (by_part) {
        machine_.run(r, t, k == 0 ? start : machine_.clock(r));
        part_ = static_cast<int32_t>(k);
      }
      const TaskKindInfo& kind = info(t.kind);
      if (kind.emits_activations) send_activations(r, t);
      if (kind.emits_input_grads && !spec_.forward_only) {
        send_input_grads(r, t);
      }
      if (kind.finishes_weight_grads) send_tied_grads(r, t);
    }
    part_ = -1;
    // Gradient reductions start after the whole task.
    for (const Task& t : parts) reduce_grads_after(r, t);
  }
  for (const auto& st : tied_) {
    for (const int32_t h : st.holders) {
      Instruction ins;
      ins.op = Op::kReduceTied;
      ins.payload = Payload::kTiedGrad;
      ins.value = st.group->id;
      emit(h, std::move(ins));
    }
  }
  return std::move(prog_);
}

}  // namespace

Program lower(const PipelineGraph& graph, const ScheduleSpec& spec,
              const Costs& costs) {
  validate(graph, spec);
  costs.check(graph.num_stages);
  return Lowering(graph, spec, costs).run();
}

}  // namespace torchmpmd::schedule
