#include "schedule/simulate.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <set>

#include "schedule/machine.h"
#include "util/check.h"

namespace torchmpmd::schedule {

Timeline simulate(const Program& program, const Costs& costs) {
  costs.check(program.num_stages());
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
    tl.events.push_back(e);
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
      if (ins.op == Op::kCompute && info(ins.task.kind).recomputes) {
        recomputed.emplace(ins.task.stage, ins.task.microbatch);
      }
    }
  }

  // What a recomputed stage keeps from its forward to the end of its
  // backward: every activation it reads from another stage, received or
  // handed over on its own rank (skip connections included).
  std::vector<int64_t> kept_inputs(program.num_stages(), 0);
  for (const Edge& e : program.graph.edges) kept_inputs[e.dst] += e.bytes;

  size_t remaining = 0;
  for (const auto& l : program.ranks) remaining += l.size();
  while (remaining > 0) {
    // Advance the rank that can make progress earliest.
    int32_t best = -1;
    double best_time = std::numeric_limits<double>::infinity();
    for (int32_t r = 0; r < R; ++r) {
      if (pc[r] >= program.ranks[r].size()) continue;
      const Instruction& ins = program.ranks[r][pc[r]];
      std::optional<double> start = machine.clock(r);
      if (ins.op == Op::kCompute || ins.op == Op::kReduceTied ||
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
    const Instruction& ins = program.ranks[r][pc[r]++];
    --remaining;
    switch (ins.op) {
      case Op::kSend: {
        const Machine::Interval in_flight = machine.send(r, ins);
        Event e;
        e.kind = EventKind::kTransfer;
        e.rank = r;
        e.peer = ins.peer;
        e.label = to_string(ins);
        e.start = in_flight.start;
        e.end = in_flight.end;
        tl.events.push_back(e);
        break;
      }
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
        if (best_time > machine.clock(r)) {
          Event wait;
          wait.kind = EventKind::kWait;
          wait.rank = r;
          wait.task = ins.task;
          wait.start = machine.clock(r);
          wait.end = best_time;
          tl.events.push_back(wait);
        }
        const double end = machine.run(r, ins, best_time);
        if (ins.op == Op::kReduceTied) break;
        const Task& t = ins.task;
        // Forward-only programs keep no activations for a backward.
        if (!program.spec.forward_only) {
          const TaskKindInfo& kind = info(t.kind);
          const bool again = recomputed.count({t.stage, t.microbatch}) > 0;
          const MemoryEffect effect =
              again ? kind.memory_if_recomputed : kind.memory;
          const int64_t act = costs.activation_bytes[t.stage];
          const int64_t wbytes =
              std::min(costs.weight_grad_bytes[t.stage], act);
          live[r] += effect.activation * act + effect.weight_only * wbytes;
          if (again) {
            const int64_t in = kept_inputs[t.stage];
            if (t.kind == TaskKind::kForward) live[r] += in;
            if (kind.finishes_weight_grads) live[r] -= in;
          }
        }
        peaks(r);
        Event e;
        e.kind = EventKind::kCompute;
        e.rank = r;
        e.task = t;
        e.start = best_time;
        e.end = end;
        tl.events.push_back(e);
        break;
      }
    }
  }
  return tl;
}

}  // namespace torchmpmd::schedule
