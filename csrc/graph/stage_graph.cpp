#include "graph/stage_graph.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <unordered_set>

#include "util/check.h"

namespace torchmpmd::graph {

namespace {

// "layers.0@1" -> {"layers.0", 1}; "layers.0" -> {"layers.0", 0}.
std::pair<std::string, int> split_call(const std::string& entry) {
  const auto at = entry.rfind('@');
  if (at == std::string::npos || at + 1 == entry.size()) {
    return {entry, 0};
  }
  for (size_t i = at + 1; i < entry.size(); ++i) {
    if (entry[i] < '0' || entry[i] > '9') {
      return {entry, 0};
    }
  }
  return {entry.substr(0, at), std::stoi(entry.substr(at + 1))};
}

std::string describe(const Node& node) {
  std::string out = "'" + node.name + "' (" + node.target;
  const std::string path = node.module_path();
  out += path.empty() ? " in the root module)" : " in module '" + path + "')";
  return out;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  std::iota(row.begin(), row.end(), 0);
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min(
          {row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string suggest(const std::string& path,
                    const std::vector<std::string>& known) {
  std::vector<std::pair<size_t, std::string>> scored;
  for (const auto& k : known) {
    if (!k.empty()) {
      scored.emplace_back(edit_distance(path, k), k);
    }
  }
  std::sort(scored.begin(), scored.end());
  std::string out;
  for (size_t i = 0; i < scored.size() && i < 3; ++i) {
    out += (i ? ", '" : "'") + scored[i].second + "'";
  }
  return out.empty() ? "" : " Closest module paths: " + out + ".";
}

const char* mode_name(SplitMode mode) {
  switch (mode) {
    case SplitMode::kBefore:
      return "split_before";
    case SplitMode::kAfter:
      return "split_after";
    case SplitMode::kMarkers:
      break;
  }
  return "mark_stage_end";
}

std::string ordinal(size_t n) {
  const char* suffix = "th";
  if (n % 100 < 11 || n % 100 > 13) {
    suffix = n % 10 == 1   ? "st"
             : n % 10 == 2 ? "nd"
             : n % 10 == 3 ? "rd"
                           : "th";
  }
  return std::to_string(n) + suffix;
}

struct Boundaries {
  std::vector<int32_t> position;   // node id where stage k+1 begins
  std::vector<std::string> label;  // how the user wrote boundary k
};

Boundaries module_boundaries(const StageGraph& graph, const SplitSpec& spec) {
  const char* mode = mode_name(spec.mode);
  const std::unordered_set<std::string> known(spec.module_paths.begin(),
                                              spec.module_paths.end());
  Boundaries out;
  std::set<std::string> seen;
  for (const auto& point : spec.points) {
    MPMD_CHECK(!point.empty(), "graph: ", mode,
               " names the root module (''); split at one of its submodules");
    MPMD_CHECK(seen.insert(point).second, "graph: ", mode, " lists '", point,
               "' twice; name each split point once");
    MPMD_CHECK(known.count(point), "graph: ", mode, " names '", point,
               "', which is not a module of the model.",
               suggest(point, spec.module_paths));
    int32_t first = -1;
    int32_t last = -1;
    std::map<int, int32_t> calls;  // call index -> first node of that call
    for (size_t i = 0; i < graph.nodes.size(); ++i) {
      for (const auto& entry : graph.nodes[i].module_stack) {
        const auto [path, call] = split_call(entry);
        if (path == point) {
          if (first < 0) {
            first = static_cast<int32_t>(i);
          }
          last = static_cast<int32_t>(i);
          calls.emplace(call, static_cast<int32_t>(i));
          break;
        }
      }
    }
    MPMD_CHECK(first >= 0, "graph: ", mode, " names module '", point,
               "', but it never ran in the traced forward (no operation was "
               "recorded inside it): split at a module that runs, or check "
               "the example inputs");
    if (calls.size() > 1) {
      std::string where;
      for (const auto& [call, node] : calls) {
        where += (where.empty() ? "'" : ", '") + graph.nodes[node].name + "'";
      }
      MPMD_CHECK(false, "graph: ", mode, " names module '", point,
                 "', which runs ", calls.size(),
                 " times in one forward (calls starting at nodes ", where,
                 "); a stage boundary must be a module that runs once: pick "
                 "another module, or call mpmd.mark_stage_end(x) in the model "
                 "where the stage should end");
    }
    out.position.push_back(spec.mode == SplitMode::kBefore ? first : last + 1);
    out.label.push_back(std::string(mode) + " '" + point + "'");
  }
  return out;
}

Boundaries marker_boundaries(const StageGraph& graph, const SplitSpec& spec) {
  Boundaries out;
  for (size_t k = 0; k < spec.marker_positions.size(); ++k) {
    const int32_t pos = spec.marker_positions[k];
    MPMD_INTERNAL_ASSERT(
        pos >= 0 && pos <= static_cast<int32_t>(graph.nodes.size()),
        "marker position ", pos);
    MPMD_INTERNAL_ASSERT(k == 0 || spec.marker_positions[k - 1] <= pos,
                         "marker positions must be ascending");
    out.position.push_back(pos);
    std::string label = "the " + ordinal(k + 1) + " mark_stage_end call";
    if (pos < static_cast<int32_t>(graph.nodes.size())) {
      label += " (before node '" + graph.nodes[pos].name + "')";
    }
    out.label.push_back(label);
  }
  return out;
}

std::string empty_stage_message(int32_t stage, const Boundaries& b) {
  const auto num_stages = static_cast<int32_t>(b.position.size()) + 1;
  std::string out = "graph: stage " + std::to_string(stage) + " of " +
                    std::to_string(num_stages) +
                    " is empty: no operation runs ";
  if (stage == 0) {
    out += "before " + b.label[0];
  } else if (stage == num_stages - 1) {
    out += "after " + b.label[stage - 1];
  } else {
    out += "between " + b.label[stage - 1] + " and " + b.label[stage];
  }
  return out +
         "; move or remove a split point so that every stage computes "
         "something";
}

}  // namespace

const char* to_string(NodeKind kind) {
  switch (kind) {
    case NodeKind::kInput:
      return "input";
    case NodeKind::kParameter:
      return "parameter";
    case NodeKind::kBuffer:
      return "buffer";
    case NodeKind::kCompute:
      break;
  }
  return "compute";
}

std::string Node::module_path() const {
  return module_stack.empty() ? "" : split_call(module_stack.back()).first;
}

int32_t StageGraph::add_node(Node node) {
  const auto id = static_cast<int32_t>(nodes.size());
  MPMD_CHECK(!node.name.empty(), "graph: node ", id, " has no name");
  for (const int32_t in : node.inputs) {
    MPMD_CHECK(in >= 0 && in < id, "graph: node '", node.name, "' reads node ",
               in,
               ", which does not precede it; nodes must be added in "
               "topological order");
  }
  MPMD_CHECK(!node.attached || node.inputs.size() == 1, "graph: node '",
             node.name, "' is attached to its producer but reads ",
             node.inputs.size(), " nodes");
  nodes.push_back(std::move(node));
  return id;
}

const Transfer* StagePlan::find_transfer(int32_t value) const {
  const auto it = std::lower_bound(
      transfers.begin(), transfers.end(), value,
      [](const Transfer& t, int32_t v) { return t.value < v; });
  return it != transfers.end() && it->value == value ? &*it : nullptr;
}

StagePlan partition(const StageGraph& graph, const SplitSpec& spec) {
  const auto& nodes = graph.nodes;
  const auto n = static_cast<int32_t>(nodes.size());
  std::set<std::string> names;
  for (const auto& node : nodes) {
    MPMD_CHECK(names.insert(node.name).second, "graph: two nodes are named '",
               node.name, "'");
  }
  for (const int32_t out : graph.outputs) {
    MPMD_CHECK(out >= 0 && out < n, "graph: output refers to node ", out,
               ", which does not exist");
  }

  const Boundaries bounds = spec.mode == SplitMode::kMarkers
                                ? marker_boundaries(graph, spec)
                                : module_boundaries(graph, spec);
  StagePlan plan;
  plan.num_stages = static_cast<int32_t>(bounds.position.size()) + 1;
  const int32_t last_stage = plan.num_stages - 1;

  // Positional stage: the most recent boundary passed in program order. With
  // split points out of execution order this makes later stages run first,
  // which the dataflow check below reports.
  std::vector<int32_t> order(bounds.position.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return bounds.position[a] < bounds.position[b];
  });
  std::vector<int32_t> positional(n, 0);
  {
    size_t next = 0;
    int32_t current = 0;
    for (int32_t i = 0; i < n; ++i) {
      while (next < order.size() && bounds.position[order[next]] <= i) {
        current = order[next++] + 1;
      }
      positional[i] = current;
    }
  }

  // Which values require grad, and which compute nodes are "free": a pure
  // function of inputs, buffers and constants that every stage can
  // recompute instead of receiving.
  plan.requires_grad.assign(n, false);
  std::vector<bool> free(n, false);
  for (int32_t i = 0; i < n; ++i) {
    const Node& node = nodes[i];
    switch (node.kind) {
      case NodeKind::kInput:
      case NodeKind::kParameter:
        plan.requires_grad[i] = node.differentiable;
        break;
      case NodeKind::kBuffer:
        break;
      case NodeKind::kCompute: {
        bool any_grad = false;
        bool all_free = true;
        for (const int32_t in : node.inputs) {
          any_grad = any_grad || plan.requires_grad[in];
          const NodeKind k = nodes[in].kind;
          const bool in_free =
              k == NodeKind::kCompute
                  ? free[in]
                  : !plan.requires_grad[in] && k != NodeKind::kParameter;
          all_free = all_free && in_free;
        }
        plan.requires_grad[i] = node.differentiable && any_grad;
        free[i] = node.attached
                      ? free[node.inputs[0]]
                      : node.replicable && all_free && !plan.requires_grad[i];
        break;
      }
    }
  }

  // Home stage of every non-free compute node.
  std::vector<int32_t> home(n, -1);
  std::vector<int32_t> stage_size(plan.num_stages, 0);
  for (int32_t i = 0; i < n; ++i) {
    const Node& node = nodes[i];
    if (node.kind != NodeKind::kCompute || free[i]) {
      continue;
    }
    if (node.attached) {
      const int32_t producer = node.inputs[0];
      MPMD_INTERNAL_ASSERT(home[producer] >= 0, "node ", node.name,
                           " is attached to a node without a stage");
      home[i] = home[producer];
    } else {
      home[i] = positional[i];
      ++stage_size[home[i]];
    }
  }
  for (int32_t s = 0; s < plan.num_stages; ++s) {
    MPMD_CHECK(stage_size[s] > 0, empty_stage_message(s, bounds));
  }

  // Stages that need each node. A free node is recomputed by every stage
  // that needs it, so its own inputs are needed there too.
  std::vector<std::vector<int32_t>> need(n);
  struct Use {
    int32_t value;
    int32_t stage;
    int32_t consumer;  // the non-free node (or -1: model output) that needs it
  };
  std::vector<Use> work;
  const auto require = [&](int32_t value, int32_t stage, int32_t consumer) {
    work.push_back({value, stage, consumer});
    while (!work.empty()) {
      const Use use = work.back();
      work.pop_back();
      auto& stages = need[use.value];
      if (std::find(stages.begin(), stages.end(), use.stage) != stages.end()) {
        continue;
      }
      stages.push_back(use.stage);
      const Node& node = nodes[use.value];
      if (node.kind != NodeKind::kCompute) {
        continue;
      }
      if (free[use.value]) {
        for (const int32_t in : node.inputs) {
          work.push_back({in, use.stage, use.consumer});
        }
        continue;
      }
      if (home[use.value] > use.stage) {
        const std::string who = use.consumer < 0
                                    ? std::string("the model's output")
                                    : "node " + describe(nodes[use.consumer]);
        MPMD_CHECK(false, "graph: ", who, " in stage ", use.stage, " uses ",
                   describe(node), ", which stage ", home[use.value],
                   " computes: values must flow from earlier stages to later "
                   "ones. List split points in the order the model runs "
                   "them, and do not call a module of one stage again from "
                   "another");
      }
    }
  };
  for (int32_t i = 0; i < n; ++i) {
    if (home[i] >= 0) {
      need[i].push_back(home[i]);
      for (const int32_t in : nodes[i].inputs) {
        require(in, home[i], i);
      }
    }
  }
  for (const int32_t out : graph.outputs) {
    require(out, last_stage, -1);
  }
  plan.buffer_updates.resize(plan.num_stages);
  for (const auto& update : graph.buffer_updates) {
    MPMD_CHECK(update.buffer >= 0 && update.buffer < n &&
                   nodes[update.buffer].kind == NodeKind::kBuffer,
               "graph: a buffer update names node ", update.buffer,
               ", which is not a buffer");
    MPMD_CHECK(update.value >= 0 && update.value < n,
               "graph: the update of buffer '", nodes[update.buffer].target,
               "' names node ", update.value, ", which does not exist");
    const int32_t stage =
        home[update.value] >= 0 ? home[update.value] : positional[update.value];
    require(update.value, stage, -1);
    require(update.buffer, stage, -1);
    plan.buffer_updates[stage].push_back(update);
  }

  plan.node_stage = home;
  plan.outputs = graph.outputs;
  plan.compute.resize(plan.num_stages);
  plan.inputs.resize(plan.num_stages);
  plan.params.resize(plan.num_stages);
  plan.buffers.resize(plan.num_stages);
  plan.recvs.resize(plan.num_stages);
  plan.sends.resize(plan.num_stages);
  for (int32_t i = 0; i < n; ++i) {
    auto& stages = need[i];
    std::sort(stages.begin(), stages.end());
    const Node& node = nodes[i];
    switch (node.kind) {
      case NodeKind::kInput:
        for (const int32_t s : stages) plan.inputs[s].push_back(i);
        break;
      case NodeKind::kParameter:
        for (const int32_t s : stages) plan.params[s].push_back(i);
        if (stages.size() > 1 && node.differentiable) {
          plan.tied.push_back({i, stages});
        }
        break;
      case NodeKind::kBuffer:
        for (const int32_t s : stages) plan.buffers[s].push_back(i);
        break;
      case NodeKind::kCompute:
        if (free[i]) {
          for (const int32_t s : stages) plan.compute[s].push_back(i);
          break;
        }
        plan.compute[home[i]].push_back(i);
        if (stages.size() > 1) {
          MPMD_CHECK(node.transferable, "graph: stages ", stages.back(),
                     " and ", home[i], " both use ", describe(node),
                     ", whose value is not a single tensor with a shape "
                     "known at trace time (a tuple, or a data-dependent shape "
                     "like nonzero's) and cannot be sent; move the split "
                     "point so that it is produced and consumed in one stage");
          Transfer t;
          t.value = i;
          t.src_stage = home[i];
          t.dst_stages.assign(stages.begin() + 1, stages.end());
          t.bytes = node.bytes;
          t.requires_grad = plan.requires_grad[i];
          plan.sends[home[i]].push_back(i);
          for (const int32_t s : t.dst_stages) plan.recvs[s].push_back(i);
          plan.transfers.push_back(std::move(t));
        }
        break;
    }
  }

  for (int32_t s = 0; s < plan.num_stages; ++s) {
    for (const auto& update : plan.buffer_updates[s]) {
      const auto& stages = need[update.buffer];
      MPMD_CHECK(stages.size() == 1, "graph: buffer '",
                 nodes[update.buffer].target, "' is written in stage ", s,
                 " but also read in stage ",
                 stages.front() == s ? stages.back() : stages.front(),
                 "; a buffer the model updates must be used by one stage "
                 "only: move the split point so that its readers and writer "
                 "share a stage");
    }
  }
  return plan;
}

}  // namespace torchmpmd::graph
