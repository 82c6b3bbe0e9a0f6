#include "schedule/timeline.h"

#include <algorithm>
#include <limits>
#include <set>

#include "util/check.h"

namespace torchmpmd::schedule {

TimelineStats timeline_stats(const std::vector<int32_t>& ranks,
                             const std::vector<double>& starts,
                             const std::vector<double>& ends) {
  MPMD_CHECK(ranks.size() == starts.size() && ranks.size() == ends.size(),
             "schedule: timeline_stats needs one rank, start and end per "
             "task, got ",
             ranks.size(), " ranks, ", starts.size(), " starts and ",
             ends.size(), " ends");
  if (ranks.empty()) return {};
  double lo = std::numeric_limits<double>::infinity();
  double hi = -lo;
  double busy = 0;
  for (size_t i = 0; i < ranks.size(); ++i) {
    lo = std::min(lo, starts[i]);
    hi = std::max(hi, ends[i]);
    busy += ends[i] - starts[i];
  }
  TimelineStats stats;
  stats.step_time = hi - lo;
  const std::set<int32_t> distinct(ranks.begin(), ranks.end());
  if (stats.step_time > 0) {
    stats.bubble_fraction =
        1.0 - busy / (stats.step_time * static_cast<double>(distinct.size()));
  }
  return stats;
}

TimelineStats Timeline::stats() const {
  std::vector<int32_t> ranks;
  std::vector<double> starts;
  std::vector<double> ends;
  for (const Event& e : events) {
    if (e.kind != EventKind::kCompute) continue;
    ranks.push_back(e.rank);
    starts.push_back(e.start);
    ends.push_back(e.end);
  }
  return timeline_stats(ranks, starts, ends);
}

double Timeline::step_time() const { return stats().step_time; }

double Timeline::bubble_fraction() const { return stats().bubble_fraction; }

std::vector<double> Timeline::busy_time() const {
  std::vector<double> busy(num_ranks, 0.0);
  for (const Event& e : events) {
    if (e.kind == EventKind::kCompute && e.rank >= 0 && e.rank < num_ranks) {
      busy[e.rank] += e.end - e.start;
    }
  }
  return busy;
}

}  // namespace torchmpmd::schedule
