// Exact contiguous partition search (Section 3.2, "Exact search for small inputs", Eq. 9).
//
// F[k, e] is the best way to split the first e ranks [0, e) into k non-empty contiguous
// microbatches of work <= T, ordered lexicographically by (total work, maximum single
// microbatch work):
//   F[0, 0] = (0, 0)
//   F[k, e] = min over s < e with W(s, e) <= T and F[k-1, s] feasible of
//             (F[k-1, s].total + W(s, e), max(F[k-1, s].max, W(s, e)))
// The pair order is monotone (a better prefix never yields a worse extension), so the
// recursion is exact for the lexicographic (total, max) objective, not only for total.
// Ties on both keep the leftmost s.
//
// Capacity pruning: for fixed e, W(s, e) decreases as s moves right, so the feasible
// starts form a suffix [first(e), e) and first(e) is nondecreasing in e (two pointers).
// Only those starts are visited.
//
// Complexity: O(k_max * sum_e (e - first(e))) time, at most O(k_max * N^2) and typically
// O(k_max * N * N / K0); O(k_max * N) memory. Polls `cancel` (cancel.h) once per table cell
// F[k, e].
#ifndef HARTS_CONTIGUOUS_DP_H_
#define HARTS_CONTIGUOUS_DP_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"
#include "harts/microbatch.h"

namespace harts {

struct ContiguousResult {
  int64_t k = 0;
  bool feasible = false;
  int64_t total_work = 0;     // F[k, N].total
  int64_t max_work = 0;       // F[k, N].max
  std::vector<int32_t> cuts;  // k + 1 entries when feasible
};

// The optimal contiguous partition of all N ranks for each requested k (any order,
// each 1 <= k; k > N is reported infeasible). One table serves every k.
std::vector<ContiguousResult> ExactContiguousPartitions(const PlanContext& ctx, const std::vector<int64_t>& ks,
                                                        CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_CONTIGUOUS_DP_H_
