// libFuzzer target: arbitrary bytes become a pipeline graph and a schedule
// (placement and per-rank task lists, fused tasks among them, mostly
// nonsense); validation, lowering and simulation must either accept them or
// throw torchmpmd::Error, never crash, hang or trip a sanitizer.
//
//   cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
//         -DTORCHMPMD_FUZZ=ON -DTORCHMPMD_BUILD_TESTS=OFF
//   cmake --build build/fuzz && build/fuzz/fuzz_lower -max_total_time=60
#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "schedule/simulate.h"
#include "util/check.h"

namespace {

class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t next() { return pos_ < size_ ? data_[pos_++] : 0; }
  bool done() const { return pos_ >= size_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace torchmpmd::schedule;
  Bytes in(data, size);
  const int32_t stages = 1 + in.next() % 6;
  const int32_t ranks = 1 + in.next() % 4;
  const int32_t mbs = 1 + in.next() % 5;
  PipelineGraph graph;
  graph.num_stages = stages;
  const int32_t edges = in.next() % 8;
  for (int32_t e = 0; e < edges; ++e) {
    const int32_t src = in.next() % stages;
    const int32_t dst = in.next() % (stages + 1);  // may be invalid
    graph.edges.push_back(
        {in.next() % 4, src, dst, 1 + in.next() % 64, (in.next() & 1) != 0});
  }
  if (in.next() & 1) {
    graph.tied.push_back({99, {0, stages - 1}, 8});
  }
  ScheduleSpec spec;
  spec.num_ranks = ranks;
  spec.num_microbatches = mbs;
  spec.forward_only = (in.next() % 8) == 0;
  for (int32_t s = 0; s < stages; ++s) {
    spec.placement.push_back(in.next() % (ranks + 1) - (in.next() % 16 == 0));
  }
  spec.tasks.resize(ranks);
  while (!in.done()) {
    const uint8_t b = in.next();
    Task t{static_cast<TaskKind>(b % kNumTaskKinds), in.next() % (stages + 1),
           in.next() % (mbs + 1)};
    auto& list = spec.tasks[(b >> 2) % ranks];
    // Now and then fused with the rank's last task (a fused part, or a
    // single part, now and then too: both must be refused).
    const uint8_t f = in.next();
    if (f % 4 != 0 || list.empty()) {
      if (f % 64 == 1) t.parts = {t};
      list.push_back(t);
    } else if (!list.back().fused()) {
      Task whole(list.back().kind, list.back().stage, list.back().microbatch);
      whole.parts = {list.back(), t};
      list.back() = whole;
    } else {
      if (f % 32 == 0) t.parts = {t, t};
      list.back().parts.push_back(t);
    }
  }
  try {
    graph.finalize();
    Costs costs = Costs::uniform(stages);
    // Half the time, a measured time for every fused task.
    if (size % 2 == 0) {
      for (const auto& list : spec.tasks) {
        for (const Task& t : list) {
          if (t.fused()) costs.fused_time[fused_cost_key(t)] = 0.5;
        }
      }
    }
    const Program program = lower(graph, spec, costs);
    const Timeline tl = simulate(program, costs);
    if (tl.step_time() < 0) __builtin_trap();
  } catch (const torchmpmd::Error&) {
    // Rejected with a message: the expected outcome for bad input.
  }
  return 0;
}
