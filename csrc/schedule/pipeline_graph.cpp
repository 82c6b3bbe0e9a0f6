#include "schedule/pipeline_graph.h"

#include <algorithm>
#include <tuple>

#include "util/check.h"

namespace torchmpmd::schedule {

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

Flow::Flow(const PipelineGraph& g)
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

}  // namespace torchmpmd::schedule
