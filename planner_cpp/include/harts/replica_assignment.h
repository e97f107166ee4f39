// DP-replica assignment and slot construction (Section 3.2), and the objective J of
// Equation (4).
//
// Glossary
//   D          DP degree; K mod D = 0 microbatches; S = K / D slots.
//   M_{d,j}    the microbatch replica d executes in slot j.
//   J          ( sum_M w(M),  sum_j max_d w(M_{d,j}),  max_d sum_j w(M_{d,j}) ),
//              compared lexicographically: total compact work, aggregate slot-critical
//              work, maximum replica-cumulative work.
//
// AssignReplicas sorts the microbatches by descending work (ties by ascending index),
// makes every consecutive block of D one slot (slot 0 is the heaviest), and inside a
// slot gives the heavier microbatches to the replicas with less cumulative work so far
// (ties by lower replica index). Sorting before blocking minimizes the slot-critical sum
// for a fixed grouping; the replica step is greedy.
//
// Complexity: O(K log K + K / D * D log D).
#ifndef HARTS_REPLICA_ASSIGNMENT_H_
#define HARTS_REPLICA_ASSIGNMENT_H_

#include <cstdint>
#include <tuple>
#include <vector>

namespace harts {

struct Objective {
  int64_t total_work = 0;
  int64_t slot_critical_work = 0;
  int64_t max_replica_work = 0;

  friend bool operator<(const Objective& a, const Objective& b) {
    return std::tie(a.total_work, a.slot_critical_work, a.max_replica_work) <
           std::tie(b.total_work, b.slot_critical_work, b.max_replica_work);
  }
  friend bool operator==(const Objective& a, const Objective& b) {
    return std::tie(a.total_work, a.slot_critical_work, a.max_replica_work) ==
           std::tie(b.total_work, b.slot_critical_work, b.max_replica_work);
  }
};

struct Schedule {
  std::vector<int32_t> replica;  // per microbatch, in [0, D)
  std::vector<int32_t> slot;     // per microbatch, in [0, K / D)
  Objective objective;
};

// Precondition: work.size() is a positive multiple of dp_size.
Schedule AssignReplicas(const std::vector<int64_t>& work, int64_t dp_size);

// J of an arbitrary schedule (every (replica, slot) pair used once). O(K).
Objective EvaluateSchedule(const std::vector<int64_t>& work, const std::vector<int32_t>& replica,
                           const std::vector<int32_t>& slot, int64_t dp_size);

}  // namespace harts

#endif  // HARTS_REPLICA_ASSIGNMENT_H_
