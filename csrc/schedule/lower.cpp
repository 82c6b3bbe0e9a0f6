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

}  // namespace

Program lower(const PipelineGraph& graph, const ScheduleSpec& spec,
              const Costs& costs) {
  validate(graph, spec);
  costs.check(graph.num_stages);
  const TaskPositions positions = locate(graph, spec);
  const Flow flow(graph);
  const int32_t R = spec.num_ranks;
  const int32_t M = spec.num_microbatches;
  const auto rank_of = [&](int32_t stage) { return spec.placement[stage]; };

  Program prog;
  prog.spec = spec;
  prog.graph = graph;
  prog.ranks.assign(R, {});
  Machine machine(R, costs);
  std::map<int64_t, int64_t> pair_tags;
  const auto emit = [&](int32_t rank, Instruction ins) {
    prog.order.emplace_back(rank,
                            static_cast<int32_t>(prog.ranks[rank].size()));
    prog.ranks[rank].push_back(std::move(ins));
  };
  // The send leaves when the sender is done with the task that produced it,
  // as it will in simulate() and on the real machine.
  const auto message = [&](int32_t from, int32_t to, Instruction ins) {
    ins.tag = pair_tags[pair_key(from, to)]++;
    Instruction recv = ins;
    ins.op = Op::kSend;
    ins.peer = to;
    recv.op = Op::kRecv;
    recv.peer = from;
    machine.send(from, ins);
    machine.post(to, recv);
    emit(from, std::move(ins));
    emit(to, std::move(recv));
  };

  // Consumer stages of a value on one rank.
  const auto consumers_on = [&](int32_t value, int32_t rank) {
    std::vector<int32_t> out;
    for (const int32_t c : flow.consumers.at(value)) {
      if (rank_of(c) == rank) out.push_back(c);
    }
    return out;
  };

  // Tied groups that need a cross-rank sum, with the tasks after which each
  // holder rank's gradient is final.
  struct TiedState {
    const TiedGroup* group;
    std::vector<int32_t> holders;          // ranks, ascending
    std::map<int32_t, int32_t> remaining;  // rank -> weight-grad tasks left
  };
  std::vector<TiedState> tied;
  if (!spec.forward_only) {
    for (const TiedGroup& g : graph.tied) {
      TiedState st{&g, {}, {}};
      for (const int32_t s : g.stages) {
        st.holders.push_back(rank_of(s));
        st.remaining[rank_of(s)] += M;
      }
      std::sort(st.holders.begin(), st.holders.end());
      st.holders.erase(std::unique(st.holders.begin(), st.holders.end()),
                       st.holders.end());
      if (st.holders.size() > 1) tied.push_back(std::move(st));
    }
  }

  std::vector<bool> done(positions.size(), false);
  std::vector<int32_t> pos(R, 0);
  // (value, mb, rank) -> backward tasks of local consumers still to run.
  std::map<std::tuple<int32_t, int32_t, int32_t>, int32_t> grads_pending;
  const auto compute = [](const Task& t) {
    Instruction ins;
    ins.op = Op::kCompute;
    ins.task = t;
    return ins;
  };
  const auto deps_done = [&](const Task& t) {
    for (const Task& dep :
         dependencies(t, flow, positions, spec.forward_only)) {
      if (!done[positions.index(dep)]) return false;
    }
    return true;
  };

  size_t total = 0;
  for (const auto& l : spec.tasks) total += l.size();
  for (size_t step = 0; step < total; ++step) {
    int32_t best = -1;
    double best_start = std::numeric_limits<double>::infinity();
    for (int32_t r = 0; r < R; ++r) {
      if (pos[r] >= static_cast<int32_t>(spec.tasks[r].size())) continue;
      const Task& t = spec.tasks[r][pos[r]];
      if (!deps_done(t)) continue;
      // Every message it reads was sent when the dependency that produced it
      // finished.
      const std::optional<double> start = machine.ready(r, compute(t));
      MPMD_INTERNAL_ASSERT(start.has_value(), to_string(t));
      if (*start < best_start) {
        best_start = *start;
        best = r;
      }
    }
    if (best < 0) {
      std::string why;
      std::vector<std::pair<int32_t, int32_t>> marks;
      for (int32_t r = 0; r < R; ++r) {
        if (pos[r] >= static_cast<int32_t>(spec.tasks[r].size())) continue;
        const Task& t = spec.tasks[r][pos[r]];
        marks.emplace_back(r, pos[r]);
        for (const Task& dep :
             dependencies(t, flow, positions, spec.forward_only)) {
          if (done[positions.index(dep)]) continue;
          const Position& p = positions.at(dep);
          why += detail::str_cat("\n  rank ", r, " waits at ", to_action(t),
                                 " for ", to_action(dep), " (rank ", p.rank,
                                 " position ", p.index, ")");
        }
      }
      MPMD_CHECK(false,
                 "schedule: deadlock: no rank can run its next task, each "
                 "waits for a task that runs later on another rank:",
                 why, grid_for(spec, marks));
    }
    const int32_t r = best;
    const Task t = spec.tasks[r][pos[r]];
    const TaskKindInfo& kind = info(t.kind);
    machine.run(r, compute(t), best_start);
    done[positions.index(t)] = true;
    emit(r, compute(t));
    ++pos[r];

    if (kind.emits_activations) {
      for (const int32_t v : flow.produces[t.stage]) {
        std::set<int32_t> dests;
        for (const int32_t c : flow.consumers.at(v)) {
          if (rank_of(c) != r) dests.insert(rank_of(c));
        }
        for (const int32_t d : dests) {
          Instruction ins;
          ins.payload = Payload::kActivation;
          ins.value = v;
          ins.microbatch = t.microbatch;
          ins.src_stage = t.stage;
          ins.stages = consumers_on(v, d);
          ins.bytes = flow.bytes.at(v);
          message(r, d, std::move(ins));
        }
      }
    }
    if (kind.emits_input_grads && !spec.forward_only) {
      for (const int32_t v : flow.reads[t.stage]) {
        const int32_t p = flow.producer.at(v);
        if (!flow.requires_grad.at(v) || rank_of(p) == r) continue;
        const auto key = std::make_tuple(v, t.microbatch, r);
        auto it = grads_pending.find(key);
        if (it == grads_pending.end()) {
          it =
              grads_pending
                  .emplace(key, static_cast<int32_t>(consumers_on(v, r).size()))
                  .first;
        }
        if (--it->second > 0) continue;
        Instruction ins;
        ins.payload = Payload::kGrad;
        ins.value = v;
        ins.microbatch = t.microbatch;
        ins.src_stage = p;
        ins.stages = consumers_on(v, r);
        ins.bytes = flow.bytes.at(v);
        message(r, rank_of(p), std::move(ins));
      }
    }
    if (kind.finishes_weight_grads) {
      for (auto& st : tied) {
        const auto& stages = st.group->stages;
        if (!std::binary_search(stages.begin(), stages.end(), t.stage)) {
          continue;
        }
        if (--st.remaining[r] > 0) continue;
        for (const int32_t h : st.holders) {
          if (h == r) continue;
          Instruction ins;
          ins.payload = Payload::kTiedGrad;
          ins.value = st.group->id;
          for (const int32_t s : stages) {
            if (rank_of(s) == r) ins.stages.push_back(s);
          }
          ins.bytes = st.group->bytes;
          message(r, h, std::move(ins));
        }
      }
    }
  }
  for (const auto& st : tied) {
    for (const int32_t h : st.holders) {
      Instruction ins;
      ins.op = Op::kReduceTied;
      ins.payload = Payload::kTiedGrad;
      ins.value = st.group->id;
      emit(h, std::move(ins));
    }
  }
  return prog;
}

}  // namespace torchmpmd::schedule
