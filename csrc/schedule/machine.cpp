#include "schedule/machine.h"

#include <algorithm>

#include "util/check.h"

namespace torchmpmd::schedule {

Machine::Machine(int32_t num_ranks, Costs costs)
    : costs_(std::move(costs)),
      clock_(num_ranks, 0.0),
      collective_free_(num_ranks, 0.0),
      posted_(num_ranks) {}

Machine::Interval Machine::send(int32_t rank, const Instruction& ins) {
  double& free_at = link_free_[{rank, ins.peer}];
  const double start = std::max(clock_.at(rank), free_at);
  free_at = start + costs_.wire_time(ins.bytes);
  const double arrive = free_at + costs_.latency;
  arrival_[{rank, ins.peer, ins.tag}] = arrive;
  if (!costs_.overlap_comm) clock_[rank] = free_at;
  return {start, arrive};
}

void Machine::post(int32_t rank, const Instruction& ins) {
  posted_.at(rank).push_back(ins);
}

template <typename Reads>
std::optional<double> Machine::arrivals(int32_t rank, Reads user) const {
  double start = clock_.at(rank);
  for (const Instruction& recv : posted_.at(rank)) {
    if (!user(recv)) continue;
    const auto it = arrival_.find({recv.peer, rank, recv.tag});
    if (it == arrival_.end()) return std::nullopt;
    start = std::max(start, it->second);
  }
  return start;
}

template <typename Reads>
void Machine::consume(int32_t rank, Reads user) {
  auto& pending = posted_.at(rank);
  pending.erase(std::remove_if(pending.begin(), pending.end(), user),
                pending.end());
}

std::optional<double> Machine::ready(int32_t rank,
                                     const Instruction& ins) const {
  return arrivals(rank,
                  [&](const Instruction& recv) { return reads(ins, recv); });
}

std::optional<double> Machine::ready(int32_t rank, const Task& task) const {
  return arrivals(rank,
                  [&](const Instruction& recv) { return reads(task, recv); });
}

double Machine::run(int32_t rank, const Instruction& ins, double start,
                    double scale) {
  consume(rank, [&](const Instruction& recv) { return reads(ins, recv); });
  double end = start;
  if (ins.op == Op::kCompute) end += scale * costs_.of(ins.task);
  if (ins.op == Op::kUnshard) end += costs_.unshard_time(ins.value);
  clock_.at(rank) = end;
  return end;
}

double Machine::run(int32_t rank, const Task& task, double start,
                    double scale) {
  consume(rank, [&](const Instruction& recv) { return reads(task, recv); });
  const double end = start + scale * costs_.of(task);
  clock_.at(rank) = end;
  return end;
}

Machine::Interval Machine::reduce_grads(int32_t rank, const Instruction& ins) {
  double& free_at = collective_free_.at(rank);
  const double start = std::max(clock_.at(rank), free_at);
  free_at = start + costs_.reduce_grads_time(ins.value);
  if (!costs_.overlap_comm) clock_[rank] = free_at;
  return {start, free_at};
}

}  // namespace torchmpmd::schedule
