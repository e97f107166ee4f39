#include "harts/refinement.h"

#include <algorithm>

namespace harts {

int64_t RefineBoundaries(const PlanContext& ctx, std::vector<int32_t>& cuts, int64_t window, int64_t sweeps,
                         CancelToken* cancel) {
  const int64_t cap = ctx.capacity();
  int64_t moves = 0;
  for (int64_t sweep = 0; sweep < sweeps; ++sweep) {
    int64_t moved = 0;
    for (size_t i = 1; i + 1 < cuts.size(); ++i) {
      Poll(cancel);
      const int64_t lo = cuts[i - 1], hi = cuts[i + 1], cur = cuts[i];
      const int64_t cur_l = ctx.Work(lo, cur), cur_r = ctx.Work(cur, hi);
      int64_t best_t = cur, best_sum = cur_l + cur_r, best_max = std::max(cur_l, cur_r);
      for (int64_t t = std::max(lo + 1, cur - window); t <= std::min(hi - 1, cur + window); ++t) {
        if (t == cur) continue;
        const int64_t wl = ctx.Work(lo, t), wr = ctx.Work(t, hi);
        if (wl > cap || wr > cap) continue;
        const int64_t sum = wl + wr, mx = std::max(wl, wr);
        if (sum < best_sum || (sum == best_sum && mx < best_max)) {
          best_t = t;
          best_sum = sum;
          best_max = mx;
        }
      }
      if (best_t != cur) {
        cuts[i] = static_cast<int32_t>(best_t);
        ++moved;
      }
    }
    moves += moved;
    if (moved == 0) break;
  }
  return moves;
}

}  // namespace harts
