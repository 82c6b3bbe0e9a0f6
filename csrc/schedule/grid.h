// Drawing a schedule as text, for error messages and Program.grid().
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "schedule/task.h"

namespace torchmpmd::schedule {

// The per-rank grid of a schedule, one line per rank in action format
// ("0F0 0F1 0B0"), with `marks` (rank, position) bracketed.
std::string render_grid(const ScheduleSpec& spec,
                        const std::vector<std::pair<int32_t, int32_t>>& marks);

// The grid on the lines after an error message.
std::string grid_for(const ScheduleSpec& spec,
                     const std::vector<std::pair<int32_t, int32_t>>& marks);

}  // namespace torchmpmd::schedule
