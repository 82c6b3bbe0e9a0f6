// Per-stage costs, used to order tasks (lower) and to predict timelines
// (simulate), both through the one machine model of machine.h.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace torchmpmd::schedule {

struct Task;

// Any unit works as long as it is the same for all fields (microseconds is
// typical).
struct Costs {
  // A task's time, per task kind (in the enum order of task_kinds.h) and
  // stage: time[kind][stage]. A kind the table charges as another (R as F)
  // takes that kind's row; its own may stay empty.
  std::vector<std::vector<double>> time;
  // Measured times of fused tasks, by their parts' kinds and stages in order
  // (fused_cost_key(): "0F;3B"), whatever their microbatches. A fused task
  // without one takes the sum of its parts' times (they run one after the
  // other); one whose parts overlap takes less, as measured.
  std::map<std::string, double> fused_time;
  // Bytes of activations one microbatch keeps alive on a stage from F until
  // its backward; W-only bytes are what stays after I, until W (the
  // forward's tensors W reads and the output gradients I made for it: may
  // exceed the activation bytes).
  std::vector<int64_t> activation_bytes;
  std::vector<int64_t> weight_grad_bytes;
  // Data parallelism (ScheduleSpec::collectives), per stage or empty (free):
  // the time an unshard blocks its rank, the time a gradient reduction
  // occupies the rank's collective channel (beside its compute), and the
  // bytes an unsharded stage holds from its unshard to its reduction.
  std::vector<double> unshard;
  std::vector<double> reduce_grads;
  std::vector<int64_t> unsharded_bytes;
  // Communication inside tasks (expert parallelism's all-to-alls), per task
  // kind and stage as `time` (comm[kind][stage]; empty: none), and part of
  // its time. With overlap_sides, a fused task of two sides (lanes(): a
  // forward beside a backward) runs them at once, as the runtime does: it
  // takes its parts' compute or its longer side, whichever is more, so
  // that one side's communication hides under the other's compute. Not
  // where the ranks share cores (shares_cores()): simulate() then charges
  // the sides one after the other, the cores being busy either way.
  std::vector<std::vector<double>> comm;
  bool overlap_sides = false;
  // Ranks sharing CPU cores (CPU ranks on one host, more ranks than cores):
  // `shared_cores` is the cores the program's ranks compute on (0: each
  // rank computes on a device of its own), `demand_per_rank` the cores one
  // program rank's compute takes (its threads times the ranks it stands
  // for: a pipeline rank of a data-parallel layout computes beside its
  // replicas). The times above are measured with every rank computing at
  // once; where fewer compute (a pipeline's bubbles), the kernel shares
  // the cores among fewer and each runs faster. simulate() then charges
  // each compute task by the ranks computing beside it (sharing()).
  double shared_cores = 0;
  double demand_per_rank = 1;
  double latency = 0;         // per message
  double bytes_per_unit = 0;  // link bandwidth; 0 = infinitely fast
  bool overlap_comm = true;   // sends run in the background

  // F = 1, B = 2, I = W = 1 per stage, free communication; any other kind
  // its default in the task-kind table.
  static Costs uniform(int32_t num_stages, double forward = 1,
                       double backward = 2, double input_grad = 1,
                       double weight_grad = 1);
  // The cost of a task: its stage's time for the kind the task-kind table
  // charges it as; of a fused task, its fused_time if given, else overlapped
  // (overlaps()), else the sum of its parts'.
  double of(const Task& task) const;
  // Whether fused task `task` has a measured time in fused_time.
  bool has_fused_time(const Task& task) const;
  // Whether fused task `task` runs its two sides at once (overlap_sides,
  // communication given, no measured time): charged as one, not part by
  // part.
  bool overlaps(const Task& task) const;
  // The communication inside simple task `task` (0 where not given).
  double comm_of(const Task& task) const;
  // Time the link is busy with one message (the machine model adds latency
  // and contention).
  double wire_time(int64_t bytes) const;
  // A stage's data-parallel collectives: their times and the bytes its
  // unshard holds (0 where not given).
  double unshard_time(int32_t stage) const;
  double reduce_grads_time(int32_t stage) const;
  int64_t unsharded_bytes_of(int32_t stage) const;
  // Whether `num_ranks` ranks computing at once take more cores than
  // shared_cores gives them.
  bool shares_cores(int32_t num_ranks) const;
  // The time a compute task takes with `computing` ranks at work (itself
  // included), as a fraction of its time with all `num_ranks` at work: the
  // cores' share each gets, max(1, computing x demand / cores), relative to
  // that of all; 1 without shared cores.
  double sharing(double computing, int32_t num_ranks) const;
  void check(int32_t num_stages) const;
};

}  // namespace torchmpmd::schedule
