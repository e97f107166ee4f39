// The least-work contiguous partition over a range of microbatch counts, exactly, in
// O(N log C) (an extension of Section 3.2's contiguous search; contiguous_dp.h is the
// O(K N^2 / K0) table of Eq. 9 kept for small inputs).
//
// Glossary (microbatch.h): ranks [0, N), adjacent LCPs L_t, interval work W(lo, hi),
// capacity T. A contiguous partition into K parts with inner cuts t_1 < ... < t_{K-1} has
//   total work = G + sum_i L_{t_i},      G = W(0, N)
// (every adjacent pair not separated by a cut shares L_t tokens), and is feasible iff every
// part has W <= T. So minimizing total work is choosing cut positions of least summed L
// subject to the capacity, and
//   c(K) = min { sum_i L_{t_i} : a feasible partition into exactly K parts }.
//
// Method.
//   * Penalized DP (one pass, O(N)): for a penalty lambda per part,
//       f(e) = min over s in [first(e), e) of f(s) + cost(s) + lambda,   f(0) = 0,
//     cost(0) = 0 and cost(s) = L_s; first(e) = the smallest s with W(s, e) <= T is
//     nondecreasing in e, so the window minimum is a monotone deque. Alongside, the least and
//     the largest part count among the optimal prefixes of each e.
//   * c is convex in K: the part cost (L_s for a feasible part, infinite otherwise) satisfies
//     the quadrangle inequality, since a sub-interval of a feasible interval is feasible. So
//     K is optimal for exactly the penalties lambda in [-(c(K+1) - c(K)), -(c(K) - c(K-1))],
//     a nonempty integer interval; binary search over lambda ("Aliens" / Lagrangian trick)
//     finds one, and a backward walk over optimal predecessors whose count range still holds
//     the remaining parts recovers a partition with exactly K parts.
//   * Over the candidate range {k_min, k_min + D, ..., k_max}: the counts optimal at
//     lambda = 0 form an interval [lo, hi]; a range value inside it is optimal (the smallest is
//     taken); otherwise, by convexity, the best range value is the largest one below lo or the
//     smallest one above hi (ties: the smaller K).
//
// Precondition: every trajectory fits the capacity (len(r) <= T).
// Complexity: O(N) per penalized pass, O(N log C) in all (C <= S bounds the penalties),
// O(N) memory. Polls `cancel` (cancel.h) in every pass.
#ifndef HARTS_CONTIGUOUS_OPTIMUM_H_
#define HARTS_CONTIGUOUS_OPTIMUM_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"
#include "harts/candidate_range.h"
#include "harts/microbatch.h"

namespace harts {

struct ContiguousOptimum {
  bool feasible = false;
  int64_t k = 0;
  int64_t total_work = 0;     // G + c(k)
  std::vector<int32_t> cuts;  // k + 1 entries when feasible
};

// The least-total-work feasible contiguous partition into exactly k parts (infeasible when
// k < the least feasible count or k > N).
ContiguousOptimum OptimalContiguousPartition(const PlanContext& ctx, int64_t k, CancelToken* cancel = nullptr);

// The least-total-work feasible contiguous partition over the counts of `range` (ties: the
// smaller K); infeasible when no count of the range is feasible.
ContiguousOptimum OptimalContiguousPartition(const PlanContext& ctx, const KRange& range,
                                             CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_CONTIGUOUS_OPTIMUM_H_
