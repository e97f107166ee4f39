#include "harts/replica_assignment.h"

#include <algorithm>
#include <cassert>
#include <numeric>

namespace harts {

Schedule AssignReplicas(const std::vector<int64_t>& work, int64_t dp_size) {
  const int64_t k = static_cast<int64_t>(work.size());
  assert(k > 0 && k % dp_size == 0);
  std::vector<int32_t> by_work(k);
  std::iota(by_work.begin(), by_work.end(), 0);
  std::stable_sort(by_work.begin(), by_work.end(), [&](int32_t a, int32_t b) { return work[a] > work[b]; });
  Schedule s;
  s.replica.assign(k, 0);
  s.slot.assign(k, 0);
  std::vector<int64_t> cumulative(dp_size, 0);
  std::vector<int32_t> replicas(dp_size);
  for (int64_t j = 0; j < k / dp_size; ++j) {
    std::iota(replicas.begin(), replicas.end(), 0);
    std::stable_sort(replicas.begin(), replicas.end(),
                     [&](int32_t a, int32_t b) { return cumulative[a] < cumulative[b]; });
    for (int64_t i = 0; i < dp_size; ++i) {
      const int32_t m = by_work[j * dp_size + i];  // i-th heaviest of the slot
      s.replica[m] = replicas[i];
      s.slot[m] = static_cast<int32_t>(j);
      cumulative[replicas[i]] += work[m];
    }
  }
  s.objective = EvaluateSchedule(work, s.replica, s.slot, dp_size);
  return s;
}

Objective EvaluateSchedule(const std::vector<int64_t>& work, const std::vector<int32_t>& replica,
                           const std::vector<int32_t>& slot, int64_t dp_size) {
  const int64_t k = static_cast<int64_t>(work.size());
  const int64_t slots = k / dp_size;
  std::vector<int64_t> slot_max(slots, 0), replica_sum(dp_size, 0);
  Objective o;
  for (int64_t m = 0; m < k; ++m) {
    o.total_work += work[m];
    slot_max[slot[m]] = std::max(slot_max[slot[m]], work[m]);
    replica_sum[replica[m]] += work[m];
  }
  for (int64_t w : slot_max) o.slot_critical_work += w;
  for (int64_t w : replica_sum) o.max_replica_work = std::max(o.max_replica_work, w);
  return o;
}

}  // namespace harts
