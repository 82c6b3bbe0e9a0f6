// Fused (composite) tasks: their action format must round-trip; validation
// must refuse malformed ones naming rank, task and part; lowering must put
// every part's receives before the task and its parts' sends after it, and
// treat it as one step in the deadlock check; the simulator must charge the
// sum of the parts by default (DualPipeV's pairs take the time they took as
// separate tasks) and a measured time when one is given.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <sstream>

#include "schedule/simulate.h"
#include "schedules.h"
#include "util/check.h"

namespace torchmpmd {
namespace {

using schedule::Costs;
using schedule::EventKind;
using schedule::fuse;
using schedule::Instruction;
using schedule::lower;
using schedule::Op;
using schedule::parse_action;
using schedule::PipelineGraph;
using schedule::Program;
using schedule::simulate;
using schedule::Timeline;
using schedule::to_action;
using namespace torchmpmd::testing;
using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

// Per rank, a line of actions ("0F0 (0F1;3B0)OVERLAP_F_B ...").
std::vector<std::vector<Task>> parse_lists(
    const std::vector<std::string>& lines) {
  std::vector<std::vector<Task>> out;
  for (const std::string& line : lines) {
    std::istringstream words(line);
    std::vector<Task> tasks;
    for (std::string w; words >> w;) tasks.push_back(parse_action(w));
    out.push_back(std::move(tasks));
  }
  return out;
}

// The same lists with each fused task replaced by its parts, in order.
std::vector<std::vector<Task>> unfused(
    const std::vector<std::vector<Task>>& lists) {
  std::vector<std::vector<Task>> out;
  for (const auto& list : lists) {
    std::vector<Task> flat;
    for (const Task& t : list) {
      for (const Task& p : t.simple_parts()) flat.push_back(p);
    }
    out.push_back(std::move(flat));
  }
  return out;
}

// 4 stages in a V on 2 ranks (stages 0 and 3 on rank 0), as DualPipeV.
const std::vector<int32_t> kV = {0, 1, 1, 0};

// DualPipeV's task lists for 2 ranks and 4 microbatches
// (torchmpmd.schedules.DualPipeV(4).tasks(4, 2, 4)).
ScheduleSpec dual_pipe_v() {
  const std::string fused = "OVERLAP_F_B";
  ScheduleSpec spec{2, 4, kV, {}, false, {}};
  spec.tasks = parse_lists({
      "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1)" + fused + " (3F2;0B0)" + fused +
          " 3B2 (3F3;0B1)" + fused + " 3B3 0I2 0W2 0I3 0W3",
      "1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0)" + fused + " (1F3;2B1)" + fused +
          " (2F3;1B1)" + fused + " 2B2 1B2 2I3 1I3 2W3 1W3",
  });
  return spec;
}

TEST(Fused, ActionFormatIsTorchsOverlapFB) {
  const Task t = fuse({F(0, 3), B(3, 1)});
  EXPECT_TRUE(t.fused());
  EXPECT_EQ(to_action(t), "(0F3;3B1)OVERLAP_F_B");
  EXPECT_EQ(schedule::to_string(t), "F(stage=0, mb=3)+B(stage=3, mb=1)");
  EXPECT_EQ(schedule::fused_cost_key(t), "0F;3B");
  EXPECT_EQ(parse_action("(0F3;3B1)OVERLAP_F_B"), t);
  // A fused task answers its first part's kind, stage and microbatch, but is
  // not that part.
  EXPECT_EQ(t.kind, TaskKind::kForward);
  EXPECT_EQ(t.stage, 0);
  EXPECT_EQ(t.microbatch, 3);
  EXPECT_NE(t, F(0, 3));
  EXPECT_EQ(t.simple_parts().size(), 2u);
  EXPECT_EQ(F(0, 3).simple_parts().size(), 1u);
  EXPECT_EQ(*F(0, 3).simple_parts().begin(), F(0, 3));
}

TEST(Fused, MalformedActionsAndFusionsAreRefused) {
  EXPECT_THAT(error_of([] { parse_action("(0F3)OVERLAP_F_B"); }),
              HasSubstr("two or more parts"));
  EXPECT_THAT(error_of([] { parse_action("(0F3;3B1)OVERLAP"); }),
              HasSubstr("expected OVERLAP_F_B after the parts"));
  EXPECT_THAT(error_of([] { parse_action("(0F3;3X1)OVERLAP_F_B"); }),
              HasSubstr("unknown task kind 'X'"));
  EXPECT_THAT(error_of([] { parse_action("(0F3;3B1"); }),
              HasSubstr("between parentheses"));
  EXPECT_THAT(error_of([] { fuse({F(0, 0)}); }),
              HasSubstr("needs two or more parts, got 1"));
  EXPECT_THAT(error_of([] {
                fuse({F(0, 0), fuse({F(0, 1), B(0, 0)})});
              }),
              HasSubstr("part 2 of a fused task is fused itself"));
}

// 2 stages on 2 ranks, 2 microbatches: rank 0 fuses its second forward with
// its first backward.
ScheduleSpec fused_1f1b() {
  ScheduleSpec spec{2, 2, {0, 1}, {}, false, {}};
  spec.tasks = {{F(0, 0), fuse({F(0, 1), B(0, 0)}), B(0, 1)},
                {F(1, 0), B(1, 0), F(1, 1), B(1, 1)}};
  return spec;
}

TEST(Fused, PartsCountAsTasksOfTheirOwn) {
  const auto g = PipelineGraph::chain(2);
  EXPECT_EQ(lower_error(g, fused_1f1b()), "<no error>");
  // F(0, 1) inside the fused task and again alone.
  ScheduleSpec twice = fused_1f1b();
  twice.tasks[0].push_back(F(0, 1));
  EXPECT_THAT(lower_error(g, twice),
              HasSubstr("task F(stage=0, mb=1) appears twice (rank 0 position "
                        "1 and rank 0 position 3)"));
  // Without B(0, 1) the backward of (0, 1) is missing, whatever is fused.
  ScheduleSpec missing = fused_1f1b();
  missing.tasks[0].pop_back();
  EXPECT_THAT(lower_error(g, missing),
              HasSubstr("stage 0 microbatch 1 has no backward"));
}

TEST(Fused, ValidationRefusesMalformedFusedTasks) {
  const auto g = PipelineGraph::chain(2);
  // Its parts depend on one another: B(0, 0) needs F(0, 0).
  ScheduleSpec dependent{2, 1, {0, 1}, {}, false, {}};
  dependent.tasks = {{fuse({F(0, 0), B(0, 0)})}, {F(1, 0), B(1, 0)}};
  EXPECT_THAT(
      lower_error(g, dependent),
      HasSubstr("schedule: rank 0 position 0: fused task "
                "(0F0;0B0)OVERLAP_F_B has part B(stage=0, mb=0) depending on "
                "its part F(stage=0, mb=0); a part may depend only on an "
                "earlier part of its own side (the forward parts are one "
                "side, the rest the other: the two may run at once): "
                "schedule 0F0 as a task before it"));
  // On one side, a part may depend on an earlier one (a recompute right
  // before its backward, as with_recompute puts it beside a forward), not
  // on a later one.
  ScheduleSpec recomputed{2, 2, {0, 1}, {}, false, {}};
  recomputed.tasks = {
      {F(0, 0), fuse({F(0, 1), R(0, 0), B(0, 0)}), R(0, 1), B(0, 1)},
      {F(1, 0), B(1, 0), F(1, 1), B(1, 1)}};
  EXPECT_EQ(lower_error(g, recomputed), "<no error>");
  EXPECT_EQ(schedule::lanes(recomputed.tasks[0][1]),
            (std::vector<int32_t>{1, 0, 0}));
  ScheduleSpec backwards = recomputed;
  backwards.tasks[0][1] = fuse({F(0, 1), B(0, 0), R(0, 0)});
  EXPECT_THAT(lower_error(g, backwards),
              HasSubstr("has part B(stage=0, mb=0) depending on its part "
                        "R(stage=0, mb=0)"));
  // A part on a stage of another rank.
  ScheduleSpec elsewhere{2, 2, {0, 1}, {}, false, {}};
  elsewhere.tasks = {{F(0, 0), F(0, 1), B(0, 0), B(0, 1)},
                     {fuse({F(1, 0), F(0, 1)}), F(1, 1), B(1, 0), B(1, 1)}};
  EXPECT_THAT(lower_error(g, elsewhere),
              HasSubstr("schedule: rank 1 position 0: part F(stage=0, mb=1) of "
                        "fused task (1F0;0F1)OVERLAP_F_B is on rank 1, but "
                        "stage 0 is placed on rank 0: all parts of a fused "
                        "task run on one rank"));
  // Built around fuse(): one part, and a fused part.
  ScheduleSpec one = fused_1f1b();
  one.tasks[0][1].parts = {F(0, 1)};
  EXPECT_THAT(lower_error(g, one),
              HasSubstr("schedule: rank 0 position 1: fused task "
                        "F(stage=0, mb=1) has 1 part; a fused task needs two "
                        "or more"));
  ScheduleSpec nested = fused_1f1b();
  nested.tasks[0][1].parts[1].parts = {B(0, 0), F(0, 1)};
  EXPECT_THAT(lower_error(g, nested),
              HasSubstr("schedule: rank 0 position 1: part 2 of fused task"));
  EXPECT_THAT(lower_error(g, nested), HasSubstr("fused tasks do not nest"));
}

TEST(Fused, DeadlockCheckNeedsAllInputsBeforeTheTaskStarts) {
  const auto g = PipelineGraph::chain(2);
  // Fused with B(0, 0), F(0, 1) waits for B(1, 0)'s gradient, which rank 1
  // computes only after F(1, 1), which waits for F(0, 1).
  ScheduleSpec cycle{2, 2, {0, 1}, {}, false, {}};
  cycle.tasks = {{F(0, 0), fuse({F(0, 1), B(0, 0)}), B(0, 1)},
                 {F(1, 1), F(1, 0), B(1, 0), B(1, 1)}};
  EXPECT_THAT(lower_error(g, cycle),
              HasSubstr("schedule: deadlock: no rank can run its next task"));
  EXPECT_THAT(lower_error(g, cycle),
              HasSubstr("rank 0 waits at (0F1;0B0)OVERLAP_F_B for 1B0"));
  // Apart, the same order runs: F(0, 1) first feeds rank 1.
  ScheduleSpec cycle_apart = cycle;
  cycle_apart.tasks = unfused(cycle.tasks);
  EXPECT_EQ(lower_error(g, cycle_apart), "<no error>");
}

TEST(Fused, LoweringPutsReceivesBeforeAndSendsAfterTheTask) {
  const auto g = PipelineGraph::chain(4);
  const ScheduleSpec spec = dual_pipe_v();
  const Program prog = lower(g, spec, Costs::uniform(4));
  std::map<std::string, int> reads;
  std::map<std::string, std::vector<int32_t>> sends;
  for (int32_t r = 0; r < 2; ++r) {
    const auto& code = prog.ranks[r];
    // One compute instruction per listed task, fused ones as one.
    std::vector<Task> computed;
    for (const Instruction& ins : code) {
      if (ins.op == Op::kCompute) computed.push_back(ins.task);
    }
    EXPECT_EQ(computed, spec.tasks[r]) << "rank " << r;
    for (size_t i = 0; i < code.size(); ++i) {
      if (code[i].op != Op::kCompute || !code[i].task.fused()) continue;
      const std::string name = to_action(code[i].task);
      // Every receive one of its parts reads comes before it, none after.
      for (size_t j = 0; j < code.size(); ++j) {
        if (!schedule::reads(code[i], code[j])) continue;
        EXPECT_LT(j, i) << name << " reads " << to_string(code[j]);
        ++reads[name];
      }
      // Right after it: its parts' sends, in part order, each tagged with
      // the part that produced it.
      for (size_t j = i + 1; j < code.size() && code[j].op == Op::kSend; ++j) {
        const Task& part = code[i].task.parts.at(code[j].part);
        EXPECT_EQ(code[j].microbatch, part.microbatch) << to_string(code[j]);
        sends[name].push_back(code[j].part);
      }
    }
  }
  // Stage 3 reads stage 2's activation, stage 0 the gradient of stage 1's
  // input, both from rank 1; stages 0 and 3 send theirs to rank 1.
  EXPECT_EQ(reads["(3F2;0B0)OVERLAP_F_B"], 2);
  EXPECT_EQ(sends["(3F2;0B0)OVERLAP_F_B"], std::vector<int32_t>{});
  EXPECT_EQ(reads["(0F3;3B1)OVERLAP_F_B"], 0);
  EXPECT_EQ(sends["(0F3;3B1)OVERLAP_F_B"], (std::vector<int32_t>{0, 1}));
  // Rank 1's stages 1 and 2 hand over in memory: only across the V's tip.
  EXPECT_EQ(sends["(2F2;1B0)OVERLAP_F_B"], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(sends["(1F3;2B1)OVERLAP_F_B"], std::vector<int32_t>{});
}

TEST(Fused, SimulationChargesTheSumOfThePartsByDefault) {
  const auto g = PipelineGraph::chain(4);
  const ScheduleSpec spec = dual_pipe_v();
  ScheduleSpec apart = spec;
  apart.tasks = unfused(spec.tasks);
  for (const Costs& costs :
       {Costs::uniform(4), Costs::uniform(4, 1.0, 3.0, 1.5, 1.5)}) {
    Costs skewed = costs;
    skewed.time[0] = {1.0, 2.0, 1.5, 0.5};
    skewed.latency = 0.25;
    for (const Costs& c : {costs, skewed}) {
      const Timeline fused = simulate(lower(g, spec, c), c);
      const Timeline separate = simulate(lower(g, apart, c), c);
      EXPECT_DOUBLE_EQ(fused.step_time(), separate.step_time());
      EXPECT_EQ(fused.peak_activation_bytes, separate.peak_activation_bytes);
      // One compute event per fused task: its parts' times, and any wait
      // for a later part's inputs inside it (as the executor's record has
      // it), which makes the only difference in busy time.
      int fused_events = 0;
      std::vector<double> inside(2, 0.0);
      for (const auto& e : fused.events) {
        if (e.kind != EventKind::kCompute || !e.task.fused()) continue;
        ++fused_events;
        double waited = 0;
        for (const auto& w : fused.events) {
          if (w.kind == EventKind::kWait && w.rank == e.rank &&
              w.task == e.task && w.start >= e.start) {
            waited += w.end - w.start;
          }
        }
        inside[e.rank] += waited;
        EXPECT_DOUBLE_EQ(e.end - e.start,
                         c.of(e.task.parts[0]) + c.of(e.task.parts[1]) + waited)
            << to_action(e.task);
      }
      EXPECT_EQ(fused_events, 6);
      for (int32_t r = 0; r < 2; ++r) {
        EXPECT_DOUBLE_EQ(fused.busy_time()[r],
                         separate.busy_time()[r] + inside[r]);
      }
    }
  }
}

TEST(Fused, SimulationTakesAMeasuredFusedTime) {
  const auto g = PipelineGraph::chain(4);
  const ScheduleSpec spec = dual_pipe_v();
  Costs costs = Costs::uniform(4);
  const double sum = simulate(lower(g, spec, costs), costs).step_time();
  // F of one stage with B of the other overlapped: 2 units, not 1 + 2.
  for (const char* key : {"0F;3B", "3F;0B", "2F;1B", "1F;2B"}) {
    costs.fused_time[key] = 2.0;
  }
  const Timeline tl = simulate(lower(g, spec, costs), costs);
  EXPECT_LT(tl.step_time(), sum);
  int fused_events = 0;
  for (const auto& e : tl.events) {
    if (e.kind != EventKind::kCompute || !e.task.fused()) continue;
    ++fused_events;
    EXPECT_DOUBLE_EQ(e.end - e.start, 2.0) << to_action(e.task);
  }
  EXPECT_EQ(fused_events, 6);
  // Measured fused times are checked like the other costs.
  Costs bad = Costs::uniform(4);
  bad.fused_time["0F"] = 1.0;
  EXPECT_THAT(error_of([&] { bad.check(4); }), HasSubstr("has one part"));
  bad.fused_time = {{"0F;9B", 1.0}};
  EXPECT_THAT(error_of([&] { bad.check(4); }), HasSubstr("names stage 9"));
  bad.fused_time = {{"0F;3B", -1.0}};
  EXPECT_THAT(error_of([&] { bad.check(4); }), HasSubstr("must not be neg"));
  bad.fused_time = {{"F0;3B", 1.0}};
  EXPECT_THAT(error_of([&] { bad.check(4); }),
              HasSubstr("write each part as <stage><kind>"));
}

TEST(Fused, MemoryCountsEveryPartPeakAfterEach) {
  // A fused (F, B) holds the forward's activations before the backward frees
  // its own: the peak is that of the parts run apart.
  const auto g = PipelineGraph::chain(2);
  ScheduleSpec spec = fused_1f1b();
  ScheduleSpec apart = spec;
  apart.tasks = unfused(spec.tasks);
  const Costs costs = Costs::uniform(2);
  const Timeline fused = simulate(lower(g, spec, costs), costs);
  EXPECT_EQ(fused.peak_activation_bytes,
            simulate(lower(g, apart, costs), costs).peak_activation_bytes);
  EXPECT_EQ(fused.peak_activation_bytes[0], 2);
}

}  // namespace
}  // namespace torchmpmd
