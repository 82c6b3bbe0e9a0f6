#include "schedule/timeline.h"

#include <algorithm>
#include <limits>
#include <set>

#include "util/check.h"

namespace torchmpmd::schedule {

TimelineStats timeline_stats(const std::vector<int32_t>& ranks,
                             const std::vector<double>& starts,
                             const std::vector<double>& ends,
                             const std::vector<bool>& busy_mask) {
  MPMD_CHECK(ranks.size() == starts.size() && ranks.size() == ends.size(),
             "schedule: timeline_stats needs one rank, start and end per "
             "task, got ",
             ranks.size(), " ranks, ", starts.size(), " starts and ",
             ends.size(), " ends");
  MPMD_CHECK(busy_mask.empty() || busy_mask.size() == ranks.size(),
             "schedule: timeline_stats got ", busy_mask.size(),
             " busy flags for ", ranks.size(), " intervals");
  if (ranks.empty()) return {};
  double lo = std::numeric_limits<double>::infinity();
  double hi = -lo;
  double busy = 0;
  std::set<int32_t> distinct;
  for (size_t i = 0; i < ranks.size(); ++i) {
    lo = std::min(lo, starts[i]);
    hi = std::max(hi, ends[i]);
    if (!busy_mask.empty() && !busy_mask[i]) continue;
    busy += ends[i] - starts[i];
    distinct.insert(ranks[i]);
  }
  TimelineStats stats;
  stats.step_time = hi - lo;
  if (stats.step_time > 0 && !distinct.empty()) {
    stats.bubble_fraction =
        1.0 - busy / (stats.step_time * static_cast<double>(distinct.size()));
  }
  return stats;
}

TimelineStats Timeline::stats() const {
  std::vector<int32_t> ranks;
  std::vector<double> starts;
  std::vector<double> ends;
  std::vector<bool> busy;
  for (const Event& e : events) {
    if (e.kind != EventKind::kCompute && e.kind != EventKind::kCollective) {
      continue;
    }
    ranks.push_back(e.rank);
    starts.push_back(e.start);
    ends.push_back(e.end);
    busy.push_back(e.kind == EventKind::kCompute);
  }
  return timeline_stats(ranks, starts, ends, busy);
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
