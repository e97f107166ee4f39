#include "harts/sparse_repair.h"

#include <algorithm>
#include <vector>

namespace harts {

int64_t SparseRepair(const PlanContext& ctx, Grouping& g, int64_t window, int64_t iterations) {
  const int64_t n = ctx.size();
  const int64_t cap = ctx.capacity();
  std::vector<int32_t> group_of(n);
  for (int64_t k = 0; k < g.size(); ++k)
    for (int32_t r : g.groups[k]) group_of[r] = static_cast<int32_t>(k);

  int64_t applied = 0;
  std::vector<int32_t> seen;
  for (int64_t it = 0; it < iterations; ++it) {
    // Best move.
    int64_t best_gain = 0;
    int32_t move_rank = -1, move_dest = -1;
    for (int32_t r = 0; r < n; ++r) {
      const int32_t a = group_of[r];
      if (g.groups[a].size() < 2) continue;
      const int64_t saved = RemovalDelta(ctx, g.groups[a], r);
      seen.clear();
      for (int64_t r2 = std::max<int64_t>(0, r - window); r2 <= std::min<int64_t>(n - 1, r + window); ++r2) {
        const int32_t b = group_of[r2];
        if (b == a || std::find(seen.begin(), seen.end(), b) != seen.end()) continue;
        seen.push_back(b);
        const int64_t added = InsertionDelta(ctx, g.groups[b], r);
        if (g.work[b] + added > cap) continue;
        if (saved - added > best_gain) {
          best_gain = saved - added;
          move_rank = r;
          move_dest = b;
        }
      }
    }
    if (move_rank >= 0) {
      const int32_t a = group_of[move_rank];
      g.work[a] -= RemovalDelta(ctx, g.groups[a], move_rank);
      EraseSorted(g.groups[a], move_rank);
      g.work[move_dest] += InsertionDelta(ctx, g.groups[move_dest], move_rank);
      InsertSorted(g.groups[move_dest], move_rank);
      group_of[move_rank] = move_dest;
      ++applied;
      continue;
    }
    // Best swap.
    int32_t swap_r = -1, swap_r2 = -1;
    int64_t swap_wa = 0, swap_wb = 0;
    for (int32_t r = 0; r < n; ++r) {
      const int32_t a = group_of[r];
      const int64_t saved_a = RemovalDelta(ctx, g.groups[a], r);
      for (int64_t r2 = r + 1; r2 <= std::min<int64_t>(n - 1, r + window); ++r2) {
        const int32_t b = group_of[r2];
        if (b == a) continue;
        const int32_t q = static_cast<int32_t>(r2);
        const int64_t wa = g.work[a] - saved_a + InsertionDelta(ctx, g.groups[a], q, r);
        if (wa > cap) continue;
        const int64_t wb = g.work[b] - RemovalDelta(ctx, g.groups[b], q) + InsertionDelta(ctx, g.groups[b], r, q);
        if (wb > cap) continue;
        const int64_t gain = g.work[a] + g.work[b] - wa - wb;
        if (gain > best_gain) {
          best_gain = gain;
          swap_r = r;
          swap_r2 = q;
          swap_wa = wa;
          swap_wb = wb;
        }
      }
    }
    if (swap_r < 0) break;
    const int32_t a = group_of[swap_r], b = group_of[swap_r2];
    EraseSorted(g.groups[a], swap_r);
    InsertSorted(g.groups[a], swap_r2);
    EraseSorted(g.groups[b], swap_r2);
    InsertSorted(g.groups[b], swap_r);
    g.work[a] = swap_wa;
    g.work[b] = swap_wb;
    group_of[swap_r] = b;
    group_of[swap_r2] = a;
    ++applied;
  }
  return applied;
}

}  // namespace harts
