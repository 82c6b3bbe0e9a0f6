// The task-kind table is the one place kinds are defined: its rows must be
// consistent, and the action format, costs, reads() and dependencies must
// follow it rather than a list of their own.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "schedule/program.h"
#include "schedules.h"
#include "util/check.h"

namespace torchmpmd {
namespace {

using schedule::Costs;
using schedule::Instruction;
using schedule::Op;
using schedule::Payload;
using schedule::task_kinds;
using schedule::TaskKindInfo;
using namespace torchmpmd::testing;
using ::testing::HasSubstr;

TEST(TaskKinds, RowsAreInEnumOrderWithDistinctLetters) {
  ASSERT_EQ(task_kinds().size(), static_cast<size_t>(schedule::kNumTaskKinds));
  std::set<char> letters;
  for (size_t k = 0; k < task_kinds().size(); ++k) {
    const TaskKindInfo& row = task_kinds()[k];
    EXPECT_EQ(static_cast<size_t>(row.kind), k);
    EXPECT_TRUE(letters.insert(row.letter).second) << row.letter;
    // Charged as a kind of its own, or as one that is.
    EXPECT_EQ(schedule::info(row.charged_as).charged_as, row.charged_as)
        << row.letter;
    EXPECT_EQ(schedule::kind_from_letter(row.letter), row.kind);
    EXPECT_EQ(schedule::kind_letter(row.kind), row.letter);
  }
}

TEST(TaskKinds, EveryLetterRoundTripsThroughTheActionFormat) {
  for (const TaskKindInfo& row : task_kinds()) {
    const Task t{row.kind, 3, 7};
    EXPECT_EQ(schedule::parse_action(schedule::to_action(t)), t);
  }
  try {
    schedule::parse_action("1X2");
    ADD_FAILURE() << "accepted 1X2";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("unknown task kind 'X'; use F (forward), "
                                    "B (backward)"));
  }
}

TEST(TaskKinds, CostsComeFromTheRowTheTableCharges) {
  Costs c = Costs::uniform(2, 1.0, 2.0, 3.0, 4.0);
  c.time[static_cast<size_t>(TaskKind::kForward)][1] = 10;
  for (const TaskKindInfo& row : task_kinds()) {
    const Task t{row.kind, 1, 0};
    EXPECT_EQ(c.of(t), c.time[static_cast<size_t>(row.charged_as)][1])
        << row.letter;
  }
  EXPECT_EQ(c.of(F(1, 0)), 10);
  EXPECT_EQ(c.of(R(1, 0)), 10);  // charged as its forward
  EXPECT_EQ(c.of(W(0, 0)), 4);
  EXPECT_EQ(c.time[static_cast<size_t>(TaskKind::kRecompute)].size(), 0u);
}

TEST(TaskKinds, CostsNeedATimePerStageForEachKindOfItsOwn) {
  Costs c = Costs::uniform(2);
  c.check(2);
  c.time[static_cast<size_t>(TaskKind::kInputGrad)].pop_back();
  try {
    c.check(2);
    ADD_FAILURE() << "accepted a missing input grad time";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("one input grad time per stage (2 stages), "
                                    "got 1"));
  }
  c = Costs::uniform(2);
  c.time[static_cast<size_t>(TaskKind::kBackward)][0] = -1;
  EXPECT_THROW(c.check(2), Error);
}

TEST(TaskKinds, ReadsFollowsTheTable) {
  Instruction act;
  act.op = Op::kRecv;
  act.payload = Payload::kActivation;
  act.microbatch = 0;
  act.src_stage = 0;
  act.stages = {1};
  Instruction grad = act;
  grad.payload = Payload::kGrad;
  grad.src_stage = 1;
  for (const TaskKindInfo& row : task_kinds()) {
    Instruction user;
    user.task = {row.kind, 1, 0};
    EXPECT_EQ(schedule::reads(user, act), row.reads_activations) << row.letter;
    EXPECT_EQ(schedule::reads(user, grad), row.reads_grads) << row.letter;
    user.task.microbatch = 1;
    EXPECT_FALSE(schedule::reads(user, act));
    EXPECT_FALSE(schedule::reads(user, grad));
  }
}

TEST(TaskKinds, DependenciesFollowTheTable) {
  const auto g = schedule::PipelineGraph::chain(2);
  const schedule::Flow flow(g);
  ScheduleSpec split{
      2,      1,
      {0, 1}, {{F(0, 0), I(0, 0), W(0, 0)}, {F(1, 0), I(1, 0), W(1, 0)}},
      false,  {}};
  const auto pos = schedule::locate(g, split);
  using V = std::vector<Task>;
  EXPECT_EQ(schedule::dependencies(F(1, 0), flow, pos, false), V{F(0, 0)});
  // The input gradient of stage 1 comes from its I, as it has no B.
  EXPECT_EQ(schedule::dependencies(I(0, 0), flow, pos, false),
            (V{F(0, 0), I(1, 0)}));
  EXPECT_EQ(schedule::dependencies(W(0, 0), flow, pos, false), V{I(0, 0)});
  const auto full = schedule::locate(g, gpipe(2, 2, 1));
  EXPECT_EQ(schedule::dependencies(B(0, 0), flow, full, false),
            (V{F(0, 0), B(1, 0)}));
  EXPECT_EQ(schedule::dependencies(B(0, 0), flow, full, true), V{F(0, 0)});
}

TEST(TaskKinds, RecomputedForwardsKeepTheirInputsUntilTheWeightGradients) {
  // What simulate() charges a recomputed (stage, microbatch) for the inputs
  // its forward keeps comes from the table: the forward takes them, the
  // kinds finishing the weight gradients (B, or W after I) give them back.
  for (const TaskKindInfo& k : task_kinds()) {
    const int8_t kept = k.memory_if_recomputed.kept_inputs;
    EXPECT_EQ(k.memory.kept_inputs, 0) << k.letter;
    if (k.finishes_weight_grads) {
      EXPECT_EQ(kept, -1) << k.letter;
    } else if (k.required && k.emits_activations) {
      EXPECT_EQ(kept, +1) << k.letter;  // F
    } else {
      EXPECT_EQ(kept, 0) << k.letter;
    }
  }
}

TEST(TaskKinds, AFusedTaskIsItsPartsDependencies) {
  // A fused task has no row of its own: each part reads its kind's.
  const auto g = schedule::PipelineGraph::chain(2);
  const schedule::Flow flow(g);
  ScheduleSpec spec{2,
                    2,
                    {0, 1},
                    {{F(0, 0), F(0, 1), B(0, 0), B(0, 1)},
                     {F(1, 0), B(1, 0), F(1, 1), B(1, 1)}},
                    false,
                    {}};
  const auto pos = schedule::locate(g, spec);
  using V = std::vector<Task>;
  EXPECT_EQ(schedule::dependencies(schedule::fuse({F(1, 1), B(1, 0)}), flow,
                                   pos, false),
            (V{F(0, 1), F(1, 0)}));
  Instruction user;
  user.task = schedule::fuse({F(1, 1), B(0, 0)});
  Instruction act;
  act.op = Op::kRecv;
  act.payload = Payload::kActivation;
  act.microbatch = 1;
  act.stages = {1};
  Instruction grad = act;
  grad.payload = Payload::kGrad;
  grad.microbatch = 0;
  grad.src_stage = 0;
  EXPECT_TRUE(schedule::reads(user, act));   // its F(1, 1)
  EXPECT_TRUE(schedule::reads(user, grad));  // its B(0, 0)
  grad.microbatch = 1;
  EXPECT_FALSE(schedule::reads(user, grad));
}

}  // namespace
}  // namespace torchmpmd
