// Lowering must give every rank the sends and receives its tasks need, in an
// order both ends of every rank pair agree on; validation must reject bad
// schedules naming the tasks; the simulator must reproduce the textbook step
// times.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "schedule/simulate.h"
#include "schedules.h"
#include "util/check.h"

namespace torchmpmd {
namespace {

using schedule::Costs;
using schedule::Instruction;
using schedule::lower;
using schedule::Op;
using schedule::Payload;
using schedule::PipelineGraph;
using schedule::Program;
using schedule::ScheduleSpec;
using schedule::simulate;
using namespace torchmpmd::testing;
using ::testing::HasSubstr;

// For every pair of ranks, the messages between them must appear in the same
// order on both sides, with matching tags and payloads.
void expect_pair_order_agrees(const Program& p) {
  using Key = std::tuple<int32_t, int32_t>;
  std::map<Key, std::vector<std::string>> seen;
  for (int32_t r = 0; r < p.num_ranks(); ++r) {
    for (const Instruction& ins : p.ranks[r]) {
      if (ins.op != Op::kSend && ins.op != Op::kRecv) continue;
      const int32_t src = ins.op == Op::kSend ? r : ins.peer;
      const int32_t dst = ins.op == Op::kSend ? ins.peer : r;
      const std::string msg = detail::str_cat(
          src, "->", dst, " p", static_cast<int>(ins.payload), " v", ins.value,
          " mb", ins.microbatch, " #", ins.tag);
      seen[{r, ins.peer}].push_back(msg);
    }
  }
  for (const auto& [key, msgs] : seen) {
    const auto [a, b] = key;
    const auto other = seen.find({b, a});
    ASSERT_NE(other, seen.end())
        << "rank " << a << " talks to " << b << " alone";
    EXPECT_EQ(msgs, other->second) << "ranks " << a << " and " << b;
  }
}

int count(const Program& p, int32_t rank, Op op, Payload payload) {
  int n = 0;
  for (const auto& ins : p.ranks[rank]) {
    n += ins.op == op && (op == Op::kCompute || ins.payload == payload);
  }
  return n;
}

TEST(Lower, GPipeChainSendsEachActivationAndGradientOnce) {
  const auto g = PipelineGraph::chain(4);
  const Program p = lower(g, gpipe(4, 4, 8), Costs::uniform(4));
  expect_pair_order_agrees(p);
  EXPECT_EQ(count(p, 0, Op::kSend, Payload::kActivation), 8);
  EXPECT_EQ(count(p, 0, Op::kRecv, Payload::kGrad), 8);
  EXPECT_EQ(count(p, 3, Op::kRecv, Payload::kActivation), 8);
  EXPECT_EQ(count(p, 3, Op::kSend, Payload::kGrad), 8);
  EXPECT_EQ(count(p, 3, Op::kSend, Payload::kActivation), 0);
  EXPECT_EQ(count(p, 1, Op::kCompute, Payload::kActivation), 16);
  // The send follows the task that produces it.
  const auto& r0 = p.ranks[0];
  ASSERT_EQ(r0[0].op, Op::kCompute);
  EXPECT_EQ(r0[1].op, Op::kSend);
  EXPECT_EQ(r0[1].microbatch, 0);
}

TEST(Lower, ReceivesComeBeforeTheirConsumer) {
  const auto g = PipelineGraph::chain(4);
  const Program p = lower(g, one_f_one_b(4, 6), Costs::uniform(4));
  for (int32_t r = 0; r < 4; ++r) {
    std::map<std::pair<int32_t, int32_t>, bool> posted;  // (payload, mb)
    for (const auto& ins : p.ranks[r]) {
      if (ins.op == Op::kRecv) {
        posted[{static_cast<int32_t>(ins.payload), ins.microbatch}] = true;
      } else if (ins.op == Op::kCompute && r > 0 &&
                 ins.task.kind == TaskKind::kForward) {
        EXPECT_TRUE(posted.count({0, ins.task.microbatch}))
            << "rank " << r << " " << schedule::to_string(ins.task);
      } else if (ins.op == Op::kCompute && r < 3 &&
                 ins.task.kind == TaskKind::kBackward) {
        EXPECT_TRUE(posted.count({1, ins.task.microbatch}))
            << "rank " << r << " " << schedule::to_string(ins.task);
      }
    }
  }
}

TEST(Lower, SkipConnectionGoesDirectly) {
  PipelineGraph g = PipelineGraph::chain(4);
  g.edges.push_back({100, 0, 3, 8, true});
  g.finalize();
  const Program p = lower(g, gpipe(4, 4, 2), Costs::uniform(4));
  expect_pair_order_agrees(p);
  int direct = 0;
  for (const auto& ins : p.ranks[0]) {
    if (ins.op == Op::kSend && ins.value == 100) {
      EXPECT_EQ(ins.peer, 3);
      EXPECT_EQ(ins.stages, std::vector<int32_t>({3}));
      ++direct;
    }
  }
  EXPECT_EQ(direct, 2);  // one per microbatch; its gradients come back
  EXPECT_EQ(count(p, 0, Op::kRecv, Payload::kGrad), 4);
  for (int32_t r : {1, 2}) {
    for (const auto& ins : p.ranks[r]) {
      EXPECT_NE(ins.value, 100);
    }
  }
  EXPECT_EQ(count(p, 3, Op::kSend, Payload::kGrad), 4);
}

TEST(Lower, SameRankStagesHandOverInMemory) {
  const auto g = PipelineGraph::chain(4);
  // Stages 0,1 on rank 0 and 2,3 on rank 1.
  ScheduleSpec spec{2, 2, {0, 0, 1, 1}, {}, false, {}};
  spec.tasks = {
      {F(0, 0), F(1, 0), F(0, 1), F(1, 1), B(1, 0), B(0, 0), B(1, 1), B(0, 1)},
      {F(2, 0), F(3, 0), F(2, 1), F(3, 1), B(3, 0), B(2, 0), B(3, 1), B(2, 1)}};
  const Program p = lower(g, spec, Costs::uniform(4));
  expect_pair_order_agrees(p);
  // Only value 1 (stage 1 -> stage 2) crosses ranks.
  for (const auto& ins : p.ranks[0]) {
    if (ins.op == Op::kSend || ins.op == Op::kRecv) {
      EXPECT_EQ(ins.value, 1);
    }
  }
  EXPECT_EQ(count(p, 0, Op::kSend, Payload::kActivation), 2);
}

TEST(Lower, TiedParametersExchangeGradientsAfterTheirLastBackward) {
  PipelineGraph g = PipelineGraph::chain(4);
  g.tied.push_back({7, {0, 3}, 64});
  g.finalize();
  const Program p = lower(g, one_f_one_b(4, 4), Costs::uniform(4));
  expect_pair_order_agrees(p);
  for (int32_t r : {0, 3}) {
    EXPECT_EQ(count(p, r, Op::kSend, Payload::kTiedGrad), 1);
    EXPECT_EQ(count(p, r, Op::kRecv, Payload::kTiedGrad), 1);
    EXPECT_EQ(p.ranks[r].back().op, Op::kReduceTied);
    // The send comes after the rank's last backward.
    int last_b = -1, send = -1;
    for (int i = 0; i < static_cast<int>(p.ranks[r].size()); ++i) {
      const auto& ins = p.ranks[r][i];
      if (ins.op == Op::kCompute && ins.task.is_backward()) last_b = i;
      if (ins.op == Op::kSend && ins.payload == Payload::kTiedGrad) send = i;
    }
    EXPECT_GT(send, last_b);
  }
  for (int32_t r : {1, 2}) {
    EXPECT_EQ(count(p, r, Op::kReduceTied, Payload::kTiedGrad), 0);
  }
}

TEST(Lower, TiedStagesOnOneRankNeedNoMessages) {
  PipelineGraph g = PipelineGraph::chain(4);
  g.tied.push_back({7, {0, 2}, 64});
  g.finalize();
  const Program p = lower(g, gpipe(4, 2, 2), Costs::uniform(4));
  for (int32_t r : {0, 1}) {
    for (const auto& ins : p.ranks[r]) {
      EXPECT_NE(ins.payload == Payload::kTiedGrad && ins.op != Op::kCompute,
                true);
    }
  }
}

TEST(Simulate, GPipeAnd1F1BStepTimeIsTextbook) {
  for (int p : {2, 4}) {
    for (int m : {1, 4, 8}) {
      const auto g = PipelineGraph::chain(p);
      const Costs c = Costs::uniform(p, 1.0, 2.0);
      const double expected = (m + p - 1) * (1.0 + 2.0);
      EXPECT_DOUBLE_EQ(simulate(lower(g, gpipe(p, p, m), c), c).step_time(),
                       expected)
          << "gpipe p=" << p << " m=" << m;
      EXPECT_DOUBLE_EQ(simulate(lower(g, one_f_one_b(p, m), c), c).step_time(),
                       expected)
          << "1f1b p=" << p << " m=" << m;
    }
  }
}

TEST(Simulate, ZeroBubbleH1StepTimeIsTextbook) {
  for (int p : {2, 4}) {
    for (int m : {4, 8}) {
      const auto g = PipelineGraph::chain(p);
      const double F = 1, Ib = 1, Wt = 1;
      Costs c = Costs::uniform(p, F, Ib + Wt, Ib, Wt);
      const auto tl = simulate(lower(g, zb_h1(p, m), c), c);
      EXPECT_DOUBLE_EQ(tl.step_time(),
                       m * (F + Ib + Wt) + (p - 1) * (F + Ib - Wt))
          << "p=" << p << " m=" << m;
    }
  }
}

TEST(Simulate, BubbleAndPeakMemory) {
  const int p = 4, m = 8;
  const auto g = PipelineGraph::chain(p);
  const Costs c = Costs::uniform(p, 1.0, 2.0);
  const auto gp = simulate(lower(g, gpipe(p, p, m), c), c);
  const auto ofob = simulate(lower(g, one_f_one_b(p, m), c), c);
  EXPECT_NEAR(gp.bubble_fraction(), (p - 1.0) / (m + p - 1.0), 1e-12);
  // GPipe keeps every microbatch alive; 1F1B at most p on the first stage.
  EXPECT_EQ(gp.peak_activation_bytes[0], m);
  EXPECT_EQ(ofob.peak_activation_bytes[0], p);
  EXPECT_EQ(ofob.peak_activation_bytes[p - 1], 1);
}

TEST(Simulate, CommunicationDelaysTheConsumer) {
  const auto g = PipelineGraph::chain(2, 100);
  Costs c = Costs::uniform(2, 1.0, 2.0);
  c.latency = 0.5;
  c.bytes_per_unit = 100;  // 1 unit per message
  const auto tl = simulate(lower(g, gpipe(2, 2, 1), c), c);
  // F0 [0,1], send [1,2.5], F1 [2.5,3.5], B1 [3.5,5.5], grad [5.5,7], B0 [7,9]
  EXPECT_DOUBLE_EQ(tl.step_time(), 9.0);
}

TEST(Validate, MissingDuplicateAndMisplacedTasks) {
  const auto g = PipelineGraph::chain(2);
  auto spec = gpipe(2, 2, 2);
  spec.tasks[1].pop_back();
  EXPECT_THAT(lower_error(g, spec),
              HasSubstr("schedule: stage 1 microbatch 1 has no backward: rank "
                        "1 must run B(stage=1, mb=1) or both I(stage=1, mb=1) "
                        "and W(stage=1, mb=1)"));

  spec = gpipe(2, 2, 2);
  spec.tasks[0].push_back(F(0, 1));
  EXPECT_THAT(lower_error(g, spec),
              HasSubstr("schedule: task F(stage=0, mb=1) appears twice (rank 0 "
                        "position 1 and rank 0 position 4)\n  rank 0: 0F0 "
                        "[0F1] 0B0 0B1 [0F1]\n  rank 1: 1F0 1F1 1B0 1B1\n"));

  spec = gpipe(2, 2, 2);
  std::swap(spec.tasks[0][0], spec.tasks[1][0]);
  EXPECT_THAT(lower_error(g, spec),
              HasSubstr("schedule: task F(stage=1, mb=0) is on rank 0, but "
                        "stage 1 is placed on rank 1: all tasks of a stage run "
                        "on the rank that holds it"));

  spec = gpipe(2, 2, 2);
  spec.tasks[0][0].microbatch = 9;
  EXPECT_THAT(lower_error(g, spec),
              HasSubstr("names a microbatch outside 0..1"));
}

TEST(Validate, PlacementErrors) {
  const auto g = PipelineGraph::chain(3);
  auto spec = gpipe(3, 3, 1);
  spec.placement = {0, 1};
  EXPECT_THAT(lower_error(g, spec),
              HasSubstr("the placement has 2 entries but the pipeline has 3 "
                        "stages"));
  spec = gpipe(3, 3, 1);
  spec.placement[2] = 5;
  EXPECT_THAT(lower_error(g, spec),
              HasSubstr("puts stage 2 on rank 5, but there are only 3 ranks"));
  spec = gpipe(3, 3, 1);
  spec.placement = {0, 0, 1};
  spec.tasks = {{F(0, 0), F(1, 0), B(1, 0), B(0, 0)}, {F(2, 0), B(2, 0)}, {}};
  EXPECT_THAT(lower_error(g, spec), HasSubstr("rank 2 holds no stage"));
}

TEST(Validate, DependencyOrderOnOneRank) {
  const auto g = PipelineGraph::chain(2);
  auto spec = gpipe(2, 2, 2);
  std::swap(spec.tasks[1][1], spec.tasks[1][2]);  // 1B0 before 1F1 is fine
  EXPECT_EQ(lower_error(g, spec), "<no error>");
  spec = gpipe(2, 2, 2);
  std::swap(spec.tasks[1][0], spec.tasks[1][2]);  // 1B0 before 1F0
  EXPECT_THAT(lower_error(g, spec),
              HasSubstr("schedule: rank 1 runs B(stage=1, mb=0) (position 0) "
                        "before F(stage=1, mb=0) (position 2), which it "
                        "depends on\n  rank 0: 0F0 0F1 0B0 0B1\n  rank 1: "
                        "[1B0] 1F1 [1F0] 1B1\n"));

  ScheduleSpec split{1, 1, {0}, {{F(0, 0), W(0, 0), I(0, 0)}}, false, {}};
  EXPECT_THAT(lower_error(PipelineGraph::chain(1), split),
              HasSubstr("rank 0 runs W(stage=0, mb=0) (position 1) before "
                        "I(stage=0, mb=0) (position 2)"));
  ScheduleSpec mixed{1, 1, {0}, {{F(0, 0), B(0, 0), W(0, 0)}}, false, {}};
  EXPECT_THAT(lower_error(PipelineGraph::chain(1), mixed),
              HasSubstr("has both a full backward B(stage=0, mb=0) and a split "
                        "one (I/W)"));
  // A consumer before its producer on the same rank.
  ScheduleSpec looped{1,     1, {0, 0}, {{F(1, 0), F(0, 0), B(1, 0), B(0, 0)}},
                      false, {}};
  EXPECT_THAT(lower_error(PipelineGraph::chain(2), looped),
              HasSubstr("rank 0 runs F(stage=1, mb=0) (position 0) before "
                        "F(stage=0, mb=0) (position 1)"));
}

TEST(Validate, CrossRankDeadlockShowsWhereEachRankStopped) {
  const auto g = PipelineGraph::chain(2);
  ScheduleSpec spec{2, 2, {0, 1}, {}, false, {}};
  spec.tasks = {{F(0, 0), B(0, 0), F(0, 1), B(0, 1)},
                {F(1, 1), F(1, 0), B(1, 0), B(1, 1)}};
  EXPECT_EQ(lower_error(g, spec),
            "schedule: deadlock: no rank can run its next task, each waits "
            "for a task that runs later on another rank:\n"
            "  rank 0 waits at 0B0 for 1B0 (rank 1 position 2)\n"
            "  rank 1 waits at 1F1 for 0F1 (rank 0 position 2)\n"
            "  rank 0: 0F0 [0B0] 0F1 0B1\n"
            "  rank 1: [1F1] 1F0 1B0 1B1\n");
}

TEST(Validate, ForwardOnlyPrograms) {
  const auto g = PipelineGraph::chain(2);
  ScheduleSpec spec{2,    2, {0, 1}, {{F(0, 0), F(0, 1)}, {F(1, 0), F(1, 1)}},
                    true, {}};
  const Program p = lower(g, spec, Costs::uniform(2));
  EXPECT_EQ(count(p, 0, Op::kSend, Payload::kActivation), 2);
  EXPECT_EQ(count(p, 0, Op::kRecv, Payload::kGrad), 0);
  spec.tasks[1].push_back(B(1, 0));
  EXPECT_THAT(lower_error(g, spec), HasSubstr("in a forward-only program"));
}

TEST(Actions, RoundTripAndErrors) {
  EXPECT_EQ(schedule::to_action(F(2, 5)), "2F5");
  EXPECT_EQ(schedule::parse_action("12W3"), W(12, 3));
  EXPECT_EQ(schedule::parse_action("0I0"), I(0, 0));
  for (const char* bad : {"", "F1", "1X2", "1F", "1F2x", "-1F2"}) {
    try {
      schedule::parse_action(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("schedule:"));
    }
  }
}

TEST(PipelineGraphTest, RejectsMalformedEdges) {
  PipelineGraph g;
  g.num_stages = 2;
  g.edges.push_back({0, 1, 0, 4, true});
  try {
    g.finalize();
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("flows from stage 1 back to stage 0"));
  }
}

}  // namespace
}  // namespace torchmpmd
