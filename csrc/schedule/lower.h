// Lowering a schedule (per-rank task lists + stage placement) to a Program:
// per rank, an instruction list with the sends and receives every task needs.
//
// The lowering runs the schedule once on the machine model (machine.h) to
// get one global order of all tasks (JaxPP's approach). Each send is placed
// right after the task that produces its payload, and the matching receive
// at the same point of the global order on the receiving rank. Projecting
// that one order onto every rank means that for every pair of ranks, sends
// and receives appear in the same order on both sides, so a program that
// passes the simulation cannot deadlock on NCCL or Gloo. A fused task is
// one step of that order: it starts when the inputs of all its parts have
// arrived, so every part's receives come before it, and the messages its
// parts produce are sent after the whole task, part by part (each part's
// outputs are final only when the fused task ends, once its parts overlap). A
// receive's position only fixes that order: the executor posts it as early as
// the pair order allows and waits for it only when the task that reads it
// starts.
#pragma once

#include "schedule/costs.h"
#include "schedule/instruction.h"
#include "schedule/pipeline_graph.h"
#include "schedule/task.h"

namespace torchmpmd::schedule {

// validate(), then orders all tasks by running them on the machine model
// with `costs`, and inserts the sends and receives. A schedule in which no
// rank can make progress (deadlock, or a cross-rank dependency broken) is
// rejected with the per-rank grid of where each rank stopped and what it
// waits for.
Program lower(const PipelineGraph& graph, const ScheduleSpec& spec,
              const Costs& costs);

}  // namespace torchmpmd::schedule
