// Boundary refinement and sparse repair: invariants, monotone work, and sparse repair's
// single update against a naive search that recomputes C(M).
#include "harts/refinement.h"

#include <algorithm>
#include <random>

#include "check.h"
#include "harts/greedy.h"
#include "harts/natural_partition.h"
#include "harts/sparse_repair.h"
#include "planner_test_util.h"
#include "step_reference.h"

namespace harts {
namespace {

// Largest strict gain of one move (else one swap) within `window`, by recomputation.
int64_t NaiveBestGain(const PlanContext& ctx, const Grouping& g, int64_t window) {
  const int64_t n = ctx.size();
  std::vector<int64_t> group_of(n);
  for (int64_t k = 0; k < g.size(); ++k)
    for (int32_t r : g.groups[k]) group_of[r] = k;
  int64_t best = 0;
  for (int32_t r = 0; r < n; ++r) {
    const int64_t a = group_of[r];
    if (g.groups[a].size() < 2) continue;
    for (int64_t r2 = std::max<int64_t>(0, r - window); r2 <= std::min<int64_t>(n - 1, r + window); ++r2) {
      const int64_t b = group_of[r2];
      if (b == a) continue;
      std::vector<int32_t> ga = g.groups[a], gb = g.groups[b];
      EraseSorted(ga, r);
      InsertSorted(gb, r);
      const int64_t wb = GroupWork(ctx, gb);
      if (wb > ctx.capacity()) continue;
      best = std::max(best, g.work[a] + g.work[b] - GroupWork(ctx, ga) - wb);
    }
  }
  if (best > 0) return best;
  for (int32_t r = 0; r < n; ++r)
    for (int64_t r2 = r + 1; r2 <= std::min<int64_t>(n - 1, r + window); ++r2) {
      const int64_t a = group_of[r], b = group_of[r2];
      if (a == b) continue;
      std::vector<int32_t> ga = g.groups[a], gb = g.groups[b];
      EraseSorted(ga, r);
      InsertSorted(ga, static_cast<int32_t>(r2));
      EraseSorted(gb, static_cast<int32_t>(r2));
      InsertSorted(gb, r);
      const int64_t wa = GroupWork(ctx, ga), wb = GroupWork(ctx, gb);
      if (wa > ctx.capacity() || wb > ctx.capacity()) continue;
      best = std::max(best, g.work[a] + g.work[b] - wa - wb);
    }
  return best;
}

void CheckOne(const std::vector<testing::Traj>& trajs, int64_t cap, std::mt19937& rng) {
  auto batch = testing::MakeBatch(trajs);
  const PlanContext ctx(*batch, cap);
  // Boundary refinement of the natural partition and of random splits of it.
  std::vector<int32_t> cuts = NaturalPartition(ctx);
  for (int extra = 0; extra < 3; ++extra) {
    std::vector<int32_t> c = cuts;
    const int64_t before = CutsTotalWork(ctx, c), before_max = CutsMaxWork(ctx, c);
    RefineBoundaries(ctx, c, 1 + rng() % 8, 2);
    CHECK_EQ(c.size(), cuts.size());
    for (size_t i = 0; i + 1 < c.size(); ++i) {
      CHECK(c[i] < c[i + 1]);
      CHECK(ctx.Work(c[i], c[i + 1]) <= cap);
    }
    const int64_t after = CutsTotalWork(ctx, c);
    CHECK(after < before || (after == before && (c == cuts || CutsMaxWork(ctx, c) <= before_max)));
    // Split a random microbatch to create a suboptimal cut for the next round.
    for (size_t i = 0; i + 1 < cuts.size(); ++i)
      if (cuts[i + 1] - cuts[i] >= 2) {
        cuts.insert(cuts.begin() + i + 1, cuts[i] + 1 + rng() % (cuts[i + 1] - cuts[i] - 1));
        break;
      }
  }
  // Sparse repair of greedy groupings: every update strictly improves by the naive best.
  for (GreedyPolicy policy : {GreedyPolicy::kBestFit, GreedyPolicy::kMaxShared}) {
    Grouping g = GreedyPlace(ctx, ProcessingOrder(ctx, GreedyOrder::kLengthDesc), policy);
    const int64_t window = 1 + rng() % 8;
    for (int it = 0; it < 6; ++it) {
      const int64_t expect = NaiveBestGain(ctx, g, window);
      const int64_t before = g.TotalWork();
      const int64_t k = g.size();
      const int64_t applied = SparseRepair(ctx, g, window, 1);
      testing::CheckGrouping(ctx, g);
      CHECK_EQ(g.size(), k);
      CHECK_EQ(applied, expect > 0 ? 1 : 0);
      CHECK_EQ(before - g.TotalWork(), expect);
      if (!applied) break;
    }
  }
  // Several iterations at once against the reference (full rescans): the same updates in the
  // same order, on greedy groupings and on a contiguous one.
  std::vector<Grouping> starts;
  for (GreedyOrder order : {GreedyOrder::kLexAscending, GreedyOrder::kLengthDesc, GreedyOrder::kUniqueSuffix})
    for (GreedyPolicy policy : {GreedyPolicy::kBestFit, GreedyPolicy::kMaxShared})
      starts.push_back(GreedyPlace(ctx, ProcessingOrder(ctx, order), policy));
  starts.push_back(GroupingFromCuts(ctx, NaturalPartition(ctx)));
  for (const Grouping& start : starts) {
    const int64_t window = rng() % 10;
    const int64_t iterations = rng() % 12;
    Grouping fast = start, slow = start;
    CHECK_EQ(SparseRepair(ctx, fast, window, iterations), reference::SparseRepair(ctx, slow, window, iterations));
    CHECK(fast.groups == slow.groups);
    CHECK(fast.work == slow.work);
    testing::CheckGrouping(ctx, fast);
  }
}

}  // namespace
}  // namespace harts

int main() {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 500; ++trial) {
    const int n = 2 + static_cast<int>(rng() % (trial % 3 == 0 ? 70 : 16));
    auto trajs = harts::testing::RandomTrajectories(rng, n, 10, 3, 0.1);
    if (trial % 4 == 1) trajs = harts::testing::WithCommonPrefix(trajs, 2);
    int64_t longest = 0;
    for (auto& t : trajs) longest = std::max<int64_t>(longest, t.size());
    harts::CheckOne(trajs, longest + static_cast<int64_t>(rng() % 15), rng);
  }
  return 0;
}
