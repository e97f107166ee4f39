// Trie-aware greedy against a naive re-implementation that recomputes C(M) for every
// probe; elimination, alignment and component-greedy invariants.
#include "harts/greedy.h"

#include <algorithm>
#include <random>

#include "check.h"
#include "planner_test_util.h"

namespace harts {
namespace {

Grouping NaiveGreedy(const PlanContext& ctx, const std::vector<int32_t>& seq, GreedyPolicy policy) {
  Grouping g;
  for (int32_t r : seq) {
    int64_t best = -1, best_key = -1, best_after = -1;
    for (int64_t k = 0; k < g.size(); ++k) {
      std::vector<int32_t> with = g.groups[k];
      InsertSorted(with, r);
      const int64_t after = GroupWork(ctx, with);
      if (after > ctx.capacity()) continue;
      const int64_t shared = ctx.Length(r) - (after - g.work[k]);
      const int64_t key = policy == GreedyPolicy::kBestFit ? after : shared;
      if (key > best_key || (key == best_key && after > best_after)) {
        best = k;
        best_key = key;
        best_after = after;
      }
    }
    if (best < 0) {
      g.groups.push_back({r});
      g.work.push_back(ctx.Length(r));
    } else {
      InsertSorted(g.groups[best], r);
      g.work[best] = best_after;
    }
  }
  return g;
}

void CheckOne(const std::vector<testing::Traj>& trajs, int64_t cap) {
  auto batch = testing::MakeBatch(trajs);
  const PlanContext ctx(*batch, cap);
  const int64_t n = ctx.size();
  for (GreedyOrder order : {GreedyOrder::kLexAscending, GreedyOrder::kLexDescending, GreedyOrder::kLengthDesc,
                            GreedyOrder::kUniqueSuffix}) {
    const std::vector<int32_t> seq = ProcessingOrder(ctx, order);
    std::vector<int32_t> sorted = seq;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t r = 0; r < n; ++r) CHECK_EQ(sorted[r], r);
    if (order == GreedyOrder::kLengthDesc)
      for (int64_t i = 1; i < n; ++i) CHECK(ctx.Length(seq[i - 1]) >= ctx.Length(seq[i]));
    for (GreedyPolicy policy : {GreedyPolicy::kBestFit, GreedyPolicy::kMaxShared}) {
      Grouping g = GreedyPlace(ctx, seq, policy);
      testing::CheckGrouping(ctx, g);
      const Grouping naive = NaiveGreedy(ctx, seq, policy);
      CHECK(g.groups == naive.groups);
      const int64_t k_before = g.size();
      EliminateSmallMicrobatches(ctx, g);
      testing::CheckGrouping(ctx, g);
      CHECK(g.size() <= k_before);
      for (int64_t d = 1; d <= 4; ++d) {
        Grouping a = g;
        const bool ok = AlignToDp(ctx, a, d);
        const int64_t target = (g.size() + d - 1) / d * d;
        CHECK_EQ(ok, target <= n);
        if (!ok) continue;
        testing::CheckGrouping(ctx, a);
        CHECK_EQ(a.size(), target);
      }
    }
  }
  for (int64_t d = 1; d <= 4; ++d) {
    const GreedyResult r = RunGreedy(ctx, d);
    if (r.feasible) {
      testing::CheckGrouping(ctx, r.grouping);
      CHECK(r.grouping.size() % d == 0);
    }
    const GreedyResult c = RunComponentGreedy(ctx, d);
    if (c.feasible) {
      testing::CheckGrouping(ctx, c.grouping);
      CHECK(c.grouping.size() % d == 0);
      // A component that fits T is never split.
      for (const auto& m : c.grouping.groups)
        for (size_t j = 1; j < m.size(); ++j) CHECK(m[j] > m[j - 1]);
    }
  }
}

}  // namespace
}  // namespace harts

int main() {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 14);
    auto trajs = harts::testing::RandomTrajectories(rng, n, 10, 3, 0.15);
    int64_t longest = 0;
    for (auto& t : trajs) longest = std::max<int64_t>(longest, t.size());
    harts::CheckOne(trajs, longest + static_cast<int64_t>(rng() % 20));
  }
  return 0;
}
