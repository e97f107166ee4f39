// Sampled-K merge/split evolution of the natural partition (Section 3.2, "Heuristic
// base search for large inputs").
//
// For a target K < K0 the partition repeatedly merges the capacity-feasible adjacent
// pair A, B with the largest compact-work saving C(A) + C(B) - C(A u B), which for
// contiguous intervals is the adjacent LCP at their cut (Eq. 6); ties prefer the
// smaller merged work, then the leftmost pair. For a target K > K0 it repeatedly splits
// the microbatch M into contiguous L, R with the smallest increase C(L) + C(R) - C(M)
// (again the adjacent LCP at the new cut); ties prefer the smaller max(C(L), C(R)), then
// the leftmost cut. Splits are always capacity-feasible. A target is reached when the
// microbatch count equals it; when no legal operation exists before then, that
// candidate (and every target beyond it in the same direction) fails.
//
// Evolution is incremental: targets below K0 are produced by one merge sequence in
// descending order and targets above K0 by one split sequence in ascending order, so
// each snapshot is the evolved partition at that K.
//
// Both run on heaps instead of rescans: merges on a lazy heap of (saving, merged work, cut)
// over a linked list of cuts (a merge changes only the two neighbouring pairs), splits on an
// ordered set of every microbatch's best cut (natural_partition.h's BestValleyCut without
// the difference key), refreshed for the two halves of each split.
// Complexity: O(K0 log K0) for the merge sequence, O(log N + log K) per split, O(K) per
// requested snapshot. Polls `cancel` (cancel.h) once per merge or split.
#ifndef HARTS_EVOLUTION_H_
#define HARTS_EVOLUTION_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"
#include "harts/microbatch.h"

namespace harts {

struct EvolvedPartition {
  int64_t k = 0;
  bool feasible = false;
  std::vector<int32_t> cuts;  // k + 1 entries when feasible
};

// One result per target (same order as `targets`). `natural` is P0's cuts.
std::vector<EvolvedPartition> EvolvePartition(const PlanContext& ctx, const std::vector<int32_t>& natural,
                                              const std::vector<int64_t>& targets, CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_EVOLUTION_H_
