// Exact contiguous DP (Eq. 9) against brute force over all contiguous partitions;
// natural partition against a naive recursive oracle; K range (Eq. 7-8), SampleK and
// merge/split evolution invariants.
#include "harts/contiguous_dp.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <random>
#include <set>

#include "check.h"
#include "harts/candidate_range.h"
#include "harts/evolution.h"
#include "harts/natural_partition.h"
#include "planner_test_util.h"
#include "step_reference.h"

namespace harts {
namespace {

constexpr int64_t kInf = std::numeric_limits<int64_t>::max();

// Best (total, max) over all contiguous partitions of [0, n) into k parts, by
// enumerating every set of k - 1 cut positions.
std::pair<int64_t, int64_t> BruteForce(const PlanContext& ctx, int64_t k) {
  const int64_t n = ctx.size();
  std::pair<int64_t, int64_t> best = {kInf, kInf};
  for (int64_t mask = 0; mask < (int64_t{1} << (n - 1)); ++mask) {
    if (__builtin_popcountll(mask) != k - 1) continue;
    int64_t total = 0, mx = 0, lo = 0;
    bool ok = true;
    for (int64_t t = 1; t <= n; ++t) {
      if (t == n || (mask >> (t - 1) & 1)) {
        const int64_t w = ctx.Work(lo, t);
        if (w > ctx.capacity()) ok = false;
        total += w;
        mx = std::max(mx, w);
        lo = t;
      }
    }
    if (ok) best = std::min(best, std::make_pair(total, mx));
  }
  return best;
}

std::vector<int32_t> NaiveNatural(const PlanContext& ctx) {
  std::vector<int32_t> cuts = {0};
  std::function<void(int32_t, int32_t)> rec = [&](int32_t lo, int32_t hi) {
    if (hi - lo == 1 || ctx.Work(lo, hi) <= ctx.capacity()) {
      cuts.push_back(hi);
      return;
    }
    std::tuple<int64_t, int64_t, int64_t, int32_t> best = {kInf, kInf, kInf, 0};
    for (int32_t t = lo + 1; t < hi; ++t) {
      const int64_t a = ctx.Work(lo, t), b = ctx.Work(t, hi);
      best = std::min(best, std::make_tuple(ctx.AdjacentLcp(t), std::max(a, b), std::abs(a - b), t));
    }
    rec(lo, std::get<3>(best));
    rec(std::get<3>(best), hi);
  };
  rec(0, static_cast<int32_t>(ctx.size()));
  return cuts;
}

void CheckCuts(const PlanContext& ctx, const std::vector<int32_t>& cuts, int64_t k) {
  CHECK_EQ(static_cast<int64_t>(cuts.size()), k + 1);
  CHECK_EQ(cuts.front(), 0);
  CHECK_EQ(static_cast<int64_t>(cuts.back()), ctx.size());
  for (int64_t i = 0; i < k; ++i) {
    CHECK(cuts[i] < cuts[i + 1]);
    CHECK(ctx.Work(cuts[i], cuts[i + 1]) <= ctx.capacity());
  }
}

void CheckOne(const std::vector<testing::Traj>& trajs, int64_t cap) {
  auto batch = testing::MakeBatch(trajs);
  const PlanContext ctx(*batch, cap);
  const int64_t n = ctx.size();
  std::vector<int64_t> ks;
  for (int64_t k = 1; k <= n; ++k) ks.push_back(k);
  const std::vector<ContiguousResult> res = ExactContiguousPartitions(ctx, ks);
  for (const ContiguousResult& r : res) {
    const auto bf = BruteForce(ctx, r.k);
    CHECK_EQ(r.feasible, bf.first != kInf);
    if (!r.feasible) continue;
    CHECK_EQ(r.total_work, bf.first);
    CHECK_EQ(r.max_work, bf.second);
    CheckCuts(ctx, r.cuts, r.k);
    CHECK_EQ(CutsTotalWork(ctx, r.cuts), r.total_work);
    CHECK_EQ(CutsMaxWork(ctx, r.cuts), r.max_work);
  }

  const std::vector<int32_t> natural = NaturalPartition(ctx);
  CHECK(natural == NaiveNatural(ctx));
  const int64_t k0 = static_cast<int64_t>(natural.size()) - 1;
  CheckCuts(ctx, natural, k0);

  for (int64_t d = 1; d <= 3; ++d) {
    const KRange range = CandidateRange(ctx.Work(0, n), n, d, cap, k0);
    CHECK(range.k_min % d == 0 && range.k_max % d == 0 && range.k_min <= range.k_max);
    const int64_t g = ctx.Work(0, n);
    CHECK(range.k_min * cap >= g);
    CHECK(range.k_min == d || (range.k_min - d) * cap < g);
    const int64_t k_max = std::max(range.k_min, std::min(d * ((k0 + d - 1) / d), d * (n / d)));
    CHECK_EQ(range.k_max, k_max);
    const std::vector<int64_t> targets = SampleK(range, 4);
    CHECK(static_cast<int64_t>(targets.size()) == std::min<int64_t>(4, range.Count()));
    CHECK(targets.front() == range.k_min && targets.back() == range.k_max);
    for (const EvolvedPartition& e : EvolvePartition(ctx, natural, targets)) {
      if (e.feasible) CheckCuts(ctx, e.cuts, e.k);
      // Splitting is always legal up to N; merging may fail.
      if (e.k >= k0 && e.k <= n) CHECK(e.feasible);
    }
  }
}

// Natural partition, BestValleyCut and evolution against the reference (rescanning)
// implementations, on batches too large for brute force; every target K of the range.
void CheckAgainstReference(const std::vector<testing::Traj>& trajs, int64_t cap) {
  auto batch = testing::MakeBatch(trajs);
  const PlanContext ctx(*batch, cap);
  const int64_t n = ctx.size();
  const std::vector<int32_t> natural = NaturalPartition(ctx);
  CHECK(natural == reference::NaturalPartition(ctx));
  for (int32_t lo = 0; lo + 2 <= n; lo += 1 + static_cast<int32_t>(n / 7))
    for (int32_t hi = lo + 2; hi <= n; hi += 1 + static_cast<int32_t>(n / 9))
      for (bool diff : {false, true}) {
        std::tuple<int64_t, int64_t, int64_t, int32_t> best = {kInf, kInf, kInf, 0};
        for (int32_t t = lo + 1; t < hi; ++t) {
          const int64_t a = ctx.Work(lo, t), b = ctx.Work(t, hi);
          best = std::min(best, std::make_tuple(ctx.AdjacentLcp(t), std::max(a, b), diff ? std::abs(a - b) : 0, t));
        }
        CHECK_EQ(BestValleyCut(ctx, lo, hi, diff), std::get<3>(best));
      }
  const int64_t k0 = static_cast<int64_t>(natural.size()) - 1;
  std::vector<int64_t> targets;
  for (int64_t k = 1; k <= n; ++k) targets.push_back(k);
  const std::vector<EvolvedPartition> fast = EvolvePartition(ctx, natural, targets);
  const std::vector<EvolvedPartition> slow = reference::EvolvePartition(ctx, natural, targets);
  CHECK_EQ(fast.size(), slow.size());
  for (size_t i = 0; i < fast.size(); ++i) {
    CHECK_EQ(fast[i].k, slow[i].k);
    CHECK_EQ(fast[i].feasible, slow[i].feasible);
    CHECK(fast[i].cuts == slow[i].cuts);
    if (fast[i].k >= k0) CHECK(fast[i].feasible);
  }
}

}  // namespace
}  // namespace harts

int main() {
  {
    std::mt19937 rng(23);
    for (int trial = 0; trial < 300; ++trial) {
      const int n = 2 + static_cast<int>(rng() % 80);
      auto trajs = harts::testing::RandomTrajectories(rng, n, 12, trial % 2 ? 2 : 4, 0.15);
      if (trial % 3 == 0) trajs = harts::testing::WithCommonPrefix(trajs, 3);
      int64_t longest = 0;
      for (auto& t : trajs) longest = std::max<int64_t>(longest, t.size());
      harts::CheckAgainstReference(trajs, longest + static_cast<int64_t>(rng() % 40));
    }
  }
  std::mt19937 rng(11);
  for (int trial = 0; trial < 400; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 9);
    auto trajs = harts::testing::RandomTrajectories(rng, n, 8, 3, 0.15);
    int64_t longest = 0;
    for (auto& t : trajs) longest = std::max<int64_t>(longest, t.size());
    const int64_t cap = longest + static_cast<int64_t>(rng() % 12);
    harts::CheckOne(trajs, cap);
  }
  // SampleK on a large range: budget respected, endpoints kept, dense head.
  harts::KRange big{4, 400, 4};
  auto s = harts::SampleK(big, 32);
  CHECK(s.size() <= 32 && s.front() == 4 && s.back() == 400);
  for (int i = 0; i < 16; ++i) CHECK_EQ(s[i], 4 + 4 * i);
  CHECK(std::is_sorted(s.begin(), s.end()));
  CHECK(std::set<int64_t>(s.begin(), s.end()).size() == s.size());
  return 0;
}
