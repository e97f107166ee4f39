#include "harts/contiguous_dp.h"

#include <algorithm>
#include <limits>

namespace harts {

std::vector<ContiguousResult> ExactContiguousPartitions(const PlanContext& ctx, const std::vector<int64_t>& ks,
                                                        CancelToken* cancel) {
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  const int64_t n = ctx.size();
  const int64_t cap = ctx.capacity();
  int64_t k_top = 0;
  for (int64_t k : ks) k_top = std::max(k_top, std::min(k, n));

  // first[e]: smallest s with W(s, e) <= T (e >= 1); s = e - 1 always qualifies
  // when single trajectories fit, otherwise first[e] = e (no feasible start).
  std::vector<int32_t> first(n + 1, 0);
  for (int64_t e = 1, s = 0; e <= n; ++e) {
    while (s < e && ctx.Work(s, e) > cap) ++s;
    first[e] = static_cast<int32_t>(s);
  }

  const int64_t width = n + 1;
  std::vector<int64_t> total((k_top + 1) * width, kInf), mx((k_top + 1) * width, kInf);
  std::vector<int32_t> arg((k_top + 1) * width, -1);
  total[0] = 0;
  mx[0] = 0;
  for (int64_t k = 1; k <= k_top; ++k) {
    const int64_t* prev_total = total.data() + (k - 1) * width;
    const int64_t* prev_max = mx.data() + (k - 1) * width;
    int64_t* cur_total = total.data() + k * width;
    int64_t* cur_max = mx.data() + k * width;
    int32_t* cur_arg = arg.data() + k * width;
    for (int64_t e = k; e <= n; ++e) {
      Poll(cancel);
      int64_t best_total = kInf, best_max = kInf;
      int32_t best_s = -1;
      for (int64_t s = std::max<int64_t>(k - 1, first[e]); s < e; ++s) {
        if (prev_total[s] == kInf) continue;
        const int64_t w = ctx.Work(s, e);
        const int64_t t = prev_total[s] + w;
        if (t > best_total) continue;
        const int64_t m = std::max(prev_max[s], w);
        if (t < best_total || m < best_max) {
          best_total = t;
          best_max = m;
          best_s = static_cast<int32_t>(s);
        }
      }
      cur_total[e] = best_total;
      cur_max[e] = best_max;
      cur_arg[e] = best_s;
    }
  }

  std::vector<ContiguousResult> out;
  for (int64_t k : ks) {
    ContiguousResult r;
    r.k = k;
    if (k >= 1 && k <= n && total[k * width + n] != kInf) {
      r.feasible = true;
      r.total_work = total[k * width + n];
      r.max_work = mx[k * width + n];
      r.cuts.assign(k + 1, 0);
      int64_t e = n;
      for (int64_t j = k; j >= 1; --j) {
        r.cuts[j] = static_cast<int32_t>(e);
        e = arg[j * width + e];
      }
      r.cuts[0] = 0;
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace harts
