// Terse construction of stage graphs for the partitioner tests.
#pragma once

#include <string>
#include <vector>

#include "graph/stage_graph.h"

namespace torchmpmd::testing {

class GraphBuilder {
 public:
  int32_t input(const std::string& name) {
    graph::Node n;
    n.name = name;
    n.kind = graph::NodeKind::kInput;
    n.target = name;
    n.bytes = 64;
    return graph_.add_node(n);
  }

  int32_t param(const std::string& fqn, bool trainable = true) {
    graph::Node n;
    n.name = "p_" + fqn;
    n.kind = graph::NodeKind::kParameter;
    n.target = fqn;
    n.differentiable = trainable;
    n.bytes = 16;
    return graph_.add_node(n);
  }

  int32_t buffer(const std::string& fqn) {
    graph::Node n;
    n.name = "b_" + fqn;
    n.kind = graph::NodeKind::kBuffer;
    n.target = fqn;
    n.bytes = 16;
    return graph_.add_node(n);
  }

  // A differentiable, non-replicable op (like linear) inside `module`.
  int32_t op(const std::string& name, std::vector<int32_t> inputs,
             const std::string& module = "", int64_t bytes = 100) {
    return add(name, std::move(inputs), module, bytes, /*replicable=*/false);
  }

  // A cheap pure op (elementwise, creation, shape) inside `module`.
  int32_t cheap(const std::string& name, std::vector<int32_t> inputs,
                const std::string& module = "") {
    return add(name, std::move(inputs), module, 8, /*replicable=*/true);
  }

  void output(int32_t node) { graph_.outputs.push_back(node); }

  graph::StageGraph& graph() { return graph_; }

 private:
  int32_t add(const std::string& name, std::vector<int32_t> inputs,
              const std::string& module, int64_t bytes, bool replicable) {
    graph::Node n;
    n.name = name;
    n.kind = graph::NodeKind::kCompute;
    n.target = "aten.op";
    n.inputs = std::move(inputs);
    // "a.b@1" -> {"a", "a.b@1"}: enclosing modules, outermost first.
    std::string prefix;
    size_t start = 0;
    while (!module.empty()) {
      const size_t dot = module.find('.', start);
      prefix = module.substr(0, dot);
      n.module_stack.push_back(prefix);
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    n.bytes = bytes;
    n.differentiable = true;
    n.replicable = replicable;
    return graph_.add_node(n);
  }

  graph::StageGraph graph_;
};

inline graph::SplitSpec split_before(std::vector<std::string> points,
                                     std::vector<std::string> modules) {
  graph::SplitSpec spec;
  spec.mode = graph::SplitMode::kBefore;
  spec.points = std::move(points);
  spec.module_paths = std::move(modules);
  return spec;
}

inline graph::SplitSpec split_after(std::vector<std::string> points,
                                    std::vector<std::string> modules) {
  auto spec = split_before(std::move(points), std::move(modules));
  spec.mode = graph::SplitMode::kAfter;
  return spec;
}

inline graph::SplitSpec markers(std::vector<int32_t> positions) {
  graph::SplitSpec spec;
  spec.mode = graph::SplitMode::kMarkers;
  spec.marker_positions = std::move(positions);
  return spec;
}

}  // namespace torchmpmd::testing
