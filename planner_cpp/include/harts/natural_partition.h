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
// Finding the cut without scanning the interval: W(lo, t) is nondecreasing and W(t, hi)
// nonincreasing in t, so left of the balance point (W(lo, t) <= W(t, hi)) keys 2-3 do not
// increase with t and right of it they do not decrease. The best cut is therefore the last
// valley (L_t = min) left of the balance point, moved left over cuts with equal sides, or the
// first valley right of it; each is found by binary search over the O(1) range-minimum of
// the adjacent LCPs and the O(1) interval work.
//
// Precondition: every trajectory fits the capacity (len(r) <= T); then every interval
// of one trajectory is feasible and the recursion terminates.
// Complexity: O(log N) per split, O(K0 log N) in all; no recursion (explicit stack). Polls
// `cancel` (cancel.h) once per split.
#ifndef HARTS_NATURAL_PARTITION_H_
#define HARTS_NATURAL_PARTITION_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"
#include "harts/microbatch.h"

namespace harts {

// Returns the cuts of P0 (see microbatch.h), K0 = cuts.size() - 1.
std::vector<int32_t> NaturalPartition(const PlanContext& ctx, CancelToken* cancel = nullptr);

// The cut t of [lo, hi) (hi - lo >= 2) minimizing (L_t, max(W(lo, t), W(t, hi)), then, when
// `with_difference`, |W(lo, t) - W(t, hi)|, then t): keys 1-4 above, or without key 3 the
// split order of evolution.h. O(log N).
int32_t BestValleyCut(const PlanContext& ctx, int32_t lo, int32_t hi, bool with_difference);

}  // namespace harts

#endif  // HARTS_NATURAL_PARTITION_H_
