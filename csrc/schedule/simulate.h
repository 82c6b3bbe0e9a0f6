// Simulating a lowered program on the machine model (machine.h): when each
// task runs on each rank, the step time, the idle (bubble) fraction and the
// peak activation memory per rank. The runtime records measured runs in the
// same Timeline type.
#pragma once

#include "schedule/program.h"
#include "schedule/timeline.h"

namespace torchmpmd::schedule {

// Runs the program on the machine model: each rank executes its
// instructions in order. Throws torchmpmd::Error if the program cannot
// complete (which lower() already rules out).
Timeline simulate(const Program& program, const Costs& costs);

}  // namespace torchmpmd::schedule
