// Lexicographic order of trajectories and their adjacent longest common prefixes.
//
// Glossary
//   trajectory   a non-empty int32 token sequence x_i = tokens[offsets[i], offsets[i+1]).
//   rank         position of a trajectory in the stable lexicographic order
//                (a proper prefix sorts before its extensions; equal trajectories keep
//                their input order).
//   LCP(x, y)    length of the longest common prefix of x and y.
//   adjacent LCP lcp[r] = LCP(x_{order[r-1]}, x_{order[r]}) for r >= 1, lcp[0] = 0.
//
// Complexity: the sort performs O(N log N) comparisons, each costing O(LCP) token
// comparisons done 64 bytes at a time; the adjacent LCPs cost O(sum of LCPs). Both poll `cancel`
// (cancel.h; may be null) once per comparison and throw Cancelled when it fires.
#ifndef HARTS_LEX_ORDER_H_
#define HARTS_LEX_ORDER_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"

namespace harts {

// A read-only view of N trajectories packed into one token buffer.
// Preconditions (checked by ValidateTrajectories in rollout_batch.h):
//   offsets has N + 1 entries, offsets[0] = 0, offsets strictly increasing.
struct TrajectoryView {
  const int32_t* tokens = nullptr;
  const int64_t* offsets = nullptr;
  int64_t num_trajectories = 0;

  const int32_t* begin(int64_t i) const { return tokens + offsets[i]; }
  int64_t length(int64_t i) const { return offsets[i + 1] - offsets[i]; }
};

// Length of the longest common prefix of a[0, n) and b[0, m). O(result / 16 + 16).
int64_t CommonPrefixLength(const int32_t* a, int64_t n, const int32_t* b, int64_t m);

// Stable lexicographic order: order[r] is the index of the trajectory of rank r.
std::vector<int32_t> LexicographicOrder(const TrajectoryView& view, CancelToken* cancel = nullptr);

// Adjacent LCPs of `order` (see glossary); lcp[0] = 0.
std::vector<int32_t> AdjacentLcp(const TrajectoryView& view, const std::vector<int32_t>& order,
                                 CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_LEX_ORDER_H_
