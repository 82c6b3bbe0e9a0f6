#include "schedule/simulate.h"

#include <algorithm>
#include <limits>
#include <map>

#include "util/check.h"

namespace torchmpmd::schedule {

double Timeline::step_time() const {
  if (events.empty()) return 0;
  double lo = std::numeric_limits<double>::infinity();
  double hi = -lo;
  for (const Event& e : events) {
    lo = std::min(lo, e.start);
    hi = std::max(hi, e.end);
  }
  return hi - lo;
}

std::vector<double> Timeline::busy_time() const {
  std::vector<double> busy(num_ranks, 0.0);
  for (const Event& e : events) {
    if (e.kind == EventKind::kCompute && e.rank >= 0 && e.rank < num_ranks) {
      busy[e.rank] += e.end - e.start;
    }
  }
  return busy;
}

double Timeline::bubble_fraction() const {
  const double step = step_time();
  if (step <= 0 || num_ranks == 0) return 0;
  double busy = 0;
  for (const double b : busy_time()) busy += b;
  return 1.0 - busy / (step * num_ranks);
}

Timeline simulate(const Program& program, const Costs& costs) {
  costs.check(program.num_stages());
  const int32_t R = program.num_ranks();
  Timeline tl;
  tl.num_ranks = R;
  tl.peak_activation_bytes.assign(R, 0);

  // (src, dst, tag) -> arrival time, once the sender has issued it.
  std::map<std::tuple<int32_t, int32_t, int64_t>, double> arrival;
  std::map<std::pair<int32_t, int32_t>, double> link_free;
  std::vector<size_t> pc(R, 0);
  std::vector<double> clock(R, 0.0);
  std::vector<int64_t> live(R, 0);
  // Posted receives not yet consumed, per rank: instruction indices.
  std::vector<std::vector<size_t>> posted(R);

  const auto recv_arrival = [&](int32_t r, const Instruction& ins, double* at) {
    const auto it = arrival.find({ins.peer, r, ins.tag});
    if (it == arrival.end()) return false;
    *at = it->second;
    return true;
  };

  size_t remaining = 0;
  for (const auto& l : program.ranks) remaining += l.size();
  while (remaining > 0) {
    // Advance the rank that can make progress earliest.
    int32_t best = -1;
    double best_time = std::numeric_limits<double>::infinity();
    for (int32_t r = 0; r < R; ++r) {
      if (pc[r] >= program.ranks[r].size()) continue;
      const Instruction& ins = program.ranks[r][pc[r]];
      double start = clock[r];
      bool ok = true;
      if (ins.op == Op::kCompute || ins.op == Op::kReduceTied) {
        for (const size_t i : posted[r]) {
          const Instruction& recv = program.ranks[r][i];
          if (!reads(ins, recv)) continue;
          double at = 0;
          if (!recv_arrival(r, recv, &at)) {
            ok = false;
            break;
          }
          start = std::max(start, at);
        }
      }
      if (ok && start < best_time) {
        best_time = start;
        best = r;
      }
    }
    MPMD_CHECK(best >= 0,
               "schedule: the program cannot complete: every rank waits for "
               "a message no rank sends");
    const int32_t r = best;
    const size_t i = pc[r]++;
    --remaining;
    const Instruction& ins = program.ranks[r][i];
    switch (ins.op) {
      case Op::kSend: {
        auto& free_at = link_free[{r, ins.peer}];
        const double start = std::max(clock[r], free_at);
        const double wire =
            costs.bytes_per_unit > 0 ? ins.bytes / costs.bytes_per_unit : 0.0;
        free_at = start + wire;
        const double arrive = start + wire + costs.latency;
        arrival[{r, ins.peer, ins.tag}] = arrive;
        Event e;
        e.kind = EventKind::kTransfer;
        e.rank = r;
        e.peer = ins.peer;
        e.label = to_string(ins);
        e.start = start;
        e.end = arrive;
        tl.events.push_back(e);
        if (!costs.overlap_comm) clock[r] = start + wire;
        break;
      }
      case Op::kRecv:
        posted[r].push_back(i);
        break;
      case Op::kCompute:
      case Op::kReduceTied: {
        if (best_time > clock[r]) {
          Event wait;
          wait.kind = EventKind::kWait;
          wait.rank = r;
          wait.task = ins.task;
          wait.start = clock[r];
          wait.end = best_time;
          tl.events.push_back(wait);
        }
        // Consumed receives are no longer pending.
        auto& pend = posted[r];
        pend.erase(std::remove_if(pend.begin(), pend.end(),
                                  [&](size_t j) {
                                    return reads(ins, program.ranks[r][j]);
                                  }),
                   pend.end());
        if (ins.op == Op::kReduceTied) {
          clock[r] = best_time;
          break;
        }
        const Task& t = ins.task;
        const double end = best_time + costs.of(t);
        const int64_t act = costs.activation_bytes[t.stage];
        const int64_t wbytes = std::min(costs.weight_grad_bytes[t.stage], act);
        // Forward-only programs keep no activations for a backward.
        if (!program.spec.forward_only) {
          switch (t.kind) {
            case TaskKind::kForward:
              live[r] += act;
              break;
            case TaskKind::kBackward:
              live[r] -= act;
              break;
            case TaskKind::kInputGrad:
              live[r] -= act - wbytes;
              break;
            case TaskKind::kWeightGrad:
              live[r] -= wbytes;
              break;
          }
        }
        tl.peak_activation_bytes[r] =
            std::max(tl.peak_activation_bytes[r], live[r]);
        Event e;
        e.kind = EventKind::kCompute;
        e.rank = r;
        e.task = t;
        e.start = best_time;
        e.end = end;
        tl.events.push_back(e);
        clock[r] = end;
        break;
      }
    }
  }
  return tl;
}

}  // namespace torchmpmd::schedule
