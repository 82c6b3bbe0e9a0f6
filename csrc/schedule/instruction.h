// A lowered schedule: per rank, an instruction list with the sends and
// receives every task needs (see lower.h for how it is built).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "schedule/pipeline_graph.h"
#include "schedule/task.h"

namespace torchmpmd::schedule {

enum class Op : uint8_t {
  kCompute,     // run `task`
  kSend,        // start sending `payload` to `peer`
  kRecv,        // post the receive of `payload` from `peer`
  kReduceTied,  // sum the tied gradient of group `value` over its holders
  // Data parallelism (ScheduleSpec::collectives) of stage `value`:
  kUnshard,      // gather its parameters (blocks the rank)
  kReduceGrads,  // start reducing its gradients (beside the compute)
};

enum class Payload : uint8_t {
  kActivation,  // value `value` of microbatch `microbatch`
  kGrad,        // gradient of value `value`, summed over `stages`
  kTiedGrad,    // gradient of tied parameter `value`
};

struct Instruction {
  Op op = Op::kCompute;
  Task task;  // kCompute
  Payload payload = Payload::kActivation;
  int32_t peer = -1;   // kSend/kRecv: the other rank
  int32_t value = -1;  // value id, tied parameter id, or stage
  int32_t microbatch = -1;
  int32_t src_stage = -1;  // the stage that produced the value
  // kActivation: consumer stages on the receiving rank. kGrad: consumer
  // stages on the sending rank whose gradient contributions it carries.
  // kTiedGrad: the holder stages on the sending rank.
  std::vector<int32_t> stages;
  int64_t bytes = 0;
  int64_t tag = 0;  // position in the pair's message sequence, same both ends
  // kSend right after a fused task that runs part by part (machine.h): the
  // index of the part whose end it leaves at; -1 otherwise (it leaves after
  // the task).
  int32_t part = -1;
};

std::string to_string(const Instruction& ins);

// A data-parallel collective's name, as timelines label it: "unshard" or
// "reduce_grads" (`op` is kUnshard or kReduceGrads).
const char* collective_name(Op op);

// Whether `user` (a compute or reduce instruction of a rank) reads what the
// receive `recv` of the same rank delivers: an activation read by a kind
// that reads activations (F) of a consumer stage, a gradient by a kind that
// reads gradients (B, I) of the producing stage, a tied gradient by the
// reduce of that parameter. A fused task reads what any of its parts reads.
bool reads(const Instruction& user, const Instruction& recv);
// Whether a compute of `task` reads what the receive `recv` delivers.
bool reads(const Task& task, const Instruction& recv);

struct Program {
  ScheduleSpec spec;
  PipelineGraph graph;
  std::vector<std::vector<Instruction>> ranks;
  // The global order the lowering chose: (rank, index into ranks[rank]).
  std::vector<std::pair<int32_t, int32_t>> order;

  int32_t num_ranks() const { return static_cast<int32_t>(ranks.size()); }
  int32_t num_stages() const { return graph.num_stages; }
  int32_t rank_of(int32_t stage) const { return spec.placement.at(stage); }
};

}  // namespace torchmpmd::schedule
