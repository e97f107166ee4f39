#include "harts/natural_partition.h"

#include <algorithm>
#include <cassert>
#include <utility>

namespace harts {

std::vector<int32_t> NaturalPartition(const PlanContext& ctx) {
  const int64_t n = ctx.size();
  const int64_t cap = ctx.capacity();
  std::vector<int32_t> cuts = {0};
  // Intervals still to visit, left to right: pop the leftmost (stack top).
  std::vector<std::pair<int32_t, int32_t>> stack = {{0, static_cast<int32_t>(n)}};
  while (!stack.empty()) {
    const auto [lo, hi] = stack.back();
    stack.pop_back();
    if (hi - lo == 1 || ctx.Work(lo, hi) <= cap) {
      cuts.push_back(hi);
      continue;
    }
    int32_t best = -1;
    int64_t best_lcp = 0, best_max = 0, best_diff = 0;
    for (int32_t t = lo + 1; t < hi; ++t) {
      const int64_t l = ctx.AdjacentLcp(t);
      if (best >= 0 && l > best_lcp) continue;
      const int64_t wl = ctx.Work(lo, t), wr = ctx.Work(t, hi);
      const int64_t mx = std::max(wl, wr), diff = wl > wr ? wl - wr : wr - wl;
      if (best < 0 || l < best_lcp || mx < best_max || (mx == best_max && diff < best_diff)) {
        best = t;
        best_lcp = l;
        best_max = mx;
        best_diff = diff;
      }
    }
    assert(best > lo);
    stack.push_back({best, hi});
    stack.push_back({lo, best});
  }
  return cuts;
}

}  // namespace harts
