#include "harts/contiguous_optimum.h"

#include <algorithm>
#include <cassert>
#include <deque>

namespace harts {
namespace {

// Penalized contiguous DP (see the header) with its per-prefix part-count ranges.
class PenalizedDp {
 public:
  PenalizedDp(const PlanContext& ctx, CancelToken* cancel)
      : ctx_(ctx), n_(ctx.size()), first_(n_ + 1, 0), f_(n_ + 1), lo_(n_ + 1), hi_(n_ + 1), cancel_(cancel) {
    for (int64_t e = 1, s = 0; e <= n_; ++e) {
      while (s < e - 1 && ctx.Work(s, e) > ctx.capacity()) ++s;
      first_[e] = static_cast<int32_t>(s);
    }
    for (int64_t t = 1; t < n_; ++t) max_lcp_ = std::max(max_lcp_, ctx.AdjacentLcp(t));
  }

  int64_t max_lcp() const { return max_lcp_; }

  // Runs the pass for `lambda`; f(N), and the least / largest optimal part counts of [0, N).
  void Solve(int64_t lambda) {
    lambda_ = lambda;
    f_[0] = 0;
    lo_[0] = hi_[0] = 0;
    // Deques of starts s, keys increasing from the front: (f(s) + cost(s), lo(s)) and
    // (f(s) + cost(s), -hi(s)).
    by_lo_.clear();
    by_hi_.clear();
    for (int64_t e = 1; e <= n_; ++e) {
      Poll(cancel_);
      const int32_t s = static_cast<int32_t>(e - 1);
      const int64_t v = Value(s);
      while (!by_lo_.empty() &&
             (Value(by_lo_.back()) > v || (Value(by_lo_.back()) == v && lo_[by_lo_.back()] >= lo_[s])))
        by_lo_.pop_back();
      by_lo_.push_back(s);
      while (!by_hi_.empty() &&
             (Value(by_hi_.back()) > v || (Value(by_hi_.back()) == v && hi_[by_hi_.back()] <= hi_[s])))
        by_hi_.pop_back();
      by_hi_.push_back(s);
      while (by_lo_.front() < first_[e]) by_lo_.pop_front();
      while (by_hi_.front() < first_[e]) by_hi_.pop_front();
      f_[e] = Value(by_lo_.front()) + lambda;
      assert(Value(by_hi_.front()) + lambda == f_[e]);
      lo_[e] = lo_[by_lo_.front()] + 1;
      hi_[e] = hi_[by_hi_.front()] + 1;
    }
  }

  int64_t lo() const { return lo_[n_]; }
  int64_t hi() const { return hi_[n_]; }
  int64_t value() const { return f_[n_]; }

  // After Solve: cuts of an optimal partition with exactly k parts, lo() <= k <= hi(); empty if
  // the count ranges do not allow it (they always do for a convex c).
  std::vector<int32_t> Recover(int64_t k) const {
    std::vector<int32_t> cuts = {static_cast<int32_t>(n_)};
    int64_t e = n_, j = k;
    while (e > 0) {
      int64_t pick = -1;
      for (int64_t s = e - 1; s >= first_[e]; --s) {
        if (Value(static_cast<int32_t>(s)) + lambda_ != f_[e]) continue;
        if (lo_[s] <= j - 1 && j - 1 <= hi_[s]) {
          pick = s;
          break;
        }
      }
      if (pick < 0) return {};
      cuts.push_back(static_cast<int32_t>(pick));
      e = pick;
      --j;
    }
    if (j != 0) return {};
    std::reverse(cuts.begin(), cuts.end());
    return cuts;
  }

 private:
  int64_t Value(int32_t s) const { return f_[s] + (s == 0 ? 0 : ctx_.AdjacentLcp(s)); }

  const PlanContext& ctx_;
  const int64_t n_;
  std::vector<int32_t> first_;  // first_[e]: the smallest s with W(s, e) <= T
  std::vector<int64_t> f_;
  std::vector<int32_t> lo_, hi_;
  std::deque<int32_t> by_lo_, by_hi_;
  int64_t lambda_ = 0;
  int64_t max_lcp_ = 0;
  CancelToken* cancel_;
};

// The fewest parts of a feasible contiguous partition (greedy farthest reach). O(K log N).
int64_t LeastParts(const PlanContext& ctx) {
  const int64_t n = ctx.size();
  int64_t parts = 0;
  for (int64_t s = 0; s < n; ++parts) {
    int64_t lo = s + 1, hi = n;  // the largest e with W(s, e) <= T; e = s + 1 always fits
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (ctx.Work(s, mid) <= ctx.capacity()) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    s = lo;
  }
  return parts;
}

ContiguousOptimum Finish(const PlanContext& ctx, PenalizedDp& dp, int64_t k, int64_t lambda) {
  ContiguousOptimum out;
  out.k = k;
  dp.Solve(lambda);
  if (dp.lo() > k || dp.hi() < k) return out;  // unreachable for a convex c
  out.cuts = dp.Recover(k);
  if (out.cuts.empty()) return out;
  out.feasible = true;
  out.total_work = ctx.Work(0, ctx.size()) + dp.value() - lambda * k;
  assert(out.total_work == CutsTotalWork(ctx, out.cuts));
  return out;
}

// Exactly k parts, lf <= k <= N (lf = LeastParts).
ContiguousOptimum SolveExactly(const PlanContext& ctx, PenalizedDp& dp, int64_t k) {
  // The smallest lambda whose least optimal count is <= k. At lambda = max L + 1 an extra
  // part never pays, at -(max L + 1) it always does; counts only fall as lambda grows, and
  // c(K) - c(K + 1) <= S bounds the penalties above.
  int64_t lo = -(dp.max_lcp() + 1), hi = int64_t{1} << 32;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    dp.Solve(mid);
    if (dp.lo() <= k) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return Finish(ctx, dp, k, lo);
}

}  // namespace

ContiguousOptimum OptimalContiguousPartition(const PlanContext& ctx, int64_t k, CancelToken* cancel) {
  const int64_t n = ctx.size();
  ContiguousOptimum out;
  out.k = k;
  if (n == 0 || k < LeastParts(ctx) || k > n) return out;
  PenalizedDp dp(ctx, cancel);
  dp.Solve(0);
  if (dp.lo() <= k && k <= dp.hi()) return Finish(ctx, dp, k, 0);
  return SolveExactly(ctx, dp, k);
}

ContiguousOptimum OptimalContiguousPartition(const PlanContext& ctx, const KRange& range, CancelToken* cancel) {
  const int64_t n = ctx.size();
  ContiguousOptimum none;
  if (n == 0 || range.Count() == 0) return none;
  const int64_t least = LeastParts(ctx);
  const int64_t step = range.step;
  // Range values within [least, N].
  auto up_from = [&](int64_t x) {  // the smallest range value >= x, or -1
    const int64_t k = x <= range.k_min ? range.k_min : range.k_min + (x - range.k_min + step - 1) / step * step;
    return k <= std::min(range.k_max, n) ? k : -1;
  };
  auto down_from = [&](int64_t x) {  // the largest range value <= x, or -1
    if (x < range.k_min) return int64_t{-1};
    const int64_t k = range.k_min + (std::min(x, range.k_max) - range.k_min) / step * step;
    return k >= least ? k : -1;
  };
  PenalizedDp dp(ctx, cancel);
  dp.Solve(0);
  const int64_t inside = up_from(std::max(dp.lo(), least));
  if (inside >= 0 && inside <= dp.hi()) return Finish(ctx, dp, inside, 0);
  ContiguousOptimum best;
  const int64_t below = down_from(dp.lo() - 1);
  const int64_t above = up_from(dp.hi() + 1);
  for (int64_t k : {below, above}) {
    if (k < 0) continue;
    ContiguousOptimum c = SolveExactly(ctx, dp, k);
    if (c.feasible && (!best.feasible || c.total_work < best.total_work)) best = std::move(c);
  }
  return best;
}

}  // namespace harts
