#include "schedule/grid.h"

#include <set>

namespace torchmpmd::schedule {

std::string render_grid(const ScheduleSpec& spec,
                        const std::vector<std::pair<int32_t, int32_t>>& marks) {
  std::string out;
  const std::set<std::pair<int32_t, int32_t>> marked(marks.begin(),
                                                     marks.end());
  for (int32_t r = 0; r < static_cast<int32_t>(spec.tasks.size()); ++r) {
    out += "  rank " + std::to_string(r) + ":";
    const auto& list = spec.tasks[r];
    for (int32_t i = 0; i < static_cast<int32_t>(list.size()); ++i) {
      const std::string a = to_action(list[i]);
      out += marked.count({r, i}) ? " [" + a + "]" : " " + a;
    }
    if (marked.count({r, static_cast<int32_t>(list.size())})) out += " [end]";
    out += "\n";
  }
  return out;
}

std::string grid_for(const ScheduleSpec& spec,
                     const std::vector<std::pair<int32_t, int32_t>>& marks) {
  return "\n" + render_grid(spec, marks);
}

}  // namespace torchmpmd::schedule
