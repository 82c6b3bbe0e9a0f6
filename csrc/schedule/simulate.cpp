#include "schedule/simulate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>

#include "schedule/machine.h"
#include "util/check.h"

namespace torchmpmd::schedule {

namespace {

// Per rank, per compute instruction in its order: the factor its cost is
// charged by (Costs::sharing).
using Scales = std::vector<std::vector<double>>;

Timeline simulate_once(const Program& program, const Costs& costs,
                       const Scales* scales) {
  const int32_t R = program.num_ranks();
  Timeline tl;
  tl.num_ranks = R;
  tl.peak_activation_bytes.assign(R, 0);
  tl.peak_bytes.assign(R, 0);
  Machine machine(R, costs);
  std::vector<size_t> pc(R, 0);
  std::vector<int64_t> live(R, 0);      // activations
  std::vector<int64_t> gathered(R, 0);  // unsharded parameters
  const auto collective = [&](int32_t r, const Instruction& ins, double start,
                              double end) {
    Event e;
    e.kind = EventKind::kCollective;
    e.rank = r;
    e.task.stage = ins.value;
    e.task.microbatch = -1;
    e.label = collective_name(ins.op);
    e.start = start;
    e.end = end;
    tl.events.push_back(std::move(e));
  };
  const auto peaks = [&](int32_t r) {
    tl.peak_activation_bytes[r] =
        std::max(tl.peak_activation_bytes[r], live[r]);
    tl.peak_bytes[r] = std::max(tl.peak_bytes[r], live[r] + gathered[r]);
  };

  // (stage, mb) whose forward keeps nothing for the backward: the schedule
  // rebuilds it with a recompute task.
  std::set<std::pair<int32_t, int32_t>> recomputed;
  for (const auto& code : program.ranks) {
    for (const Instruction& ins : code) {
      if (ins.op != Op::kCompute) continue;
      for (const Task& t : ins.task.simple_parts()) {
        if (info(t.kind).recomputes) recomputed.emplace(t.stage, t.microbatch);
      }
    }
  }

  // What a recomputed stage keeps from its forward to the end of its
  // backward: every activation it reads from another stage, received or
  // handed over on its own rank (skip connections included).
  std::vector<int64_t> kept_inputs(program.num_stages(), 0);
  for (const Edge& e : program.graph.edges) kept_inputs[e.dst] += e.bytes;

  // What a task (or part) does to the activation memory of its rank: the
  // table's memory effect; the peak after each part (a fused task's parts
  // run one after the other: a forward holds its activations before a
  // backward frees its own).
  const auto keep = [&](int32_t r, const Task& t) {
    // Forward-only programs keep no activations for a backward.
    if (!program.spec.forward_only) {
      const TaskKindInfo& kind = info(t.kind);
      const bool again = recomputed.count({t.stage, t.microbatch}) > 0;
      const MemoryEffect effect =
          again ? kind.memory_if_recomputed : kind.memory;
      const int64_t act = costs.activation_bytes[t.stage];
      // What I keeps for W may exceed what F kept: I adds the output
      // gradients W reads.
      const int64_t wbytes = costs.weight_grad_bytes[t.stage];
      live[r] += effect.activation * act + effect.weight_only * wbytes +
                 effect.kept_inputs * kept_inputs[t.stage];
    }
    peaks(r);
  };
  const auto send = [&](int32_t r, const Instruction& ins) {
    const Machine::Interval in_flight = machine.send(r, ins);
    Event e;
    e.kind = EventKind::kTransfer;
    e.rank = r;
    e.peer = ins.peer;
    e.label = to_string(ins);
    e.start = in_flight.start;
    e.end = in_flight.end;
    tl.events.push_back(std::move(e));
  };

  const auto wait = [&](int32_t r, const Task& t, double until) {
    if (until <= machine.clock(r)) return;
    Event e;
    e.kind = EventKind::kWait;
    e.rank = r;
    e.task = t;
    e.start = machine.clock(r);
    e.end = until;
    tl.events.push_back(std::move(e));
  };
  const auto compute = [&](int32_t r, const Task& t, double start, double end) {
    peaks(r);
    Event e;
    e.kind = EventKind::kCompute;
    e.rank = r;
    e.task = t;
    e.start = start;
    e.end = end;
    tl.events.push_back(std::move(e));
  };

  size_t remaining = 0;
  for (const auto& l : program.ranks) remaining += l.size();
  // A fused task without a measured time runs part by part, as the executor
  // runs it now (machine.h): per rank, the part it is at, where the task
  // started and the next of the sends after it. Each part starts once its
  // own inputs have arrived; its sends (Instruction::part) leave as it
  // ends. The task is one compute event, from its start to its last part's
  // end (a wait for a later part's inputs inside it).
  std::vector<size_t> part(R, 0);
  std::vector<double> fused_start(R, 0.0);
  std::vector<size_t> next_send(R, 0);
  std::vector<size_t> computes(R, 0);  // compute instructions begun
  const auto scale = [&](int32_t r) {
    return scales ? (*scales)[r].at(computes[r]) : 1.0;
  };
  const auto run_part = [&](int32_t r, double start) {
    const auto& code = program.ranks[r];
    const Instruction& ins = code[pc[r]];
    const size_t k = part[r];
    wait(r, ins.task, start);
    if (k == 0) {
      fused_start[r] = start;
      next_send[r] = pc[r] + 1;
    }
    const Task& piece = ins.task.parts[k];
    const double end = machine.run(r, piece, start, scale(r));
    keep(r, piece);
    while (next_send[r] < code.size() && code[next_send[r]].op == Op::kSend &&
           code[next_send[r]].part == static_cast<int32_t>(k)) {
      send(r, code[next_send[r]++]);
      --remaining;
    }
    if (k + 1 < ins.task.parts.size()) {
      part[r] = k + 1;
      return;
    }
    compute(r, ins.task, fused_start[r], end);
    ++computes[r];
    part[r] = 0;
    pc[r] = next_send[r];
    --remaining;
  };
  while (remaining > 0) {
    // Advance the rank that can make progress earliest.
    int32_t best = -1;
    double best_time = std::numeric_limits<double>::infinity();
    for (int32_t r = 0; r < R; ++r) {
      if (pc[r] >= program.ranks[r].size()) continue;
      const Instruction& ins = program.ranks[r][pc[r]];
      std::optional<double> start = machine.clock(r);
      if (ins.op == Op::kCompute && machine.runs_parts(ins.task)) {
        start = machine.ready(r, ins.task.parts[part[r]]);
      } else if (ins.op == Op::kCompute || ins.op == Op::kReduceTied ||
                 ins.op == Op::kUnshard) {
        start = machine.ready(r, ins);
      }
      if (start && *start < best_time) {
        best_time = *start;
        best = r;
      }
    }
    MPMD_CHECK(best >= 0,
               "schedule: the program cannot complete: every rank waits for "
               "a message no rank sends");
    const int32_t r = best;
    if (program.ranks[r][pc[r]].op == Op::kCompute &&
        machine.runs_parts(program.ranks[r][pc[r]].task)) {
      run_part(r, best_time);
      continue;
    }
    const Instruction& ins = program.ranks[r][pc[r]++];
    --remaining;
    switch (ins.op) {
      case Op::kSend:
        send(r, ins);
        break;
      case Op::kRecv:
        machine.post(r, ins);
        break;
      case Op::kUnshard: {
        const double end = machine.run(r, ins, best_time);
        gathered[r] += costs.unsharded_bytes_of(ins.value);
        peaks(r);
        collective(r, ins, best_time, end);
        break;
      }
      case Op::kReduceGrads: {
        // What the stage gathered is given back (resharded) as its
        // reduction starts.
        const Machine::Interval in_flight = machine.reduce_grads(r, ins);
        const auto& spec = program.spec.collectives;
        if (spec.at(ins.value).unshard) {
          gathered[r] -= costs.unsharded_bytes_of(ins.value);
        }
        collective(r, ins, in_flight.start, in_flight.end);
        break;
      }
      case Op::kCompute:
      case Op::kReduceTied: {
        wait(r, ins.task, best_time);
        if (ins.op == Op::kReduceTied) {
          machine.run(r, ins, best_time);
          break;
        }
        const double end = machine.run(r, ins, best_time, scale(r));
        ++computes[r];
        for (const Task& t : ins.task.simple_parts()) keep(r, t);
        compute(r, ins.task, best_time, end);
        break;
      }
    }
  }
  return tl;
}

// Per rank, per compute event in its order: the mean over its interval of
// the factor the ranks computing beside it give it (Costs::sharing).
Scales shares(const Timeline& tl, const Costs& costs) {
  std::vector<std::pair<double, int>> edges;  // (time, +1 start / -1 end)
  for (const Event& e : tl.events) {
    if (e.kind != EventKind::kCompute) continue;
    edges.emplace_back(e.start, 1);
    edges.emplace_back(e.end, -1);
  }
  std::sort(edges.begin(), edges.end());
  // The factor is piecewise constant between edges: its integral up to
  // each edge.
  std::vector<double> at;
  std::vector<double> integral;
  std::vector<double> factor;  // from at[i] to at[i + 1]
  int computing = 0;
  double sum = 0;
  for (size_t i = 0; i < edges.size(); ++i) {
    if (!at.empty()) sum += factor.back() * (edges[i].first - at.back());
    computing += edges[i].second;
    at.push_back(edges[i].first);
    integral.push_back(sum);
    factor.push_back(costs.sharing(std::max(computing, 1), tl.num_ranks));
  }
  const auto integral_to = [&](double t) {
    const size_t i = static_cast<size_t>(
        std::upper_bound(at.begin(), at.end(), t) - at.begin());
    if (i == 0) return 0.0;
    return integral[i - 1] + factor[i - 1] * (t - at[i - 1]);
  };
  Scales out(tl.num_ranks);
  for (const Event& e : tl.events) {
    if (e.kind != EventKind::kCompute) continue;
    const double span = e.end - e.start;
    // An empty task takes no time whatever its factor.
    out[e.rank].push_back(
        span > 0 ? (integral_to(e.end) - integral_to(e.start)) / span : 1.0);
  }
  return out;
}

}  // namespace

Timeline simulate(const Program& program, const Costs& given) {
  given.check(program.num_stages());
  const int32_t R = program.num_ranks();
  if (!given.shares_cores(R)) return simulate_once(program, given, nullptr);
  // Ranks sharing cores keep them all busy while as many compute as there
  // are cores: what one rank waits on a collective is another rank's
  // compute (its peer's, the collective's own threads), so running a fused
  // task's two sides at once hides nothing and the sides are charged one
  // after the other (on 4 ranks of 2 cores, fused DualPipeV measured
  // 0.975-1.006x unfused with the cores 91-94% busy; charged as overlapped,
  // 1.22-1.35x its prediction).
  Costs costs = given;
  costs.overlap_sides = false;
  // The ranks share cores: each compute's time depends on how many compute
  // beside it, which depends on the times. From every rank at work (the
  // times as measured), each compute is charged by the ranks computing
  // beside it in the last timeline until the charges settle, at most
  // kRounds rounds; where they swing back and forth, halfway each round.
  // They settle geometrically: a one-microbatch chain in two rounds,
  // 1F1B(16) on 4 ranks within 1e-3 after 5 and 2e-9 after the 16th.
  Scales scales(R);
  for (int32_t r = 0; r < R; ++r) {
    for (const Instruction& ins : program.ranks[r]) {
      if (ins.op == Op::kCompute) scales[r].push_back(1.0);
    }
  }
  constexpr int kRounds = 16;
  Timeline tl = simulate_once(program, costs, &scales);
  double step = 1.0;  // how far each round moves the charges
  double last_change = std::numeric_limits<double>::infinity();
  for (int round = 0; round < kRounds; ++round) {
    const Scales next = shares(tl, costs);
    double change = 0;
    for (int32_t r = 0; r < R; ++r) {
      for (size_t k = 0; k < scales[r].size(); ++k) {
        change = std::max(change, std::abs(next[r].at(k) - scales[r][k]));
      }
    }
    if (change < 1e-9) break;
    if (change >= last_change) step = 0.5;
    last_change = change;
    for (int32_t r = 0; r < R; ++r) {
      for (size_t k = 0; k < scales[r].size(); ++k) {
        scales[r][k] += step * (next[r][k] - scales[r][k]);
      }
    }
    tl = simulate_once(program, costs, &scales);
  }
  return tl;
}

}  // namespace torchmpmd::schedule
