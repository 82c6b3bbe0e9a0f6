// The partitioner must put every node in the right stage, send each
// cross-stage value once and directly, and reject bad split specs with a
// message that names the node and module.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "graph_builder.h"
#include "util/check.h"

namespace torchmpmd {
namespace {

using graph::partition;
using graph::StagePlan;
using testing::GraphBuilder;
using ::testing::HasSubstr;

const std::vector<std::string> kLayers = {"", "l0", "l1", "l2", "l3", "head"};

// x -> l0 -> l1 -> l2 -> l3 -> out, one parameter per layer.
GraphBuilder chain() {
  GraphBuilder b;
  int32_t x = b.input("x");
  for (int i = 0; i < 4; ++i) {
    const std::string l = "l" + std::to_string(i);
    x = b.op(l + "_mm", {x, b.param(l + ".weight")}, l);
  }
  b.output(x);
  return b;
}

std::string error_of(const graph::StageGraph& g, const graph::SplitSpec& s) {
  try {
    partition(g, s);
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

std::vector<std::string> names(const GraphBuilder& b,
                               const std::vector<int32_t>& ids) {
  std::vector<std::string> out;
  auto& g = const_cast<GraphBuilder&>(b).graph();
  for (const int32_t id : ids) out.push_back(g.nodes[id].name);
  return out;
}

using Names = std::vector<std::string>;

TEST(Partition, ChainSplitBefore) {
  auto b = chain();
  const StagePlan plan =
      partition(b.graph(), testing::split_before({"l1", "l3"}, kLayers));
  ASSERT_EQ(plan.num_stages, 3);
  EXPECT_EQ(names(b, plan.compute[0]), Names({"l0_mm"}));
  EXPECT_EQ(names(b, plan.compute[1]), Names({"l1_mm", "l2_mm"}));
  EXPECT_EQ(names(b, plan.compute[2]), Names({"l3_mm"}));
  EXPECT_EQ(names(b, plan.params[1]), Names({"p_l1.weight", "p_l2.weight"}));
  EXPECT_EQ(names(b, plan.inputs[0]), Names({"x"}));
  EXPECT_TRUE(plan.inputs[1].empty());
  ASSERT_EQ(plan.transfers.size(), 2u);
  EXPECT_EQ(b.graph().nodes[plan.transfers[0].value].name, "l0_mm");
  EXPECT_EQ(plan.transfers[0].src_stage, 0);
  EXPECT_EQ(plan.transfers[0].dst_stages, std::vector<int32_t>({1}));
  EXPECT_TRUE(plan.transfers[0].requires_grad);
  EXPECT_EQ(plan.transfers[0].bytes, 100);
  EXPECT_EQ(names(b, plan.sends[1]), Names({"l2_mm"}));
  EXPECT_EQ(names(b, plan.recvs[2]), Names({"l2_mm"}));
  EXPECT_TRUE(plan.tied.empty());
  EXPECT_EQ(plan.node_stage[plan.transfers[1].value], 1);
}

TEST(Partition, SplitAfterMatchesSplitBefore) {
  auto b = chain();
  const StagePlan before =
      partition(b.graph(), testing::split_before({"l1", "l3"}, kLayers));
  const StagePlan after =
      partition(b.graph(), testing::split_after({"l0", "l2"}, kLayers));
  EXPECT_EQ(before.compute, after.compute);
  EXPECT_EQ(before.node_stage, after.node_stage);
}

TEST(Partition, SkipConnectionIsOneDirectTransfer) {
  // x -> e -> l0 -> l1 -> l2 -> (l2 + e): e skips from stage 0 to stage 3,
  // and is also read by stage 1.
  GraphBuilder b;
  const int32_t x = b.input("x");
  const int32_t e = b.op("enc", {x, b.param("enc.w")}, "enc");
  int32_t h = b.op("l0_mm", {e, b.param("l0.w")}, "l0");
  h = b.op("l1_mm", {h, e}, "l1");
  h = b.op("l2_mm", {h, b.param("l2.w")}, "l2");
  b.output(b.op("dec", {h, e}, "dec"));
  const StagePlan plan = partition(
      b.graph(), testing::split_before({"l0", "l1", "dec"},
                                       {"", "enc", "l0", "l1", "l2", "dec"}));
  ASSERT_EQ(plan.num_stages, 4);
  const graph::Transfer* skip = plan.find_transfer(e);
  ASSERT_NE(skip, nullptr);
  EXPECT_EQ(skip->src_stage, 0);
  EXPECT_EQ(skip->dst_stages, std::vector<int32_t>({1, 2, 3}));
  // Nothing relays e: stage 1 and 2 send only their own outputs.
  EXPECT_EQ(names(b, plan.sends[1]), Names({"l0_mm"}));
  EXPECT_EQ(names(b, plan.sends[2]), Names({"l2_mm"}));
  EXPECT_EQ(names(b, plan.recvs[3]), Names({"enc", "l2_mm"}));
  EXPECT_EQ(plan.transfers.size(), 3u);
}

TEST(Partition, SkipAcrossTwoBoundaries) {
  GraphBuilder b;
  const int32_t x = b.input("x");
  const int32_t e = b.op("enc", {x}, "enc");
  int32_t h = b.op("mid", {e}, "mid");
  h = b.op("mid2", {h}, "mid2");
  b.output(b.op("dec", {h, e}, "dec"));
  const StagePlan plan = partition(
      b.graph(), testing::split_before({"mid", "mid2", "dec"},
                                       {"", "enc", "mid", "mid2", "dec"}));
  const graph::Transfer* skip = plan.find_transfer(e);
  ASSERT_NE(skip, nullptr);
  EXPECT_EQ(skip->dst_stages, std::vector<int32_t>({1, 3}));
  EXPECT_EQ(names(b, plan.recvs[2]), Names({"mid"}));
}

TEST(Partition, TiedParameterListsBothStages) {
  GraphBuilder b;
  const int32_t ids = b.input("ids");
  const int32_t w = b.param("emb.weight");
  int32_t h = b.op("embedding", {w, ids}, "emb");
  h = b.op("block", {h, b.param("block.w")}, "block");
  b.output(b.op("logits", {h, w}, "head"));
  const StagePlan plan = partition(
      b.graph(),
      testing::split_before({"block", "head"}, {"", "emb", "block", "head"}));
  ASSERT_EQ(plan.tied.size(), 1u);
  EXPECT_EQ(plan.tied[0].node, w);
  EXPECT_EQ(plan.tied[0].stages, std::vector<int32_t>({0, 2}));
  EXPECT_EQ(names(b, plan.params[2]), Names({"p_emb.weight"}));
}

TEST(Partition, FrozenParameterAndBufferAreSharedNotTied) {
  GraphBuilder b;
  const int32_t x = b.input("x");
  const int32_t frozen = b.param("f", /*trainable=*/false);
  const int32_t buf = b.buffer("scale");
  int32_t h = b.op("a", {x, frozen, buf}, "a");
  b.output(b.op("c", {h, frozen, buf}, "c"));
  const StagePlan plan =
      partition(b.graph(), testing::split_before({"c"}, {"", "a", "c"}));
  EXPECT_TRUE(plan.tied.empty());
  EXPECT_EQ(names(b, plan.buffers[0]), Names({"b_scale"}));
  EXPECT_EQ(names(b, plan.buffers[1]), Names({"b_scale"}));
  EXPECT_EQ(names(b, plan.params[1]), Names({"p_f"}));
  // Nothing trainable feeds a: it does not require grad, and its transfer
  // carries no gradient back.
  EXPECT_FALSE(plan.requires_grad[h]);
  EXPECT_FALSE(plan.find_transfer(h)->requires_grad);
}

TEST(Partition, CheapInputOnlyWorkIsRecomputedNotSent) {
  // A rotary-embedding-like table computed from a buffer and an arange, and
  // a mask computed from an input, both read by every stage.
  GraphBuilder b;
  const int32_t x = b.input("x");
  const int32_t mask_in = b.input("mask");
  const int32_t inv = b.buffer("rope.inv_freq");
  const int32_t pos = b.cheap("arange", {});
  const int32_t table = b.cheap("cos", {pos, inv}, "rope");
  const int32_t mask = b.cheap("mask_fill", {mask_in});
  int32_t h = b.op("l0", {x, b.param("l0.w"), table, mask}, "l0");
  h = b.op("l1", {h, b.param("l1.w"), table, mask}, "l1");
  b.output(h);
  const StagePlan plan = partition(
      b.graph(), testing::split_before({"l1"}, {"", "rope", "l0", "l1"}));
  EXPECT_EQ(names(b, plan.compute[0]),
            Names({"arange", "cos", "mask_fill", "l0"}));
  EXPECT_EQ(names(b, plan.compute[1]),
            Names({"arange", "cos", "mask_fill", "l1"}));
  EXPECT_EQ(names(b, plan.buffers[1]), Names({"b_rope.inv_freq"}));
  EXPECT_EQ(names(b, plan.inputs[1]), Names({"mask"}));
  ASSERT_EQ(plan.transfers.size(), 1u);
  EXPECT_EQ(plan.transfers[0].value, plan.compute[0].back());
  EXPECT_EQ(plan.node_stage[table], -1);
}

TEST(Partition, CheapWorkOnActivationsIsNotReplicated) {
  GraphBuilder b;
  int32_t h = b.op("l0", {b.input("x"), b.param("l0.w")}, "l0");
  const int32_t act = b.cheap("relu", {h}, "l0");
  b.output(b.op("l1", {act, b.param("l1.w")}, "l1"));
  const StagePlan plan =
      partition(b.graph(), testing::split_before({"l1"}, {"", "l0", "l1"}));
  EXPECT_EQ(names(b, plan.sends[0]), Names({"relu"}));
  EXPECT_EQ(plan.node_stage[act], 0);
}

TEST(Partition, UnusedFreeNodesAreDropped) {
  GraphBuilder b;
  const int32_t x = b.input("x");
  b.cheap("dead", {x});
  int32_t h = b.op("l0", {x}, "l0");
  b.output(b.op("l1", {h}, "l1"));
  const StagePlan plan =
      partition(b.graph(), testing::split_before({"l1"}, {"", "l0", "l1"}));
  EXPECT_EQ(names(b, plan.compute[0]), Names({"l0"}));
  EXPECT_EQ(names(b, plan.compute[1]), Names({"l1"}));
}

TEST(Partition, OutputsFromEarlierStagesGoToTheLastStage) {
  GraphBuilder b;
  const int32_t x = b.input("x");
  const int32_t aux = b.op("aux", {x}, "l0");
  b.output(b.op("l1", {aux}, "l1"));
  b.output(aux);
  b.output(x);
  const StagePlan plan =
      partition(b.graph(), testing::split_before({"l1"}, {"", "l0", "l1"}));
  EXPECT_EQ(names(b, plan.recvs[1]), Names({"aux"}));
  EXPECT_EQ(names(b, plan.inputs[1]), Names({"x"}));
}

TEST(Partition, MultiOutputOpsCrossThroughTheirProjections) {
  GraphBuilder b;
  const int32_t x = b.input("x");
  graph::Node split;
  split.name = "split";
  split.target = "aten.split";
  split.inputs = {b.op("l0", {x}, "l0")};
  split.module_stack = {"l0"};
  split.differentiable = true;
  split.transferable = false;
  const int32_t s = b.graph().add_node(split);
  graph::Node get;
  get.name = "getitem";
  get.target = "getitem";
  get.inputs = {s};
  get.attached = true;
  get.replicable = true;
  get.differentiable = true;
  get.module_stack = {"l1"};  // program order puts it in stage 1 ...
  const int32_t g = b.graph().add_node(get);
  b.output(b.op("l1", {g}, "l1"));
  const StagePlan plan =
      partition(b.graph(), testing::split_before({"l1"}, {"", "l0", "l1"}));
  // ... but it stays with its producer, and is what crosses.
  EXPECT_EQ(plan.node_stage[g], 0);
  EXPECT_EQ(names(b, plan.sends[0]), Names({"getitem"}));

  b.output(s);
  EXPECT_THAT(
      error_of(b.graph(), testing::split_before({"l1"}, {"", "l0", "l1"})),
      HasSubstr("'split' (aten.split in module 'l0'), whose value is "
                "not a single tensor"));
}

TEST(Partition, Markers) {
  auto b = chain();
  // Nodes: x, p0, l0_mm, p1, l1_mm, p2, l2_mm, p3, l3_mm.
  const StagePlan plan = partition(b.graph(), testing::markers({3, 7}));
  ASSERT_EQ(plan.num_stages, 3);
  EXPECT_EQ(names(b, plan.compute[1]), Names({"l1_mm", "l2_mm"}));
  EXPECT_EQ(names(b, plan.params[2]), Names({"p_l3.weight"}));
}

TEST(Partition, NoSplitIsOneStage) {
  auto b = chain();
  const StagePlan plan = partition(b.graph(), testing::markers({}));
  EXPECT_EQ(plan.num_stages, 1);
  EXPECT_TRUE(plan.transfers.empty());
  EXPECT_EQ(plan.compute[0].size(), 4u);
}

TEST(PartitionErrors, AdjacentMarkersMakeAnEmptyStage) {
  auto b = chain();
  EXPECT_EQ(error_of(b.graph(), testing::markers({3, 3})),
            "graph: stage 1 of 3 is empty: no operation runs between the 1st "
            "mark_stage_end call (before node 'p_l1.weight') and the 2nd "
            "mark_stage_end call (before node 'p_l1.weight'); move or remove "
            "a split point so that every stage computes something");
  EXPECT_THAT(error_of(b.graph(), testing::markers({0})),
              HasSubstr("stage 0 of 2 is empty: no operation runs before the "
                        "1st mark_stage_end call"));
  EXPECT_THAT(error_of(b.graph(), testing::markers({9})),
              HasSubstr("stage 1 of 2 is empty: no operation runs after the "
                        "1st mark_stage_end call"));
}

TEST(PartitionErrors, EmptyStageFromSplitPoints) {
  auto b = chain();
  EXPECT_THAT(error_of(b.graph(), testing::split_before({"l0"}, kLayers)),
              HasSubstr("stage 0 of 2 is empty: no operation runs before "
                        "split_before 'l0'"));
  EXPECT_THAT(error_of(b.graph(), testing::split_after({"l3"}, kLayers)),
              HasSubstr("stage 1 of 2 is empty: no operation runs after "
                        "split_after 'l3'"));
}

TEST(PartitionErrors, UnknownModulePathSuggestsNeighbours) {
  auto b = chain();
  EXPECT_EQ(error_of(b.graph(), testing::split_before({"l7"}, kLayers)),
            "graph: split_before names 'l7', which is not a module of the "
            "model. Closest module paths: 'l0', 'l1', 'l2'.");
}

TEST(PartitionErrors, RepeatedAndRootSplitPoints) {
  auto b = chain();
  EXPECT_EQ(error_of(b.graph(), testing::split_before({"l1", "l1"}, kLayers)),
            "graph: split_before lists 'l1' twice; name each split point once");
  EXPECT_THAT(error_of(b.graph(), testing::split_after({""}, kLayers)),
              HasSubstr("split_after names the root module"));
}

TEST(PartitionErrors, NeverExecutedModule) {
  auto b = chain();
  EXPECT_THAT(error_of(b.graph(), testing::split_before({"head"}, kLayers)),
              HasSubstr("split_before names module 'head', but it never ran "
                        "in the traced forward"));
}

TEST(PartitionErrors, ModuleThatRunsTwice) {
  GraphBuilder b;
  int32_t h = b.op("a", {b.input("x")}, "blk");
  h = b.op("b", {h}, "mid");
  b.output(b.op("c", {h}, "blk@1"));
  EXPECT_THAT(
      error_of(b.graph(), testing::split_after({"blk"}, {"", "blk", "mid"})),
      HasSubstr("split_after names module 'blk', which runs 2 times "
                "in one forward (calls starting at nodes 'a', 'c')"));
}

TEST(PartitionErrors, SplitPointsOutOfOrderFlowBackwards) {
  auto b = chain();
  EXPECT_EQ(
      error_of(b.graph(), testing::split_before({"l3", "l1"}, kLayers)),
      "graph: node 'l3_mm' (aten.op in module 'l3') in stage 1 uses 'l2_mm' "
      "(aten.op in module 'l2'), which stage 2 computes: values must flow "
      "from earlier stages to later ones. List split points in the order the "
      "model runs them, and do not call a module of one stage again from "
      "another");
}

TEST(PartitionErrors, BackflowThroughAReplicatedNodeNamesTheRealConsumer) {
  GraphBuilder b;
  const int32_t x = b.input("x");
  int32_t h = b.op("l0", {x}, "l0");
  const int32_t h1 = b.op("l1", {h}, "l1");
  h = b.op("l2", {h1}, "l2");
  b.output(h);
  auto spec = testing::split_before({"l2", "l1"}, {"", "l0", "l1", "l2"});
  EXPECT_THAT(error_of(b.graph(), spec),
              HasSubstr("node 'l2' (aten.op in module 'l2') in stage 1 uses "
                        "'l1' (aten.op in module 'l1'), which stage 2"));
}

TEST(PartitionErrors, BufferWrittenInOneStageAndReadInAnother) {
  GraphBuilder b;
  const int32_t x = b.input("x");
  const int32_t stat = b.buffer("bn.running_mean");
  int32_t h = b.op("l0", {x, stat}, "l0");
  const int32_t upd = b.op("new_mean", {h}, "bn");
  b.output(b.op("l1", {h}, "l1"));
  b.graph().buffer_updates.push_back({stat, upd});
  auto spec = testing::split_before({"bn"}, {"", "l0", "bn", "l1"});
  EXPECT_EQ(error_of(b.graph(), spec),
            "graph: buffer 'bn.running_mean' is written in stage 1 but also "
            "read in stage 0; a buffer the model updates must be used by one "
            "stage only: move the split point so that its readers and writer "
            "share a stage");
  spec = testing::split_before({"l1"}, {"", "l0", "bn", "l1"});
  const StagePlan plan = partition(b.graph(), spec);
  ASSERT_EQ(plan.buffer_updates[0].size(), 1u);
  EXPECT_EQ(plan.buffer_updates[0][0].value, upd);
}

TEST(GraphErrors, NodesMustBeTopologicalAndUniquelyNamed) {
  GraphBuilder b;
  b.input("x");
  graph::Node bad;
  bad.name = "bad";
  bad.inputs = {5};
  try {
    b.graph().add_node(bad);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("node 'bad' reads node 5, which does not "
                                    "precede it"));
  }
  b.input("x");
  EXPECT_EQ(error_of(b.graph(), testing::markers({})),
            "graph: two nodes are named 'x'");
}

}  // namespace
}  // namespace torchmpmd
