// The executor: runs one rank's lowered program for one step.
//
// Contract. run() executes the rank's instructions in order. Receives are
// posted ahead of need (at most `max_early_recvs` at a time; on a
// pair-ordered transport (NCCL) never ahead of an earlier unsent message to
// the same peer, so the pair order the lowering fixed is kept; Gloo matches
// by tag, so there a receive is posted before the sender gets to its send
// and the data moves at once) and waited on only when a task reads them: a
// receive never blocks compute that does not depend on it. Sends start right
// after the producing task and complete in the background. Forward calls the
// stage's callable (which takes the GIL itself); backward runs through autograd
// with no Python involved. Activations, received tensors and gradients live in
// stores keyed by (value or stage, microbatch) and are freed at their last
// use; nothing survives into the next step. Every wait has the timeout of
// the options and fails with an error that names this rank, the peer, the
// stage, the microbatch and the task. A fused task is one task (one record,
// one profiler range): each part after the receives it reads, its sends as
// soon as it and the parts before it are done. Its parts run in order, or,
// for a fused task of forward and backward parts with
// StageFunctions::overlap, as two sides at once (the forward side on a
// thread of its own), so that one side's communication hides under the
// other's compute.
//
// Not thread-safe: one executor per rank, driven by one thread.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "runtime/transport.h"
#include "schedule/program.h"

namespace torchmpmd::runtime {

// A value that crosses stages, as the stage plan describes it.
struct ValueInfo {
  int32_t id = -1;
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  bool requires_grad = false;
};

// What a stage reads from and writes to other stages (value ids, in the
// order of its callable's received inputs and sent outputs).
struct StageInfo {
  int32_t id = -1;
  std::vector<int32_t> inputs;
  std::vector<int32_t> outputs;
  bool has_loss = false;  // training: the callable appends the loss
  // Backward runs as separate input- and weight-gradient callables (I/W)
  // instead of through autograd; forward then also returns what they need.
  bool split = false;
};

// A step failed: a peer died or stalled, a task raised, or a microbatch did
// not match the plan. The message names rank, peer, stage, microbatch, task.
class PipelineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// forward(stage, microbatch, received inputs) -> the stage's sent outputs,
// then (has_loss and training) the scalar to start backward from.
// Split stages append the tensors their backward needs ("saved").
using ForwardFn = std::function<std::vector<at::Tensor>(
    int32_t stage, int32_t microbatch, const std::vector<at::Tensor>& inputs)>;

// Split stages only. input_grad(stage, mb, saved, output grads) -> the
// gradients of the stage's inputs that require grad (in input order), then
// what weight_grad needs. Output grads are aligned with the sent outputs
// (undefined for outputs without a gradient); the loss's is implied.
using InputGradFn = std::function<std::vector<at::Tensor>(
    int32_t stage, int32_t microbatch, const std::vector<at::Tensor>& saved,
    const std::vector<at::Tensor>& output_grads)>;
// weight_grad(stage, mb, saved) accumulates into the parameters' .grad.
using WeightGradFn = std::function<void(int32_t stage, int32_t microbatch,
                                        const std::vector<at::Tensor>& saved)>;

struct StageFunctions {
  ForwardFn forward;
  InputGradFn input_grad;    // needed if any stage is split
  WeightGradFn weight_grad;  // needed if any stage is split
  // The shape of (value, microbatch) where this step's microbatch differs
  // from the plan's (a smaller last microbatch); receives of that value and
  // its gradient are allocated, and sends checked, with it.
  std::map<std::pair<int32_t, int32_t>, std::vector<int64_t>> shapes;
  // Optional: a local stage's data-parallel collectives, run where the
  // program has them (ScheduleSpec::collectives): `unshard(stage)` before
  // the stage's first task of the step, `stage_done(stage)` right after the
  // task that finishes its weight gradients (its last B or W), to start
  // their reduction while the rest of the schedule runs.
  std::function<void(int32_t stage)> unshard;
  std::function<void(int32_t stage)> stage_done;
  // Optional: `grads_start(stage)` right before the task (or fused part)
  // after which `stage_done(stage)` runs, so that the data parallelism can
  // reduce each gradient as that last backward makes it final (DDP's
  // overlap) instead of all of them after it.
  std::function<void(int32_t stage)> grads_start;
  // Whether a recompute (R) replays its forward's random numbers by saving
  // and restoring the device's default generator. False when the forward
  // callable replays them itself (ranks as threads, each with a generator
  // state of its own: setting the shared one would disturb another rank).
  bool replay_rng = true;
  // Fused tasks of a forward and a backward side (DualPipeV's F&B) run
  // their sides at once: the forward side's parts on a thread of their
  // own, lane 1 (`current_lane`), the rest on the calling thread. Their
  // collectives inside the stage (expert parallelism's all-to-alls) pick a
  // process group per lane, so each group sees one side's collectives in
  // program order on every rank; those of tensor parallelism cannot, so a
  // runner with tp passes false. Results are those of the parts run in
  // order, bit for bit: the sides share nothing but the step's state (held
  // by one side at a time) and the random generator (at most one side may
  // draw from it, learnt from each stage's first forward; else in order).
  // Run in order anyway: with memory measured, on a device, without
  // replay_rng.
  bool overlap = false;
  // Stages whose backward sets the random generator's state itself
  // (torch.utils.checkpoint replaying a selective recompute's numbers):
  // their B, I and W count as drawing for `overlap`.
  std::set<int32_t> backward_rng;
};

// The side of a fused task the calling thread runs: 1 for the forward
// parts of a fused task that also has backward parts (whether or not the
// sides run at once), 0 otherwise.
int32_t current_lane();

// Sets current_lane() for the scope.
class LaneScope {
 public:
  explicit LaneScope(int32_t lane);
  ~LaneScope();
  LaneScope(const LaneScope&) = delete;
  LaneScope& operator=(const LaneScope&) = delete;

 private:
  int32_t before_;
};

struct ExecutorOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  int32_t max_early_recvs = 64;
  bool training = true;
  at::Device device = at::kCPU;
  // Measure the bytes the step holds for its backward (memory.h): each
  // record's held and kept bytes, and the step's peak.
  bool measure_memory = false;
};

// A task as it ran: nanoseconds since the step started (on a device, as
// the device ran it, from events recorded around the task on its stream).
struct TaskRecord {
  // A fused task has one record covering its parts.
  schedule::Task task;
  // kCompute: a task; kUnshard / kReduceGrads: a data-parallel collective of
  // stage task.stage (microbatch -1).
  schedule::Op op = schedule::Op::kCompute;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  int64_t waited_ns = 0;  // spent waiting for its receives before start
  // With ExecutorOptions::measure_memory, else -1. held: the bytes every
  // local stage held for its backward right after this task. kept: what the
  // task's (stage, microbatch) held: after F or R, what the forward left;
  // before B, I or W, what it kept until then (-1 for a fused task).
  int64_t held_bytes = -1;
  int64_t kept_bytes = -1;
  // A fused task's parts as they ran (host clock, on CPU; empty on a
  // device): when each started and ended, and its lane (current_lane).
  struct PartTime {
    int64_t start_ns = 0;
    int64_t end_ns = 0;
    int32_t lane = 0;
    PartTime(int64_t s, int64_t e, int32_t l)
        : start_ns(s), end_ns(e), lane(l) {}
  };
  std::vector<PartTime> parts;
};

class Executor {
 public:
  Executor(int32_t rank, const schedule::Program& program,
           std::vector<StageInfo> stages, std::vector<ValueInfo> values,
           std::shared_ptr<Transport> transport,
           std::map<int32_t, at::Tensor> tied_parameters,
           ExecutorOptions options);
  ~Executor();

  // Runs one step with the stage callables of that step (they carry its
  // data: inputs, targets, where losses go). Blocks until the rank's program
  // is done and every send it started has completed. Throws PipelineError on
  // failure.
  void run(const StageFunctions& functions);

  // The tasks of the last run, in execution order.
  const std::vector<TaskRecord>& records() const { return records_; }
  // Wall-clock time (ns since the Unix epoch) at which the last run started,
  // to line up records of different ranks.
  int64_t step_start_unix_ns() const { return step_start_unix_ns_; }
  int32_t rank() const { return rank_; }
  // The most bytes the last run held for backward at once (between tasks),
  // or -1 if it was not measured (measure_memory off, or a profiler held
  // the allocator's reporting hook).
  int64_t peak_held_bytes() const { return peak_held_bytes_; }
  // The bytes the last run sent to and received from its peers (every
  // message: activations, gradients, tied gradients), counted as the
  // messages were posted.
  int64_t sent_bytes() const { return sent_bytes_; }
  int64_t received_bytes() const { return received_bytes_; }

 private:
  struct State;
  // How a task kind runs; task_fn() maps every kind of the task-kind table.
  using TaskFn = void (Executor::*)(const schedule::Task&, State&);
  static TaskFn task_fn(schedule::TaskKind kind);
  void execute(size_t pc, State& st);
  // Runs the simple task `part` (`task` itself, or one of its parts if it is
  // fused); with memory measured, returns what its (stage, microbatch) kept
  // (else -1). Errors name the part and the fused task.
  int64_t run_part(const schedule::Task& task, const schedule::Task& part,
                   State& st);
  // Whether fused `task`'s sides run at once this time.
  bool overlaps(const schedule::Task& task, const std::vector<int32_t>& lanes,
                const State& st) const;
  // Part k of the compute at `pc`: the receives it reads and its gradient
  // start, before it; its sends, after it.
  void before_part(size_t pc, size_t k, State& st);
  void send_part(size_t pc, size_t k, State& st);
  // Runs the two sides of fused task `pc` at once, the forward side's parts
  // on a thread of their own.
  void run_sides(size_t pc, const std::vector<int32_t>& lanes, State& st);
  at::Tensor generator_state() const;
  void post_early(size_t pc, State& st);
  void post_recv(size_t index, State& st);
  void wait_recv(size_t index, State& st, const schedule::Instruction& user);
  // Completes the sends that are done (all: waits for every one).
  void reap_sends(State& st, bool all);
  // Fills delivered_by_ from the whole program.
  void find_replies();
  // Device runs: waits (bounded) for the step's queued work, then takes the
  // task times from the device's events.
  void finish_on_device(State& st);
  void forward(const schedule::Task& task, State& st);
  void recompute(const schedule::Task& task, State& st);
  // Runs the stage's callable on `inputs`; with `keep`, keeps what its
  // backward needs (autograd leaves and outputs, or the split "saved").
  std::vector<at::Tensor> call_forward(const schedule::Task& task,
                                       std::vector<at::Tensor> inputs,
                                       bool keep, State& st);
  // Autograd stages: every output the plan differentiates (and the loss)
  // must have a gradient path, or earlier stages silently get no gradient.
  void check_gradient_path(const schedule::Task& task,
                           const std::vector<at::Tensor>& outs) const;
  void backward(const schedule::Task& task, State& st);
  void input_grad(const schedule::Task& task, State& st);
  void weight_grad(const schedule::Task& task, State& st);
  void send(const schedule::Instruction& ins, State& st);
  void reduce_tied(const schedule::Instruction& ins, State& st);
  // Runs the data-parallel collective `ins` (unshard, reduce grads).
  void collective(const schedule::Instruction& ins, State& st);
  void grads_start(int32_t stage, State& st);
  at::Tensor take_activation(int32_t value, int32_t mb, State& st);
  at::Tensor sum_grad_parts(int32_t value, int32_t mb, State& st);
  std::string describe(const schedule::Instruction& ins) const;
  // The torch.profiler range of the wait for receive `ins`:
  // "wait recv(act 'h', mb=1, from rank 0)" (or grad, or tied grad #p).
  std::string wait_name(const schedule::Instruction& ins) const;
  const ValueInfo& value(int32_t id) const;
  // The shape of `value` in microbatch `mb` of this step.
  const std::vector<int64_t>& shape_of(int32_t value, int32_t mb,
                                       const State& st) const;
  const StageInfo& stage(int32_t id) const;

  const int32_t rank_;
  const schedule::Program program_;  // whole program: placement, graph
  const std::vector<schedule::Instruction>& code_;
  std::map<int32_t, StageInfo> stages_;
  std::map<int32_t, ValueInfo> values_;
  std::shared_ptr<Transport> transport_;
  std::map<int32_t, at::Tensor> tied_;
  ExecutorOptions options_;
  // Precomputed from the program: for each compute / reduce instruction,
  // the receives it waits on; for each value, how many local readers one
  // microbatch's activation has, and how many gradient parts it collects.
  std::vector<std::vector<size_t>> needs_;
  // Fused tasks: per part, the receives it waits on right before it runs
  // (part 0's are in needs_).
  std::map<size_t, std::vector<std::vector<size_t>>> later_needs_;
  // (compute instruction, part) -> the stage whose weight gradients that
  // part finishes for the step (a REDUCE_grads of it follows the task).
  std::map<std::pair<size_t, size_t>, int32_t> finishes_grads_;
  std::map<int32_t, int32_t> activation_uses_;
  std::map<int32_t, int32_t> grad_parts_expected_;
  // (stage, microbatch) with a recompute task: their forward keeps only its
  // inputs (and the random generator's state), the recompute the rest.
  std::set<std::pair<int32_t, int32_t>> recomputed_;
  // Tied parameters this rank sums over their holders (a REDUCE_TIED).
  std::vector<int32_t> reduced_tied_;
  // Receive index -> our sends it proves delivered: the peer sent this
  // message after the task that read them (so after receiving them).
  std::map<size_t, std::vector<size_t>> delivered_by_;
  // Stage -> whether its forward draws random numbers (learnt once).
  std::map<int32_t, bool> draws_;
  std::vector<TaskRecord> records_;
  int64_t step_start_unix_ns_ = 0;
  int64_t peak_held_bytes_ = -1;
  int64_t sent_bytes_ = 0;
  int64_t received_bytes_ = 0;
};

}  // namespace torchmpmd::runtime
