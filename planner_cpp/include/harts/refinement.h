// Boundary refinement of a lexicographically contiguous candidate (Section 3.2,
// "Adaptive candidate refinement").
//
// A sweep visits the inner cuts left to right. Cut i (between microbatches i-1 and i,
// spanning ranks [cuts[i-1], cuts[i+1])) may move to any t with |t - cuts[i]| <= H that
// keeps both sides non-empty and within capacity. The position minimizing
// (W(lo, t) + W(t, hi), max(W(lo, t), W(t, hi))) lexicographically is taken, but only
// when strictly better than the current one (ties keep the cut; among equal new
// positions the leftmost wins). At most `sweeps` sweeps run; refinement stops early
// after a sweep that moves no cut. K never changes.
//
// Complexity: O(K * H) per sweep. Polls `cancel` (cancel.h) once per cut.
#ifndef HARTS_REFINEMENT_H_
#define HARTS_REFINEMENT_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"
#include "harts/microbatch.h"

namespace harts {

// Refines `cuts` in place; returns the number of cut moves made.
int64_t RefineBoundaries(const PlanContext& ctx, std::vector<int32_t>& cuts, int64_t window, int64_t sweeps,
                         CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_REFINEMENT_H_
