// Natural partition P0 (Section 3.2, "Candidate range and natural partition").
//
// Starting from the whole rank range [0, N), every contiguous interval whose compact
// work exceeds the capacity T is split recursively at its lowest adjacent-LCP valley:
// the cut t (lo < t < hi) minimizing, in order,
//   1. L_t, the adjacent LCP at the cut (Eq. 6: the work the split adds);
//   2. max(W(lo, t), W(t, hi)), the larger side's work;
//   3. |W(lo, t) - W(t, hi)|, the difference between the sides;
//   4. t itself (leftmost), so the result is deterministic.
// Intervals within capacity are kept. The result is the first capacity-feasible
// partition; its microbatch count is K0.
//
// Precondition: every trajectory fits the capacity (len(r) <= T); then every interval
// of one trajectory is feasible and the recursion terminates.
// Complexity: O(N) per split, O(N * K0) in all; no recursion (explicit stack).
#ifndef HARTS_NATURAL_PARTITION_H_
#define HARTS_NATURAL_PARTITION_H_

#include <cstdint>
#include <vector>

#include "harts/microbatch.h"

namespace harts {

// Returns the cuts of P0 (see microbatch.h), K0 = cuts.size() - 1.
std::vector<int32_t> NaturalPartition(const PlanContext& ctx);

}  // namespace harts

#endif  // HARTS_NATURAL_PARTITION_H_
