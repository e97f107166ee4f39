#include "harts/evolution.h"

#include <algorithm>
#include <map>

namespace harts {
namespace {

// Merges the best adjacent pair of `cuts` in place; false if no pair fits the capacity.
bool MergeOnce(const PlanContext& ctx, std::vector<int32_t>& cuts) {
  int64_t best = -1, best_saving = -1, best_work = 0;
  for (size_t i = 1; i + 1 < cuts.size(); ++i) {  // cut i joins [cuts[i-1], cuts[i+1])
    const int64_t w = ctx.Work(cuts[i - 1], cuts[i + 1]);
    if (w > ctx.capacity()) continue;
    const int64_t saving = ctx.AdjacentLcp(cuts[i]);
    if (saving > best_saving || (saving == best_saving && w < best_work)) {
      best = static_cast<int64_t>(i);
      best_saving = saving;
      best_work = w;
    }
  }
  if (best < 0) return false;
  cuts.erase(cuts.begin() + best);
  return true;
}

// Splits the best microbatch of `cuts` in place; false if every microbatch is a singleton.
bool SplitOnce(const PlanContext& ctx, std::vector<int32_t>& cuts) {
  int64_t best_t = -1, best_pos = 0, best_cost = 0, best_max = 0;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    const int32_t lo = cuts[i], hi = cuts[i + 1];
    for (int32_t t = lo + 1; t < hi; ++t) {
      const int64_t cost = ctx.AdjacentLcp(t);
      if (best_t >= 0 && cost > best_cost) continue;
      const int64_t m = std::max(ctx.Work(lo, t), ctx.Work(t, hi));
      if (best_t < 0 || cost < best_cost || m < best_max) {
        best_t = t;
        best_pos = static_cast<int64_t>(i) + 1;
        best_cost = cost;
        best_max = m;
      }
    }
  }
  if (best_t < 0) return false;
  cuts.insert(cuts.begin() + best_pos, static_cast<int32_t>(best_t));
  return true;
}

}  // namespace

std::vector<EvolvedPartition> EvolvePartition(const PlanContext& ctx, const std::vector<int32_t>& natural,
                                              const std::vector<int64_t>& targets) {
  const int64_t k0 = static_cast<int64_t>(natural.size()) - 1;
  std::map<int64_t, EvolvedPartition> done;
  std::vector<int64_t> down, up;
  for (int64_t k : targets) (k <= k0 ? down : up).push_back(k);
  std::sort(down.begin(), down.end(), std::greater<int64_t>());
  std::sort(up.begin(), up.end());

  std::vector<int32_t> cuts = natural;
  bool alive = true;
  for (int64_t k : down) {
    while (alive && static_cast<int64_t>(cuts.size()) - 1 > k) alive = MergeOnce(ctx, cuts);
    EvolvedPartition& e = done[k];
    e.k = k;
    e.feasible = alive && k >= 1;
    if (e.feasible) e.cuts = cuts;
  }
  cuts = natural;
  alive = true;
  for (int64_t k : up) {
    while (alive && static_cast<int64_t>(cuts.size()) - 1 < k) alive = SplitOnce(ctx, cuts);
    EvolvedPartition& e = done[k];
    e.k = k;
    e.feasible = alive;
    if (e.feasible) e.cuts = cuts;
  }
  std::vector<EvolvedPartition> out;
  for (int64_t k : targets) out.push_back(done[k]);
  return out;
}

}  // namespace harts
