// Lowering a schedule (per-rank task lists + stage placement) to a Program:
// per rank, an instruction list with the sends and receives every task needs.
//
// The lowering simulates the schedule once to get one global order of all
// tasks (JaxPP's approach). Each send is placed right after the task that
// produces its payload, and the matching receive at the same point of the
// global order on the receiving rank. Projecting that one order onto every
// rank means that for every pair of ranks, sends and receives appear in the
// same order on both sides, so a program that passes the simulation cannot
// deadlock on NCCL or Gloo. A receive's position only fixes that order: the
// executor posts it as early as the pair order allows and waits for it only
// when the task that reads it starts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graph/stage_graph.h"
#include "schedule/task.h"

namespace torchmpmd::schedule {

// One value crossing from `src` to `dst` stage (a Transfer fans out into one
// Edge per destination stage).
struct Edge {
  int32_t value = -1;
  int32_t src = -1;
  int32_t dst = -1;
  int64_t bytes = 0;
  bool requires_grad = false;
};

// A parameter held by several stages whose gradients must be summed.
struct TiedGroup {
  int32_t id = -1;  // the parameter's node id in the stage graph
  std::vector<int32_t> stages;
  int64_t bytes = 0;
};

// The stage-level dataflow a schedule is lowered against.
struct PipelineGraph {
  int32_t num_stages = 0;
  std::vector<Edge> edges;
  std::vector<TiedGroup> tied;

  static PipelineGraph from_plan(const graph::StagePlan& plan);
  // stage i -> stage i+1, one value each (value id = i), for tests and demos.
  static PipelineGraph chain(int32_t num_stages, int64_t bytes = 1);

  // Indices into `edges`, per stage; filled by finalize().
  std::vector<std::vector<int32_t>> in_edges;
  std::vector<std::vector<int32_t>> out_edges;
  // Checks edges and tied groups and fills in_edges/out_edges.
  void finalize();
};

struct ScheduleSpec {
  int32_t num_ranks = 0;
  int32_t num_microbatches = 0;
  std::vector<int32_t> placement;        // stage -> rank
  std::vector<std::vector<Task>> tasks;  // per rank, in execution order
  bool forward_only = false;             // F tasks only (evaluation)
};

// Per-stage costs used to order tasks and to predict timelines. Any unit
// works as long as it is the same for all fields (microseconds is typical).
struct Costs {
  std::vector<double> forward;      // per stage
  std::vector<double> backward;     // B
  std::vector<double> input_grad;   // I
  std::vector<double> weight_grad;  // W
  // Bytes of activations one microbatch keeps alive on a stage from F until
  // its backward; W-only bytes are what stays after I, until W.
  std::vector<int64_t> activation_bytes;
  std::vector<int64_t> weight_grad_bytes;
  double latency = 0;         // per message
  double bytes_per_unit = 0;  // link bandwidth; 0 = infinitely fast
  bool overlap_comm = true;   // sends run in the background

  // F = 1, B = 2, I = W = 1 per stage, free communication.
  static Costs uniform(int32_t num_stages, double forward = 1,
                       double backward = 2, double input_grad = 1,
                       double weight_grad = 1);
  double of(const Task& task) const;
  double transfer_time(int64_t bytes) const;
  void check(int32_t num_stages) const;
};

enum class Op : uint8_t {
  kCompute,     // run `task`
  kSend,        // start sending `payload` to `peer`
  kRecv,        // post the receive of `payload` from `peer`
  kReduceTied,  // sum the tied gradient of group `value` over its holders
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
  int32_t value = -1;  // value id, or tied parameter id
  int32_t microbatch = -1;
  int32_t src_stage = -1;  // the stage that produced the value
  // kActivation: consumer stages on the receiving rank. kGrad: consumer
  // stages on the sending rank whose gradient contributions it carries.
  // kTiedGrad: the holder stages on the sending rank.
  std::vector<int32_t> stages;
  int64_t bytes = 0;
  int64_t tag = 0;  // position in the pair's message sequence, same both ends
};

std::string to_string(const Instruction& ins);

// Whether `user` (a compute or reduce instruction of a rank) reads what the
// receive `recv` of the same rank delivers: an activation read by the
// forward of a consumer stage, a gradient by the backward (B or I) of the
// producing stage, a tied gradient by the reduce of that parameter.
bool reads(const Instruction& user, const Instruction& recv);

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

// Checks a schedule without running it: placement, every task present exactly
// once, tasks on the rank that holds their stage, and dependencies between
// tasks of one rank. Throws torchmpmd::Error with the offending tasks named
// and a per-rank grid marking the spot.
void validate(const PipelineGraph& graph, const ScheduleSpec& spec);

// validate(), then orders all tasks by simulating them with `costs`, and
// inserts the sends and receives. A schedule in which no rank can make
// progress (deadlock, or a cross-rank dependency broken) is rejected with
// the per-rank grid of where each rank stopped and what it waits for.
Program lower(const PipelineGraph& graph, const ScheduleSpec& spec,
              const Costs& costs);

// The per-rank grid of a schedule, one line per rank in action format
// ("0F0 0F1 0B0"), with `marks` (rank, position) bracketed.
std::string render_grid(const ScheduleSpec& spec,
                        const std::vector<std::pair<int32_t, int32_t>>& marks);

}  // namespace torchmpmd::schedule
