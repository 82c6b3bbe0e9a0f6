#include "schedule/program.h"

#include <algorithm>
#include <limits>
#include <map>
#include <set>

#include "util/check.h"

namespace torchmpmd::schedule {

namespace {

constexpr int kKinds = 4;

int kind_index(TaskKind kind) { return static_cast<int>(kind); }

// Dense index over (stage, microbatch, kind).
struct TaskIndex {
  int32_t num_stages = 0;
  int32_t num_microbatches = 0;
  size_t size() const {
    return static_cast<size_t>(num_stages) * num_microbatches * kKinds;
  }
  size_t operator()(const Task& t) const {
    return (static_cast<size_t>(t.stage) * num_microbatches + t.microbatch) *
               kKinds +
           kind_index(t.kind);
  }
};

struct Position {
  int32_t rank = -1;
  int32_t index = -1;
  bool present() const { return rank >= 0; }
};

// Where every task of a schedule sits, after the structural checks.
struct Located {
  TaskIndex index;
  std::vector<Position> where;
  const Position& at(const Task& t) const { return where[index(t)]; }
  bool has(const Task& t) const { return at(t).present(); }
};

std::string grid_for(const ScheduleSpec& spec,
                     std::vector<std::pair<int32_t, int32_t>> marks) {
  return "\n" + render_grid(spec, marks);
}

// The backward-type task of (stage, mb) that produces input gradients: B if
// the schedule has one, else I.
Task grad_producer(const Located& loc, int32_t stage, int32_t mb) {
  Task b{TaskKind::kBackward, stage, mb};
  if (loc.has(b)) return b;
  return Task{TaskKind::kInputGrad, stage, mb};
}

// Consumer stages of each value, per producing stage.
struct Flow {
  // value -> consumer stages (ascending)
  std::map<int32_t, std::vector<int32_t>> consumers;
  // value -> producer stage
  std::map<int32_t, int32_t> producer;
  std::map<int32_t, bool> requires_grad;
  std::map<int32_t, int64_t> bytes;
  // stage -> values it produces for other stages (ascending)
  std::vector<std::vector<int32_t>> produces;
  // stage -> values it reads from other stages (ascending)
  std::vector<std::vector<int32_t>> reads;

  explicit Flow(const PipelineGraph& g)
      : produces(g.num_stages), reads(g.num_stages) {
    for (const Edge& e : g.edges) {
      consumers[e.value].push_back(e.dst);
      producer[e.value] = e.src;
      requires_grad[e.value] = e.requires_grad;
      bytes[e.value] = e.bytes;
      reads[e.dst].push_back(e.value);
    }
    for (auto& [value, stages] : consumers) {
      std::sort(stages.begin(), stages.end());
      produces[producer[value]].push_back(value);
    }
    for (auto& r : reads) std::sort(r.begin(), r.end());
  }
};

// Tasks that must finish before `t` can start.
std::vector<Task> dependencies(const Task& t, const Flow& flow,
                               const Located& loc, bool forward_only) {
  std::vector<Task> deps;
  switch (t.kind) {
    case TaskKind::kForward:
      for (const int32_t v : flow.reads[t.stage]) {
        deps.push_back({TaskKind::kForward, flow.producer.at(v), t.microbatch});
      }
      break;
    case TaskKind::kBackward:
    case TaskKind::kInputGrad:
      deps.push_back({TaskKind::kForward, t.stage, t.microbatch});
      if (forward_only) break;
      for (const int32_t v : flow.produces[t.stage]) {
        if (!flow.requires_grad.at(v)) continue;
        for (const int32_t c : flow.consumers.at(v)) {
          deps.push_back(grad_producer(loc, c, t.microbatch));
        }
      }
      break;
    case TaskKind::kWeightGrad:
      deps.push_back({TaskKind::kInputGrad, t.stage, t.microbatch});
      break;
  }
  std::sort(deps.begin(), deps.end());
  deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
  return deps;
}

Located locate(const PipelineGraph& graph, const ScheduleSpec& spec) {
  const int32_t S = graph.num_stages;
  const int32_t M = spec.num_microbatches;
  const int32_t R = spec.num_ranks;
  MPMD_CHECK(R > 0, "schedule: num_ranks must be positive, got ", R);
  MPMD_CHECK(M > 0, "schedule: num_microbatches must be positive, got ", M);
  MPMD_CHECK(static_cast<int32_t>(spec.placement.size()) == S,
             "schedule: the placement has ", spec.placement.size(),
             " entries but the pipeline has ", S,
             " stages; give one rank per stage");
  MPMD_CHECK(static_cast<int32_t>(spec.tasks.size()) == R,
             "schedule: got task lists for ", spec.tasks.size(),
             " ranks but num_ranks is ", R);
  std::vector<int32_t> stages_on(R, 0);
  for (int32_t s = 0; s < S; ++s) {
    const int32_t r = spec.placement[s];
    MPMD_CHECK(r >= 0 && r < R, "schedule: the placement puts stage ", s,
               " on rank ", r, ", but there are only ", R, " ranks");
    ++stages_on[r];
  }
  for (int32_t r = 0; r < R; ++r) {
    MPMD_CHECK(stages_on[r] > 0, "schedule: rank ", r,
               " holds no stage; use at most as many ranks as stages (", S,
               ")");
  }

  Located loc;
  loc.index = {S, M};
  loc.where.assign(loc.index.size(), Position{});
  for (int32_t r = 0; r < R; ++r) {
    const auto& list = spec.tasks[r];
    for (int32_t i = 0; i < static_cast<int32_t>(list.size()); ++i) {
      const Task& t = list[i];
      MPMD_CHECK(t.stage >= 0 && t.stage < S, "schedule: rank ", r,
                 " position ", i, ": task ", to_string(t),
                 " names a stage outside 0..", S - 1, grid_for(spec, {{r, i}}));
      MPMD_CHECK(t.microbatch >= 0 && t.microbatch < M, "schedule: rank ", r,
                 " position ", i, ": task ", to_string(t),
                 " names a microbatch outside 0..", M - 1,
                 grid_for(spec, {{r, i}}));
      MPMD_CHECK(!spec.forward_only || t.kind == TaskKind::kForward,
                 "schedule: rank ", r, " position ", i, ": task ", to_string(t),
                 " in a forward-only program", grid_for(spec, {{r, i}}));
      MPMD_CHECK(spec.placement[t.stage] == r, "schedule: task ", to_string(t),
                 " is on rank ", r, ", but stage ", t.stage,
                 " is placed on rank ", spec.placement[t.stage],
                 ": all tasks of a stage run on the rank that holds it",
                 grid_for(spec, {{r, i}}));
      Position& slot = loc.where[loc.index(t)];
      MPMD_CHECK(!slot.present(), "schedule: task ", to_string(t),
                 " appears twice (rank ", slot.rank, " position ", slot.index,
                 " and rank ", r, " position ", i, ")",
                 grid_for(spec, {{slot.rank, slot.index}, {r, i}}));
      slot = {r, i};
    }
  }

  for (int32_t s = 0; s < S; ++s) {
    for (int32_t m = 0; m < M; ++m) {
      const Task f{TaskKind::kForward, s, m};
      const Task b{TaskKind::kBackward, s, m};
      const Task in{TaskKind::kInputGrad, s, m};
      const Task w{TaskKind::kWeightGrad, s, m};
      const int32_t r = spec.placement[s];
      MPMD_CHECK(loc.has(f), "schedule: task ", to_string(f),
                 " is missing: rank ", r, " must run it", grid_for(spec, {}));
      if (spec.forward_only) continue;
      MPMD_CHECK(!(loc.has(b) && (loc.has(in) || loc.has(w))),
                 "schedule: stage ", s, " microbatch ", m,
                 " has both a full backward ", to_string(b),
                 " and a split one (I/W); use one or the other",
                 grid_for(spec, {{loc.at(b).rank, loc.at(b).index}}));
      MPMD_CHECK(loc.has(b) || (loc.has(in) && loc.has(w)), "schedule: stage ",
                 s, " microbatch ", m, " has ",
                 loc.has(in)  ? "I but no W"
                 : loc.has(w) ? "W but no I"
                              : "no backward",
                 ": rank ", r, " must run ", to_string(b), " or both ",
                 to_string(in), " and ", to_string(w), grid_for(spec, {}));
    }
  }
  return loc;
}

int64_t pair_key(int32_t a, int32_t b) {
  return static_cast<int64_t>(std::min(a, b)) * (1LL << 31) + std::max(a, b);
}

}  // namespace

// --------------------------------------------------------------------------
// PipelineGraph

PipelineGraph PipelineGraph::from_plan(const graph::StagePlan& plan) {
  PipelineGraph g;
  g.num_stages = plan.num_stages;
  for (const auto& t : plan.transfers) {
    for (const int32_t dst : t.dst_stages) {
      g.edges.push_back({t.value, t.src_stage, dst, t.bytes, t.requires_grad});
    }
  }
  for (const auto& t : plan.tied) {
    g.tied.push_back({t.node, t.stages, 0});
  }
  g.finalize();
  return g;
}

PipelineGraph PipelineGraph::chain(int32_t num_stages, int64_t bytes) {
  PipelineGraph g;
  g.num_stages = num_stages;
  for (int32_t s = 0; s + 1 < num_stages; ++s) {
    g.edges.push_back({s, s, s + 1, bytes, true});
  }
  g.finalize();
  return g;
}

void PipelineGraph::finalize() {
  MPMD_CHECK(num_stages > 0, "schedule: a pipeline needs at least one stage");
  std::sort(edges.begin(), edges.end(), [](const Edge& a, const Edge& b) {
    return std::tie(a.value, a.dst) < std::tie(b.value, b.dst);
  });
  std::map<int32_t, const Edge*> first;
  for (size_t i = 0; i < edges.size(); ++i) {
    const Edge& e = edges[i];
    MPMD_CHECK(
        e.src >= 0 && e.src < num_stages && e.dst >= 0 && e.dst < num_stages,
        "schedule: value ", e.value, " flows from stage ", e.src, " to stage ",
        e.dst, ", outside 0..", num_stages - 1);
    MPMD_CHECK(e.src < e.dst, "schedule: value ", e.value, " flows from stage ",
               e.src, " back to stage ", e.dst);
    MPMD_CHECK(
        i == 0 || edges[i - 1].value != e.value || edges[i - 1].dst != e.dst,
        "schedule: value ", e.value, " reaches stage ", e.dst, " twice");
    const auto [it, inserted] = first.emplace(e.value, &e);
    MPMD_CHECK(inserted || (it->second->src == e.src &&
                            it->second->requires_grad == e.requires_grad),
               "schedule: value ", e.value,
               " has inconsistent producers or gradient flags");
  }
  in_edges.assign(num_stages, {});
  out_edges.assign(num_stages, {});
  for (size_t i = 0; i < edges.size(); ++i) {
    in_edges[edges[i].dst].push_back(static_cast<int32_t>(i));
    out_edges[edges[i].src].push_back(static_cast<int32_t>(i));
  }
  for (auto& t : tied) {
    std::sort(t.stages.begin(), t.stages.end());
    for (const int32_t s : t.stages) {
      MPMD_CHECK(s >= 0 && s < num_stages, "schedule: tied parameter ", t.id,
                 " names stage ", s, ", outside 0..", num_stages - 1);
    }
  }
}

// --------------------------------------------------------------------------
// Costs

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
  switch (task.kind) {
    case TaskKind::kForward:
      return forward.at(task.stage);
    case TaskKind::kBackward:
      return backward.at(task.stage);
    case TaskKind::kInputGrad:
      return input_grad.at(task.stage);
    case TaskKind::kWeightGrad:
      return weight_grad.at(task.stage);
  }
  return 0;
}

double Costs::transfer_time(int64_t bytes) const {
  return latency + (bytes_per_unit > 0 ? bytes / bytes_per_unit : 0.0);
}

// --------------------------------------------------------------------------
// Rendering

std::string render_grid(const ScheduleSpec& spec,
                        const std::vector<std::pair<int32_t, int32_t>>& marks) {
  std::string out;
  const std::set<std::pair<int32_t, int32_t>> marked(marks.begin(),
                                                     marks.end());
  for (int32_t r = 0; r < static_cast<int32_t>(spec.tasks.size()); ++r) {
    out += "  rank " + std::to_string(r) + ":";
    const auto& list = spec.tasks[r];
    for (int32_t i = 0; i < static_cast<int32_t>(list.size()); ++i) {
      const std::string a = to_action(list[i]);
      out += marked.count({r, i}) ? " [" + a + "]" : " " + a;
    }
    if (marked.count({r, static_cast<int32_t>(list.size())})) out += " [end]";
    out += "\n";
  }
  return out;
}

std::string to_string(const Instruction& ins) {
  const char* what = ins.payload == Payload::kActivation ? "act"
                     : ins.payload == Payload::kGrad     ? "grad"
                                                         : "tied";
  switch (ins.op) {
    case Op::kCompute:
      return to_action(ins.task);
    case Op::kSend:
      return detail::str_cat("SEND_", what, "(v", ins.value, " mb",
                             ins.microbatch, " ->r", ins.peer, " #", ins.tag,
                             ")");
    case Op::kRecv:
      return detail::str_cat("RECV_", what, "(v", ins.value, " mb",
                             ins.microbatch, " <-r", ins.peer, " #", ins.tag,
                             ")");
    case Op::kReduceTied:
      return detail::str_cat("REDUCE_tied(p", ins.value, ")");
  }
  return "?";
}

bool reads(const Instruction& user, const Instruction& recv) {
  if (recv.op != Op::kRecv) return false;
  if (user.op == Op::kReduceTied) {
    return recv.payload == Payload::kTiedGrad && recv.value == user.value;
  }
  if (user.op != Op::kCompute || recv.microbatch != user.task.microbatch) {
    return false;
  }
  const Task& t = user.task;
  switch (recv.payload) {
    case Payload::kActivation:
      return t.kind == TaskKind::kForward &&
             std::find(recv.stages.begin(), recv.stages.end(), t.stage) !=
                 recv.stages.end();
    case Payload::kGrad:
      return (t.kind == TaskKind::kBackward ||
              t.kind == TaskKind::kInputGrad) &&
             recv.src_stage == t.stage;
    case Payload::kTiedGrad:
      break;
  }
  return false;
}

// --------------------------------------------------------------------------
// Validation

void validate(const PipelineGraph& graph, const ScheduleSpec& spec) {
  const Located loc = locate(graph, spec);
  const Flow flow(graph);
  for (int32_t r = 0; r < spec.num_ranks; ++r) {
    const auto& list = spec.tasks[r];
    for (int32_t i = 0; i < static_cast<int32_t>(list.size()); ++i) {
      for (const Task& dep :
           dependencies(list[i], flow, loc, spec.forward_only)) {
        const Position& p = loc.at(dep);
        MPMD_CHECK(p.present(), "schedule: ", to_string(list[i]),
                   " depends on ", to_string(dep), ", which no rank runs",
                   grid_for(spec, {{r, i}}));
        MPMD_CHECK(p.rank != r || p.index < i, "schedule: rank ", r, " runs ",
                   to_string(list[i]), " (position ", i, ") before ",
                   to_string(dep), " (position ", p.index,
                   "), which it depends on",
                   grid_for(spec, {{r, i}, {r, p.index}}));
      }
    }
  }
}

// --------------------------------------------------------------------------
// Lowering

Program lower(const PipelineGraph& graph, const ScheduleSpec& spec,
              const Costs& costs) {
  validate(graph, spec);
  costs.check(graph.num_stages);
  const Located loc = locate(graph, spec);
  const Flow flow(graph);
  const int32_t R = spec.num_ranks;
  const int32_t M = spec.num_microbatches;
  const auto rank_of = [&](int32_t stage) { return spec.placement[stage]; };

  Program prog;
  prog.spec = spec;
  prog.graph = graph;
  prog.ranks.assign(R, {});
  std::map<int64_t, int64_t> pair_tags;
  const auto emit = [&](int32_t rank, Instruction ins) {
    prog.order.emplace_back(rank,
                            static_cast<int32_t>(prog.ranks[rank].size()));
    prog.ranks[rank].push_back(std::move(ins));
  };
  const auto message = [&](int32_t from, int32_t to, Instruction ins) {
    ins.tag = pair_tags[pair_key(from, to)]++;
    Instruction recv = ins;
    ins.op = Op::kSend;
    ins.peer = to;
    recv.op = Op::kRecv;
    recv.peer = from;
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

  std::vector<double> done(loc.index.size(), -1.0);
  std::vector<int32_t> pos(R, 0);
  std::vector<double> clock(R, 0.0);
  // (value, mb, rank) -> backward tasks of local consumers still to run.
  std::map<std::tuple<int32_t, int32_t, int32_t>, int32_t> grads_pending;

  const auto ready_time = [&](const Task& t, int32_t rank, double* ready) {
    double at = 0;
    for (const Task& dep : dependencies(t, flow, loc, spec.forward_only)) {
      const double d = done[loc.index(dep)];
      if (d < 0) return false;
      double arrive = d;
      if (rank_of(dep.stage) != rank) {
        int64_t bytes = 0;
        if (dep.kind == TaskKind::kForward) {
          for (const int32_t v : flow.reads[t.stage]) {
            if (flow.producer.at(v) == dep.stage) bytes += flow.bytes.at(v);
          }
        } else {
          for (const int32_t v : flow.reads[dep.stage]) {
            if (flow.producer.at(v) == t.stage) bytes += flow.bytes.at(v);
          }
        }
        arrive += costs.transfer_time(bytes);
      }
      at = std::max(at, arrive);
    }
    *ready = at;
    return true;
  };

  size_t total = 0;
  for (const auto& l : spec.tasks) total += l.size();
  for (size_t step = 0; step < total; ++step) {
    int32_t best = -1;
    double best_start = std::numeric_limits<double>::infinity();
    for (int32_t r = 0; r < R; ++r) {
      if (pos[r] >= static_cast<int32_t>(spec.tasks[r].size())) continue;
      double ready = 0;
      if (!ready_time(spec.tasks[r][pos[r]], r, &ready)) continue;
      const double start = std::max(clock[r], ready);
      if (start < best_start) {
        best_start = start;
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
        for (const Task& dep : dependencies(t, flow, loc, spec.forward_only)) {
          if (done[loc.index(dep)] >= 0) continue;
          const Position& p = loc.at(dep);
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
    const double end = best_start + costs.of(t);
    clock[r] = end;
    done[loc.index(t)] = end;
    Instruction compute;
    compute.op = Op::kCompute;
    compute.task = t;
    emit(r, compute);
    ++pos[r];

    if (t.kind == TaskKind::kForward) {
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
    if ((t.kind == TaskKind::kBackward || t.kind == TaskKind::kInputGrad) &&
        !spec.forward_only) {
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
    if (t.kind == TaskKind::kBackward || t.kind == TaskKind::kWeightGrad) {
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
