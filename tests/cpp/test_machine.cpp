// lower() and simulate() run on one machine model, so the order the lowering
// picks is the order the simulator predicts; links carry one message at a
// time; step time and bubble fraction have one definition over task
// intervals.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "schedule/machine.h"
#include "schedule/simulate.h"
#include "schedules.h"
#include "util/check.h"

namespace torchmpmd {
namespace {

using schedule::Costs;
using schedule::EventKind;
using schedule::Instruction;
using schedule::Machine;
using schedule::Op;
using schedule::PipelineGraph;
using schedule::Program;
using schedule::timeline_stats;
using namespace torchmpmd::testing;

Instruction message(Op op, int32_t peer, int64_t tag, int64_t bytes) {
  Instruction ins;
  ins.op = op;
  ins.peer = peer;
  ins.tag = tag;
  ins.bytes = bytes;
  ins.microbatch = 0;
  ins.src_stage = 0;
  ins.stages = {1};
  return ins;
}

TEST(Machine, OneMessageAtATimePerLink) {
  Costs c = Costs::uniform(2);
  c.latency = 0.5;
  c.bytes_per_unit = 10;
  Machine m(3, c);
  const auto first = m.send(0, message(Op::kSend, 1, 0, 20));
  const auto second = m.send(0, message(Op::kSend, 1, 1, 20));
  const auto other = m.send(0, message(Op::kSend, 2, 0, 20));
  EXPECT_DOUBLE_EQ(first.start, 0);
  EXPECT_DOUBLE_EQ(first.end, 2.5);
  EXPECT_DOUBLE_EQ(second.start, 2);  // waits for the link
  EXPECT_DOUBLE_EQ(second.end, 4.5);
  EXPECT_DOUBLE_EQ(other.start, 0);  // another link
  EXPECT_DOUBLE_EQ(m.clock(0), 0);   // sends overlap compute
}

TEST(Machine, WithoutOverlapTheSenderWaitsForTheWire) {
  Costs c = Costs::uniform(2);
  c.bytes_per_unit = 10;
  c.overlap_comm = false;
  Machine m(2, c);
  m.send(0, message(Op::kSend, 1, 0, 20));
  EXPECT_DOUBLE_EQ(m.clock(0), 2);
}

TEST(Machine, ATaskWaitsForTheMessagesItReads) {
  Costs c = Costs::uniform(2, 1.0, 2.0);
  c.latency = 3;
  Machine m(2, c);
  Instruction f1;
  f1.task = F(1, 0);
  const Instruction recv = message(Op::kRecv, 0, 0, 1);
  m.post(1, recv);
  EXPECT_FALSE(m.ready(1, f1).has_value());  // not sent yet
  m.send(0, message(Op::kSend, 1, 0, 1));
  ASSERT_TRUE(m.ready(1, f1).has_value());
  EXPECT_DOUBLE_EQ(*m.ready(1, f1), 3);
  EXPECT_DOUBLE_EQ(m.run(1, f1, 3), 4);
  Instruction b1;
  b1.task = B(1, 0);
  EXPECT_DOUBLE_EQ(*m.ready(1, b1), 4);  // the receive was consumed
}

// With contention and latency, the global order lower() picks must be the
// order in which simulate() starts the tasks.
TEST(Machine, LowerOrdersTasksAsSimulateRunsThem) {
  PipelineGraph g = PipelineGraph::chain(4, 30);
  g.edges.push_back({100, 0, 3, 50, true});
  g.finalize();
  Costs c = Costs::uniform(4, 1.0, 2.0);
  c.latency = 0.25;
  c.bytes_per_unit = 20;
  for (const auto& spec : {gpipe(4, 2, 4), one_f_one_b(4, 6), zb_h1(4, 6)}) {
    const Program p = schedule::lower(g, spec, c);
    const auto tl = schedule::simulate(p, c);
    std::map<std::tuple<int32_t, int32_t, int>, double> start;
    for (const auto& e : tl.events) {
      if (e.kind == EventKind::kCompute) {
        start[{e.task.stage, e.task.microbatch,
               static_cast<int>(e.task.kind)}] = e.start;
      }
    }
    double last = 0;
    for (const auto& [rank, index] : p.order) {
      const Instruction& ins = p.ranks[rank][index];
      if (ins.op != Op::kCompute) continue;
      const double s = start.at({ins.task.stage, ins.task.microbatch,
                                 static_cast<int>(ins.task.kind)});
      EXPECT_GE(s, last) << schedule::to_string(ins.task);
      last = s;
    }
  }
}

TEST(TimelineStats, OneDefinitionOverTaskIntervals) {
  const auto none = timeline_stats({}, {}, {});
  EXPECT_EQ(none.step_time, 0);
  EXPECT_EQ(none.bubble_fraction, 0);
  // Rank 0 busy [1, 3], rank 2 busy [2, 5]: step 4, busy 5 of 2 * 4.
  const auto s = timeline_stats({0, 2, 2}, {1, 2, 4}, {3, 4, 5});
  EXPECT_DOUBLE_EQ(s.step_time, 4);
  EXPECT_DOUBLE_EQ(s.bubble_fraction, 1 - 5.0 / 8);
  EXPECT_THROW(timeline_stats({0}, {1, 2}, {3}), Error);
}

TEST(TimelineStats, TransfersDoNotCount) {
  const auto g = PipelineGraph::chain(2, 100);
  Costs c = Costs::uniform(2, 1.0, 2.0);
  c.latency = 0.5;
  c.bytes_per_unit = 100;
  const auto tl = schedule::simulate(schedule::lower(g, gpipe(2, 2, 1), c), c);
  std::vector<int32_t> ranks;
  std::vector<double> starts, ends;
  for (const auto& e : tl.events) {
    if (e.kind != EventKind::kCompute) continue;
    ranks.push_back(e.rank);
    starts.push_back(e.start);
    ends.push_back(e.end);
  }
  const auto s = timeline_stats(ranks, starts, ends);
  EXPECT_DOUBLE_EQ(tl.step_time(), s.step_time);
  EXPECT_DOUBLE_EQ(tl.bubble_fraction(), s.bubble_fraction);
  EXPECT_DOUBLE_EQ(s.step_time, 9);
}

// Ranks sharing cores: the costs are as measured with every rank at work;
// a rank computing alone gets a core of its own and runs faster.
TEST(Machine, RanksSharingCoresComputeFasterWhereFewerCompute) {
  const auto g = PipelineGraph::chain(4, 1);
  Costs c = Costs::uniform(4, 1.0, 2.0);
  // One microbatch: one rank computes at a time, F 4 x 1 + B 4 x 2.
  const Program one = schedule::lower(g, gpipe(4, 4, 1), c);
  EXPECT_DOUBLE_EQ(schedule::simulate(one, c).step_time(), 12);
  c.shared_cores = 4;  // as many cores as ranks: nothing shared
  EXPECT_DOUBLE_EQ(schedule::simulate(one, c).step_time(), 12);
  c.shared_cores = 2;  // 4 ranks at work ran at half speed; one alone at full
  EXPECT_NEAR(schedule::simulate(one, c).step_time(), 6, 1e-9);
  c.shared_cores = 4;
  c.demand_per_rank = 2;  // each rank stands for two (its replica)
  EXPECT_NEAR(schedule::simulate(one, c).step_time(), 6, 1e-9);

  // Many microbatches: faster than every rank at work throughout, never
  // faster than the work spread over the 2 cores.
  Costs shared = Costs::uniform(4, 1.0, 2.0);
  const Program many = schedule::lower(g, one_f_one_b(4, 16), shared);
  const double busy = schedule::simulate(many, shared).step_time();
  shared.shared_cores = 2;
  const auto tl = schedule::simulate(many, shared);
  double work = 0;  // as measured (every rank at work: half speed)
  for (const auto& e : tl.events) {
    if (e.kind == EventKind::kCompute) work += shared.of(e.task);
  }
  EXPECT_LT(tl.step_time(), busy);
  EXPECT_GE(tl.step_time(), work / 2 / 2 - 1e-9);
  // Each rank still runs its tasks one at a time, in its order.
  std::map<int32_t, double> free_at;
  for (const auto& e : tl.events) {
    if (e.kind != EventKind::kCompute) continue;
    EXPECT_GE(e.start, free_at[e.rank] - 1e-9) << schedule::to_string(e.task);
    free_at[e.rank] = e.end;
  }
  shared.shared_cores = -1;
  EXPECT_THROW(schedule::simulate(many, shared), Error);
}

}  // namespace
}  // namespace torchmpmd
