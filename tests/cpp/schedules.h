// Reference schedules for the C++ tests (the Python built-ins produce the
// same lists).
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "schedule/program.h"
#include "util/check.h"

namespace torchmpmd::testing {

using schedule::ScheduleSpec;
using schedule::Task;
using schedule::TaskKind;

inline Task F(int s, int m) { return {TaskKind::kForward, s, m}; }
inline Task B(int s, int m) { return {TaskKind::kBackward, s, m}; }
inline Task I(int s, int m) { return {TaskKind::kInputGrad, s, m}; }
inline Task W(int s, int m) { return {TaskKind::kWeightGrad, s, m}; }
inline Task R(int s, int m) { return {TaskKind::kRecompute, s, m}; }

// The error lowering `s` raises, or "<no error>".
inline std::string lower_error(const schedule::PipelineGraph& g,
                               const ScheduleSpec& s) {
  try {
    schedule::lower(g, s, schedule::Costs::uniform(g.num_stages));
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

inline std::vector<int32_t> loop_placement(int stages, int ranks) {
  std::vector<int32_t> p(stages);
  for (int s = 0; s < stages; ++s) p[s] = s % ranks;
  return p;
}

// All forwards of the rank's stages (stage-major), then all backwards.
inline ScheduleSpec gpipe(int stages, int ranks, int mbs) {
  ScheduleSpec spec{ranks, mbs, loop_placement(stages, ranks), {}, false, {}};
  spec.tasks.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    for (int s = r; s < stages; s += ranks) {
      for (int m = 0; m < mbs; ++m) spec.tasks[r].push_back(F(s, m));
    }
    for (int s = stages - ranks + r; s >= 0; s -= ranks) {
      if (s % ranks != r) continue;
      for (int m = 0; m < mbs; ++m) spec.tasks[r].push_back(B(s, m));
    }
  }
  return spec;
}

// Classic 1F1B, one stage per rank.
inline ScheduleSpec one_f_one_b(int ranks, int mbs) {
  ScheduleSpec spec{ranks, mbs, loop_placement(ranks, ranks), {}, false, {}};
  spec.tasks.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    const int warmup = std::min(ranks - r - 1, mbs);
    int f = 0;
    int b = 0;
    for (; f < warmup; ++f) spec.tasks[r].push_back(F(r, f));
    while (f < mbs) {
      spec.tasks[r].push_back(F(r, f++));
      spec.tasks[r].push_back(B(r, b++));
    }
    while (b < mbs) spec.tasks[r].push_back(B(r, b++));
  }
  return spec;
}

// ZB-H1 (Qi et al.): 1F1B with the backward split in I and W; rank r keeps
// up to r weight-gradient passes pending, which fills the cool-down bubble.
inline ScheduleSpec zb_h1(int ranks, int mbs) {
  ScheduleSpec spec{ranks, mbs, loop_placement(ranks, ranks), {}, false, {}};
  spec.tasks.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    auto& l = spec.tasks[r];
    const int warmup = std::min(ranks - r - 1, mbs);
    int f = 0, i = 0, w = 0;
    for (; f < warmup; ++f) l.push_back(F(r, f));
    while (f < mbs) {
      l.push_back(F(r, f++));
      l.push_back(I(r, i++));
      if (i - w > r) l.push_back(W(r, w++));
    }
    while (i < mbs) {
      l.push_back(I(r, i++));
      if (i - w > r) l.push_back(W(r, w++));
    }
    while (w < mbs) l.push_back(W(r, w++));
  }
  return spec;
}

// `spec` with a recompute R(s, m) right before each B(s, m) or I(s, m).
inline ScheduleSpec with_recompute(ScheduleSpec spec) {
  for (auto& list : spec.tasks) {
    std::vector<Task> out;
    for (const Task& t : list) {
      if (t.kind == TaskKind::kBackward || t.kind == TaskKind::kInputGrad) {
        out.push_back(R(t.stage, t.microbatch));
      }
      out.push_back(t);
    }
    list = std::move(out);
  }
  return spec;
}

}  // namespace torchmpmd::testing
