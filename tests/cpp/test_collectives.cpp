// Data parallelism in the schedule: a stage's unshard and gradient reduction
// (torch.distributed.pipelining's UNSHARD / REDUCE_GRAD actions) are
// instructions of the lowered program, where the executor runs them and the
// simulator charges their time and memory.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "schedule/lower.h"
#include "schedule/simulate.h"
#include "schedules.h"
#include "util/check.h"

namespace torchmpmd {
namespace {

using schedule::Costs;
using schedule::EventKind;
using schedule::Instruction;
using schedule::Op;
using schedule::PipelineGraph;
using schedule::Program;
using schedule::StageCollectives;
using schedule::Timeline;
using namespace torchmpmd::testing;

ScheduleSpec sharded(ScheduleSpec spec, int stages, bool unshard = true) {
  spec.collectives.assign(stages, StageCollectives{unshard, true});
  return spec;
}

// Per rank: the program as text, without the messages.
std::vector<std::vector<std::string>> without_messages(const Program& p) {
  std::vector<std::vector<std::string>> out(p.num_ranks());
  for (int32_t r = 0; r < p.num_ranks(); ++r) {
    for (const Instruction& ins : p.ranks[r]) {
      if (ins.op != Op::kSend && ins.op != Op::kRecv) {
        out[r].push_back(schedule::to_string(ins));
      }
    }
  }
  return out;
}

TEST(Collectives, UnshardBeforeTheFirstTaskReduceAfterTheLastBackward) {
  const PipelineGraph g = PipelineGraph::chain(2);
  const Program p =
      schedule::lower(g, sharded(one_f_one_b(2, 2), 2), Costs::uniform(2));
  using ::testing::ElementsAre;
  EXPECT_THAT(without_messages(p)[0],
              ElementsAre("UNSHARD(s0)", "0F0", "0F1", "0B0", "0B1",
                          "REDUCE_grads(s0)"));
  EXPECT_THAT(without_messages(p)[1],
              ElementsAre("UNSHARD(s1)", "1F0", "1B0", "1F1", "1B1",
                          "REDUCE_grads(s1)"));
}

TEST(Collectives, SplitBackwardReducesAfterTheLastW) {
  const PipelineGraph g = PipelineGraph::chain(2);
  const Program p =
      schedule::lower(g, sharded(zb_h1(2, 3), 2), Costs::uniform(2));
  for (const auto& code : without_messages(p)) {
    ASSERT_FALSE(code.empty());
    EXPECT_EQ(code.back().rfind("REDUCE_grads", 0), 0u);
    const std::string& last_task = code[code.size() - 2];
    EXPECT_EQ(last_task[1], 'W') << last_task;
  }
}

TEST(Collectives, EachOfARanksStagesIsGatheredBeforeItsOwnFirstTask) {
  // Two stages per rank: stage 2 is gathered only when it is first needed.
  const PipelineGraph g = PipelineGraph::chain(4);
  const Program p =
      schedule::lower(g, sharded(gpipe(4, 2, 2), 4), Costs::uniform(4));
  using ::testing::ElementsAre;
  EXPECT_THAT(without_messages(p)[0],
              ElementsAre("UNSHARD(s0)", "0F0", "0F1", "UNSHARD(s2)", "2F0",
                          "2F1", "2B0", "2B1", "REDUCE_grads(s2)", "0B0", "0B1",
                          "REDUCE_grads(s0)"));
}

TEST(Collectives, ReplicatedStagesOnlyReduce) {
  const PipelineGraph g = PipelineGraph::chain(2);
  const Program p = schedule::lower(
      g, sharded(one_f_one_b(2, 1), 2, /*unshard=*/false), Costs::uniform(2));
  using ::testing::ElementsAre;
  EXPECT_THAT(without_messages(p)[0],
              ElementsAre("0F0", "0B0", "REDUCE_grads(s0)"));
}

TEST(Collectives, ForwardOnlyProgramsHaveNone) {
  const PipelineGraph g = PipelineGraph::chain(2);
  ScheduleSpec spec{2, 1, {0, 1}, {{F(0, 0)}, {F(1, 0)}}, true, {}};
  const Program p = schedule::lower(g, sharded(spec, 2), Costs::uniform(2));
  using ::testing::ElementsAre;
  EXPECT_THAT(without_messages(p)[0], ElementsAre("0F0"));
}

TEST(Collectives, OnePerStageOrNone) {
  const PipelineGraph g = PipelineGraph::chain(2);
  EXPECT_THAT(lower_error(g, sharded(one_f_one_b(2, 1), 3)),
              ::testing::HasSubstr("collectives give 3 entries but the "
                                   "pipeline has 2 stages"));
}

TEST(Collectives, TheSimulatorChargesThemAndHoldsWhatIsGathered) {
  const PipelineGraph g = PipelineGraph::chain(2);
  Costs c = Costs::uniform(2);  // F 1, B 2
  c.unshard = {5, 5};
  c.reduce_grads = {4, 4};
  c.unsharded_bytes = {100, 100};
  c.activation_bytes = {10, 10};
  const Program p = schedule::lower(g, sharded(one_f_one_b(2, 1), 2), c);
  const Timeline tl = schedule::simulate(p, c);
  const Timeline plain = schedule::simulate(
      schedule::lower(g, one_f_one_b(2, 1), Costs::uniform(2)), c);
  // Rank 0 gathers (0-5), F (5-6); rank 1 gathers (0-5) and waits for F:
  // F (6-7), B (7-9), reduces beside the rank (9-13); rank 0's B (9-11)
  // and reduction (11-15) end the step.
  EXPECT_DOUBLE_EQ(plain.step_time(), 1 + 1 + 2 + 2);
  EXPECT_DOUBLE_EQ(tl.step_time(), 15);
  int collectives = 0;
  for (const auto& e : tl.events) {
    if (e.kind != EventKind::kCollective) continue;
    ++collectives;
    EXPECT_TRUE(e.label == "unshard" || e.label == "reduce_grads") << e.label;
    if (e.rank == 0 && e.label == "reduce_grads") {
      EXPECT_DOUBLE_EQ(e.start, 11);
      EXPECT_DOUBLE_EQ(e.end, 15);
    }
  }
  EXPECT_EQ(collectives, 4);
  // Activations alone, and with the gathered parameters.
  EXPECT_EQ(tl.peak_activation_bytes, plain.peak_activation_bytes);
  EXPECT_EQ(tl.peak_bytes[0], 110);
  EXPECT_EQ(tl.peak_bytes[1], 110);
  // The reductions are not compute: the bubble counts only tasks.
  EXPECT_GT(tl.bubble_fraction(), plain.bubble_fraction());
}

TEST(Collectives, AReductionBlocksTheRankWithoutOverlap) {
  // Two stages per rank: stage 3's and stage 2's reductions come before the
  // rank's last backward. Beside the compute, they delay nothing but the
  // reductions queued behind them on the rank's channel; without overlap
  // they hold the rank.
  const PipelineGraph g = PipelineGraph::chain(4);
  Costs c = Costs::uniform(4);  // F 1, B 2
  c.reduce_grads = {4, 4, 4, 4};
  const Program p = schedule::lower(
      g, sharded(gpipe(4, 2, 1), 4, /*unshard=*/false), Costs::uniform(4));
  // F0 0-1, F1 1-2, F2 2-3, F3 3-4, B3 4-6, B2 6-8, B1 8-10, B0 10-12;
  // rank 0 reduces s2 8-12, then s0 12-16.
  EXPECT_DOUBLE_EQ(schedule::simulate(p, c).step_time(), 16);
  // Rank 1 reduces s3 6-10 before B1 (10-12); rank 0 s2 8-12 before B0
  // (12-14), then s0 14-18.
  c.overlap_comm = false;
  EXPECT_DOUBLE_EQ(schedule::simulate(p, c).step_time(), 18);
}

TEST(Collectives, CostsGiveOnePerStageOrNone) {
  Costs c = Costs::uniform(2);
  c.unshard = {1};
  EXPECT_THROW(c.check(2), Error);
  c.unshard = {1, -1};
  EXPECT_THROW(c.check(2), Error);
  c.unshard = {};
  c.unsharded_bytes = {1, 2};
  EXPECT_NO_THROW(c.check(2));
}

}  // namespace
}  // namespace torchmpmd
