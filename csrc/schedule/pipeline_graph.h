// The stage-level dataflow a schedule is lowered against: which values cross
// from which stage to which, and which parameters several stages share.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "graph/stage_graph.h"

namespace torchmpmd::schedule {

// One value crossing from `src` to `dst` stage (a Transfer fans out into one
// Edge per destination stage).
struct Edge {
  int32_t value = -1;
  int32_t src = -1;
  int32_t dst = -1;
  int64_t bytes = 0;
  bool requires_grad = false;
};

// A parameter held by several stages whose gradients must be summed.
struct TiedGroup {
  int32_t id = -1;  // the parameter's node id in the stage graph
  std::vector<int32_t> stages;
  int64_t bytes = 0;
};

struct PipelineGraph {
  int32_t num_stages = 0;
  std::vector<Edge> edges;
  std::vector<TiedGroup> tied;

  static PipelineGraph from_plan(const graph::StagePlan& plan);
  // stage i -> stage i+1, one value each (value id = i), for tests and demos.
  static PipelineGraph chain(int32_t num_stages, int64_t bytes = 1);

  // Indices into `edges`, per stage; filled by finalize().
  std::vector<std::vector<int32_t>> in_edges;
  std::vector<std::vector<int32_t>> out_edges;
  // Checks edges and tied groups and fills in_edges/out_edges.
  void finalize();
};

// A finalized graph indexed by value, as validation and lowering walk it.
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

  explicit Flow(const PipelineGraph& g);
};

}  // namespace torchmpmd::schedule
