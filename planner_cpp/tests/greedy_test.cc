// Trie-aware greedy: the placement index against a full probe of every microbatch, and every
// phase (placement, elimination, alignment, RunGreedy, RunComponentGreedy) against the
// straightforward reference implementation (step_reference.h), tie rules included; on random
// batches, batches behind a common prefix (floor > 0) and with several components.
#include "harts/greedy.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <random>

#include "check.h"
#include "harts/placement_index.h"
#include "planner_test_util.h"
#include "step_reference.h"

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

void CheckSameGroupingAt(const Grouping& a, const Grouping& b, int line) {
  if (!(a.groups == b.groups && a.work == b.work)) {
    std::fprintf(stderr, "grouping differs (line %d)\n", line);
    for (const Grouping* x : {&a, &b}) {
      for (size_t k = 0; k < x->groups.size(); ++k) {
        std::fprintf(stderr, " [");
        for (int32_t r : x->groups[k]) std::fprintf(stderr, "%d ", r);
        std::fprintf(stderr, "]w%lld", static_cast<long long>(x->work[k]));
      }
      std::fprintf(stderr, "\n");
    }
  }
  CHECK(a.groups == b.groups);
  CHECK(a.work == b.work);
}
#define CheckSameGrouping(a, b) CheckSameGroupingAt(a, b, __LINE__)

// PlacementIndex::Best against probing every live group, on a random grouping of a random
// subset of the ranks, with random exclusions and retirements.
void CheckIndex(const PlanContext& ctx, std::mt19937& rng, int32_t max_depth = 4) {
  const int32_t n = static_cast<int32_t>(ctx.size());
  std::vector<int32_t> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const int32_t placed = static_cast<int32_t>(rng() % (n + 1));
  Grouping g;
  std::vector<int32_t> present(perm.begin(), perm.begin() + placed);
  const int64_t groups = 1 + rng() % std::max(1, placed);
  for (int32_t r : present) {
    const int64_t k = rng() % groups;
    if (k >= g.size()) {
      g.groups.push_back({r});
    } else {
      InsertSorted(g.groups[k], r);
    }
  }
  for (auto& m : g.groups) g.work.push_back(GroupWork(ctx, m));
  // Small nodes and several levels, so that small batches exercise the hierarchy.
  PlacementIndex index(ctx, 0, n, &g, nullptr, 2 + static_cast<int32_t>(rng() % 6),
                       static_cast<int32_t>(rng() % (max_depth + 1)));
  std::vector<char> retired(g.size(), 0);
  for (int64_t k = 0; k < g.size(); ++k)
    if (rng() % 5 == 0) {
      index.Retire(k);
      retired[k] = 1;
    }
  for (int32_t i = placed; i < n; ++i) {
    const int32_t r = perm[i];
    const int64_t exclude = g.size() > 0 && rng() % 3 == 0 ? static_cast<int64_t>(rng() % g.size()) : -1;
    for (GreedyPolicy policy : {GreedyPolicy::kBestFit, GreedyPolicy::kMaxShared}) {
      int64_t best = -1, best_shared = -1, best_after = -1;
      for (int64_t k = 0; k < g.size(); ++k) {
        if (k == exclude || retired[k]) continue;
        const int64_t shared = SharedAmount(ctx, g.groups[k], r);
        const int64_t after = g.work[k] + ctx.Length(r) - shared;
        if (after > ctx.capacity()) continue;
        const bool better = policy == GreedyPolicy::kBestFit
                                ? after > best_after
                                : (shared > best_shared || (shared == best_shared && after > best_after));
        if (best < 0 || better) {
          best = k;
          best_shared = shared;
          best_after = after;
        }
      }
      const PlacementIndex::Choice c = index.Best(r, policy, exclude);
      CHECK_EQ(c.group, best);
      if (best >= 0) {
        CHECK_EQ(c.after, best_after);
        CHECK_EQ(c.shared, best_shared);
      }
    }
    // Place r somewhere (or open a group) to vary the state.
    const PlacementIndex::Choice c = index.Best(r, GreedyPolicy::kBestFit);
    if (c.group >= 0 && rng() % 4 != 0) {
      index.Insert(c.group, r, c.after);
    } else {
      index.NewGroup(r);
      retired.push_back(0);
    }
  }
}

void CheckOne(const std::vector<testing::Traj>& trajs, int64_t cap, std::mt19937& rng) {
  auto batch = testing::MakeBatch(trajs);
  const PlanContext ctx(*batch, cap);
  const int64_t n = ctx.size();
  for (int i = 0; i < 3; ++i) CheckIndex(ctx, rng);
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
      CheckSameGrouping(g, reference::GreedyPlace(ctx, seq, policy));
      const int64_t k_before = g.size();
      Grouping ref = g;
      const bool any = EliminateSmallMicrobatches(ctx, g);
      CHECK_EQ(any, reference::EliminateSmallMicrobatches(ctx, ref));
      CheckSameGrouping(g, ref);
      testing::CheckGrouping(ctx, g);
      CHECK(g.size() <= k_before);
      for (int64_t d = 1; d <= 5; ++d) {
        Grouping a = g, b = g;
        const bool ok = AlignToDp(ctx, a, d);
        const int64_t target = (g.size() + d - 1) / d * d;
        CHECK_EQ(ok, target <= n);
        CHECK_EQ(ok, reference::AlignToDp(ctx, b, d));
        if (!ok) continue;
        CheckSameGrouping(a, b);
        testing::CheckGrouping(ctx, a);
        CHECK_EQ(a.size(), target);
      }
    }
  }
  for (int64_t d = 1; d <= 4; ++d) {
    std::optional<Grouping> whole;
    const GreedyResult r = RunGreedy(ctx, d, nullptr, &whole);
    CHECK_EQ(r.plans_over_budget, 0);
    const GreedyResult rr = reference::RunGreedy(ctx, d);
    CHECK_EQ(r.feasible, rr.feasible);
    if (r.feasible) {
      testing::CheckGrouping(ctx, r.grouping);
      CHECK(r.grouping.size() % d == 0);
      CheckSameGrouping(r.grouping, rr.grouping);
      CHECK_EQ(r.name, rr.name);
    }
    const GreedyResult c = RunComponentGreedy(ctx, d);
    const GreedyResult cr = reference::RunComponentGreedy(ctx, d);
    CHECK_EQ(c.feasible, cr.feasible);
    if (c.feasible) {
      testing::CheckGrouping(ctx, c.grouping);
      CHECK(c.grouping.size() % d == 0);
      CheckSameGrouping(c.grouping, cr.grouping);
    }
    // Handing over RunGreedy's least-work plan (used when the batch is one component) changes nothing.
    const GreedyResult cw = RunComponentGreedy(ctx, d, nullptr, &whole);
    CHECK_EQ(cw.feasible, c.feasible);
    if (c.feasible) CheckSameGrouping(cw.grouping, c.grouping);
  }
}

// The step budget: deterministic step counts, a placement over budget is flagged (and stops), an
// elimination over budget stops with a valid grouping, and a budget that suffices changes nothing.
void CheckBudget(const PlanContext& ctx, std::mt19937& rng) {
  for (GreedyOrder order : {GreedyOrder::kLexAscending, GreedyOrder::kUniqueSuffix}) {
    const std::vector<int32_t> seq = ProcessingOrder(ctx, order);
    for (GreedyPolicy policy : {GreedyPolicy::kBestFit, GreedyPolicy::kMaxShared}) {
      const Grouping plain = GreedyPlace(ctx, seq, policy);
      StepBudget unlimited{std::numeric_limits<int64_t>::max()};
      const Grouping counted = GreedyPlace(ctx, seq, policy, nullptr, &unlimited);
      CheckSameGrouping(counted, plain);
      const int64_t placed = unlimited.used;
      CHECK(placed > 0);
      StepBudget exact{placed};
      CheckSameGrouping(GreedyPlace(ctx, seq, policy, nullptr, &exact), plain);
      CHECK_EQ(exact.used, placed);
      CHECK(!exact.exhausted());
      StepBudget short_one{placed - 1 - static_cast<int64_t>(rng() % placed)};
      const Grouping part = GreedyPlace(ctx, seq, policy, nullptr, &short_one);
      CHECK(short_one.exhausted());
      int64_t covered = 0;
      for (const auto& m : part.groups) covered += static_cast<int64_t>(m.size());
      CHECK(covered <= ctx.size());
      // Elimination: the unlimited run, then budgets from none to enough.
      Grouping full = plain;
      const bool any = EliminateSmallMicrobatches(ctx, full, nullptr, &unlimited);
      const int64_t total = unlimited.used;
      for (int i = 0; i < 6; ++i) {
        const int64_t limit = placed + static_cast<int64_t>(rng() % (total - placed + 2));
        StepBudget b{limit, placed};
        Grouping g = plain;
        const bool some = EliminateSmallMicrobatches(ctx, g, nullptr, &b);
        testing::CheckGrouping(ctx, g);
        CHECK(g.size() >= full.size() && g.size() <= plain.size());
        CHECK(!some || any);
        if (limit >= total) {
          CHECK(!b.exhausted());
          CheckSameGrouping(g, full);
        }
      }
    }
  }
}

void CheckCancel() {
  std::mt19937 rng(11);
  auto batch = testing::MakeBatch(testing::RandomTrajectories(rng, 300, 12, 3));
  const PlanContext ctx(*batch, 40);
  CancelToken token;
  token.Cancel();
  testing::ExpectError<Cancelled>([&] { RunGreedy(ctx, 2, &token); }, "cancelled");
  testing::ExpectError<Cancelled>([&] { RunComponentGreedy(ctx, 2, &token); }, "cancelled");
  CancelToken expired;
  expired.SetDeadlineAfter(std::chrono::seconds(-1));
  testing::ExpectError<Cancelled>([&] { RunGreedy(ctx, 2, &expired); }, "deadline");
}

}  // namespace
}  // namespace harts

int main() {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 600; ++trial) {
    const int n = 1 + static_cast<int>(rng() % (trial % 4 == 0 ? 60 : 14));
    auto trajs = harts::testing::RandomTrajectories(rng, n, 10, 3, 0.15);
    if (trial % 3 == 1) trajs = harts::testing::WithCommonPrefix(trajs, 1 + static_cast<int>(rng() % 4));
    if (trial % 3 == 2) trajs = harts::testing::WithPrompts(trajs, 1 + static_cast<int>(rng() % 3), rng);
    int64_t longest = 0;
    for (auto& t : trajs) longest = std::max<int64_t>(longest, t.size());
    harts::CheckOne(trajs, longest + static_cast<int64_t>(rng() % 20), rng);
  }
  // Large batches behind a few system prompts: the default hierarchy has node levels.
  for (int trial = 0; trial < 6; ++trial) {
    auto trajs = harts::testing::RandomTrajectories(rng, 260 + static_cast<int>(rng() % 240), 12, 4, 0.1);
    trajs = harts::testing::WithPrompts(trajs, 1 + trial % 4, rng);
    int64_t longest = 0;
    for (auto& t : trajs) longest = std::max<int64_t>(longest, t.size());
    harts::CheckOne(trajs, longest + static_cast<int64_t>(rng() % 60), rng);
  }
  // Bushy, deep trees (many chains of nested nodes): the index with deep hierarchies, the whole
  // greedy against the reference, and the step budget.
  for (int trial = 0; trial < 24; ++trial) {
    const harts::testing::Tree t =
        harts::testing::BushyForest(rng, 1 + trial % 3, 20 + static_cast<int>(rng() % 120), trial % 2 == 0 ? 0.3 : 0.8);
    auto batch = harts::testing::MakeTreeBatch(t);
    int64_t longest = 0;
    for (int64_t len : batch->lengths()) longest = std::max(longest, len);
    const harts::PlanContext ctx(*batch, longest + static_cast<int64_t>(rng() % (4 * longest)));
    for (int i = 0; i < 3; ++i) harts::CheckIndex(ctx, rng, 12);
    if (trial % 4 == 0) harts::CheckOne(harts::testing::TreeTrajectories(t), ctx.capacity(), rng);
    harts::CheckBudget(ctx, rng);
  }
  harts::CheckCancel();
  return 0;
}
