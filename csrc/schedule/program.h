// The schedule layer in one include: tasks and their kinds, the pipeline
// graph, costs, validation, lowering to a Program and the grid rendering.
// Simulation and timelines are in simulate.h.
#pragma once

#include "schedule/costs.h"           // IWYU pragma: export
#include "schedule/grid.h"            // IWYU pragma: export
#include "schedule/instruction.h"     // IWYU pragma: export
#include "schedule/lower.h"           // IWYU pragma: export
#include "schedule/pipeline_graph.h"  // IWYU pragma: export
#include "schedule/task.h"            // IWYU pragma: export
#include "schedule/task_kinds.h"      // IWYU pragma: export
#include "schedule/validate.h"        // IWYU pragma: export
