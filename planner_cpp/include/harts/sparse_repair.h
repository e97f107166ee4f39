// Sparse repair: a few noncontiguous membership updates that reduce compact work
// (Section 3.2, after "Scale-independent trie-aware greedy").
//
// Each iteration applies at most one update:
//   move  rank r leaves a non-singleton microbatch A for a microbatch B != A that holds
//         some rank within H positions of r (|r' - r| <= H) and can take r within
//         capacity. Gain = RemovalDelta(A, r) - InsertionDelta(B, r).
//   swap  (only when no move gains) ranks r < r' with r' - r <= H in different
//         microbatches A, B exchange places; both results must fit the capacity.
//         Gain = w(A) + w(B) - w(A - r + r') - w(B - r' + r).
// Only the update with the largest strictly positive gain is applied (ties: the first
// found scanning r ascending, then r' ascending). Repair stops after `iterations`
// iterations or at the first iteration where neither operation gains. Every update
// keeps K, exact coverage, non-empty microbatches and the capacity constraint.
//
// The best update of every rank is kept in a max-gain tree over ranks (leftmost on ties) and
// re-evaluated after an update only for the ranks it can affect: the members of the two
// changed microbatches and the ranks within H of one. Swaps are evaluated on first need.
// Complexity: O(N * H * log) once (plus once more for swaps when no move gains), then
// O((|A| + |B|) * H^2 * log) per applied update of microbatches A, B. Polls `cancel`
// (cancel.h) per iteration.
#ifndef HARTS_SPARSE_REPAIR_H_
#define HARTS_SPARSE_REPAIR_H_

#include <cstdint>

#include "harts/cancel.h"
#include "harts/microbatch.h"

namespace harts {

// Repairs `g` in place; returns the number of updates applied.
int64_t SparseRepair(const PlanContext& ctx, Grouping& g, int64_t window, int64_t iterations,
                     CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_SPARSE_REPAIR_H_
