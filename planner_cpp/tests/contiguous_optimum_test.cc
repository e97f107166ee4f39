// The exact least-work contiguous partition (penalized DP + Lagrangian search over the
// penalty) against the exact contiguous DP of Eq. 9 (itself checked against brute force in
// contiguous_dp_test) for every K, and over candidate ranges.
#include "harts/contiguous_optimum.h"

#include <algorithm>
#include <random>

#include "check.h"
#include "harts/contiguous_dp.h"
#include "planner_test_util.h"

namespace harts {
namespace {

void CheckCuts(const PlanContext& ctx, const ContiguousOptimum& c) {
  CHECK_EQ(static_cast<int64_t>(c.cuts.size()), c.k + 1);
  CHECK_EQ(c.cuts.front(), 0);
  CHECK_EQ(static_cast<int64_t>(c.cuts.back()), ctx.size());
  for (int64_t i = 0; i < c.k; ++i) {
    CHECK(c.cuts[i] < c.cuts[i + 1]);
    CHECK(ctx.Work(c.cuts[i], c.cuts[i + 1]) <= ctx.capacity());
  }
  CHECK_EQ(CutsTotalWork(ctx, c.cuts), c.total_work);
}

void CheckOne(const std::vector<testing::Traj>& trajs, int64_t cap, std::mt19937& rng) {
  auto batch = testing::MakeBatch(trajs);
  const PlanContext ctx(*batch, cap);
  const int64_t n = ctx.size();
  std::vector<int64_t> ks;
  for (int64_t k = 1; k <= n; ++k) ks.push_back(k);
  const std::vector<ContiguousResult> exact = ExactContiguousPartitions(ctx, ks);
  // Every K (a sample of them on larger batches).
  for (const ContiguousResult& r : exact) {
    if (n > 40 && rng() % 8 != 0) continue;
    const ContiguousOptimum c = OptimalContiguousPartition(ctx, r.k);
    CHECK_EQ(c.feasible, r.feasible);
    CHECK_EQ(c.k, r.k);
    if (!r.feasible) continue;
    CHECK_EQ(c.total_work, r.total_work);
    CheckCuts(ctx, c);
  }
  // Ranges k_min, k_min + D, ..., k_max.
  for (int trial = 0; trial < 6; ++trial) {
    KRange range;
    range.step = 1 + rng() % 4;
    range.k_min = range.step * (1 + rng() % std::max<int64_t>(1, n / range.step));
    range.k_max = range.k_min + range.step * (rng() % (2 + n / range.step));
    int64_t best_total = -1, best_k = -1;
    for (int64_t k = range.k_min; k <= std::min(range.k_max, n); k += range.step)
      if (exact[k - 1].feasible && (best_total < 0 || exact[k - 1].total_work < best_total)) {
        best_total = exact[k - 1].total_work;
        best_k = k;
      }
    const ContiguousOptimum c = OptimalContiguousPartition(ctx, range);
    CHECK_EQ(c.feasible, best_total >= 0);
    if (!c.feasible) continue;
    CHECK_EQ(c.total_work, best_total);
    CHECK_EQ(c.k, best_k);  // ties go to the smaller K
    CheckCuts(ctx, c);
  }
}

}  // namespace
}  // namespace harts

int main() {
  std::mt19937 rng(29);
  for (int trial = 0; trial < 700; ++trial) {
    const int n = 1 + static_cast<int>(rng() % (trial % 5 == 0 ? 160 : 30));
    auto trajs = harts::testing::RandomTrajectories(rng, n, 12, trial % 2 ? 2 : 4, trial % 7 == 0 ? 0.5 : 0.1);
    if (trial % 3 == 0) trajs = harts::testing::WithCommonPrefix(trajs, 1 + static_cast<int>(rng() % 5));
    int64_t longest = 0;
    for (auto& t : trajs) longest = std::max<int64_t>(longest, t.size());
    harts::CheckOne(trajs, longest + static_cast<int64_t>(rng() % (trial % 2 ? 10 : 60)), rng);
  }
  return 0;
}
