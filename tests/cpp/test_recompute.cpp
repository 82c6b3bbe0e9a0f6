// Recompute (R) tasks: validation names them like every other task, the
// lowering sends no extra messages for them, and the simulator counts their
// cost and the activation memory they save.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "schedule/simulate.h"
#include "schedules.h"
#include "util/check.h"

namespace torchmpmd {
namespace {

using schedule::Costs;
using schedule::Instruction;
using schedule::lower;
using schedule::Op;
using schedule::PipelineGraph;
using schedule::Program;
using schedule::simulate;
using namespace torchmpmd::testing;
using ::testing::HasSubstr;

// The messages of a rank, without their order (R changes the timing, and so
// the global order and the tags).
std::multiset<std::string> messages(const Program& p, int32_t rank) {
  std::multiset<std::string> out;
  for (const Instruction& ins : p.ranks[rank]) {
    if (ins.op == Op::kCompute) continue;
    out.insert(detail::str_cat(static_cast<int>(ins.op), " ",
                               static_cast<int>(ins.payload), " v", ins.value,
                               " mb", ins.microbatch, " peer", ins.peer));
  }
  return out;
}

TEST(Recompute, ParsesAndPrints) {
  EXPECT_EQ(schedule::parse_action("1R3"), R(1, 3));
  EXPECT_EQ(schedule::to_string(R(1, 3)), "R(stage=1, mb=3)");
}

TEST(Recompute, ValidationNamesTheTask) {
  const auto g = PipelineGraph::chain(1);
  const auto one = [](std::vector<Task> tasks) {
    return ScheduleSpec{1, 1, {0}, {std::move(tasks)}, false, {}};
  };
  EXPECT_EQ(lower_error(g, one({F(0, 0), R(0, 0), B(0, 0)})), "<no error>");
  EXPECT_EQ(lower_error(g, one({F(0, 0), R(0, 0), I(0, 0), W(0, 0)})),
            "<no error>");
  EXPECT_THAT(lower_error(g, one({R(0, 0), F(0, 0), B(0, 0)})),
              HasSubstr("schedule: rank 0 runs R(stage=0, mb=0) (position 0) "
                        "before F(stage=0, mb=0) (position 1), which it "
                        "depends on\n  rank 0: [0R0] [0F0] 0B0\n"));
  EXPECT_THAT(lower_error(g, one({F(0, 0), B(0, 0), R(0, 0)})),
              HasSubstr("schedule: rank 0 runs B(stage=0, mb=0) (position 1) "
                        "before R(stage=0, mb=0) (position 2), which it "
                        "depends on"));
  EXPECT_THAT(lower_error(g, one({F(0, 0), I(0, 0), R(0, 0), W(0, 0)})),
              HasSubstr("schedule: rank 0 runs I(stage=0, mb=0) (position 1) "
                        "before R(stage=0, mb=0) (position 2)"));
  EXPECT_THAT(lower_error(g, one({F(0, 0), R(0, 0)})),
              HasSubstr("schedule: stage 0 microbatch 0 has no backward: rank "
                        "0 must run B(stage=0, mb=0) or both I(stage=0, mb=0) "
                        "and W(stage=0, mb=0)"));
  EXPECT_THAT(lower_error(g, one({F(0, 0), R(0, 0), R(0, 0), B(0, 0)})),
              HasSubstr("schedule: task R(stage=0, mb=0) appears twice (rank "
                        "0 position 1 and rank 0 position 2)"));
  ScheduleSpec eval{1, 1, {0}, {{F(0, 0), R(0, 0)}}, true, {}};
  EXPECT_THAT(lower_error(g, eval),
              HasSubstr("task R(stage=0, mb=0) in a forward-only program"));
  // On the rank of its stage, like every task.
  ScheduleSpec moved = with_recompute(gpipe(2, 2, 1));
  std::swap(moved.tasks[0][1], moved.tasks[1][1]);
  EXPECT_THAT(lower_error(PipelineGraph::chain(2), moved),
              HasSubstr("task R(stage=1, mb=0) is on rank 0, but stage 1 is "
                        "placed on rank 1"));
}

TEST(Recompute, LowersWithoutExtraMessages) {
  PipelineGraph g = PipelineGraph::chain(4);
  g.tied.push_back({7, {0, 3}, 64});
  g.finalize();
  for (const auto& spec : {gpipe(4, 4, 4), one_f_one_b(4, 4), zb_h1(4, 4)}) {
    const Program plain = lower(g, spec, Costs::uniform(4));
    const Program recomputed =
        lower(g, with_recompute(spec), Costs::uniform(4));
    for (int32_t r = 0; r < 4; ++r) {
      EXPECT_EQ(messages(recomputed, r), messages(plain, r)) << "rank " << r;
      int n = 0;
      for (const Instruction& ins : recomputed.ranks[r]) {
        n += ins.op == Op::kCompute &&
             ins.task.kind == schedule::TaskKind::kRecompute;
      }
      EXPECT_EQ(n, 4);
    }
  }
}

TEST(Recompute, GPipeKeepsOneMicrobatchAliveAndTheInputsOfAll) {
  const int p = 4, m = 8;
  const int64_t input = 3;  // bytes each stage receives per microbatch
  const auto g = PipelineGraph::chain(p, input);
  const Costs c = Costs::uniform(p, 1.0, 2.0);
  const auto plain = simulate(lower(g, gpipe(p, p, m), c), c);
  const auto recomputed =
      simulate(lower(g, with_recompute(gpipe(p, p, m)), c), c);
  for (int32_t r = 0; r < p; ++r) {
    EXPECT_EQ(plain.peak_activation_bytes[r], m);
    // A recomputed forward keeps what it received (stage 0 receives
    // nothing) until its backward; the recompute rebuilds one microbatch.
    EXPECT_EQ(recomputed.peak_activation_bytes[r], (r == 0 ? 0 : m * input) + 1)
        << "rank " << r;
  }
}

TEST(Recompute, StepTimeGrowsByTheForwardsOnTheCriticalPath) {
  for (int p : {2, 4}) {
    for (int m : {1, 4, 8}) {
      const auto g = PipelineGraph::chain(p);
      const double F = 1.5, B = 2;
      const Costs c = Costs::uniform(p, F, B);
      const auto tl = simulate(lower(g, with_recompute(gpipe(p, p, m)), c), c);
      // The last stage recomputes each microbatch before its backward; the
      // other ranks recompute while they wait for the gradient.
      EXPECT_DOUBLE_EQ(tl.step_time(), (m + p - 1) * (F + B) + m * F)
          << "p=" << p << " m=" << m;
      double busy = 0;
      for (const double b : tl.busy_time()) busy += b;
      EXPECT_DOUBLE_EQ(busy, p * m * (2 * F + B));
    }
  }
}

}  // namespace
}  // namespace torchmpmd
