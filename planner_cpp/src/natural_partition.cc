#include "harts/natural_partition.h"

#include <algorithm>
#include <cassert>
#include <tuple>
#include <utility>

namespace harts {
namespace {

// min L_t over t in [a, b], 1 <= a <= b < N.
int64_t MinLcp(const PlanContext& ctx, int32_t a, int32_t b) { return ctx.Lcp(a - 1, b); }

// Largest t in [a, b] with L_t <= m, or -1.
int32_t LastAtMost(const PlanContext& ctx, int32_t a, int32_t b, int64_t m) {
  if (a > b || MinLcp(ctx, a, b) > m) return -1;
  while (a < b) {  // MinLcp(a, b) <= m holds
    const int32_t mid = a + (b - a + 1) / 2;
    if (MinLcp(ctx, mid, b) <= m) {
      a = mid;
    } else {
      b = mid - 1;
    }
  }
  return a;
}

// Smallest t in [a, b] with L_t <= m, or -1.
int32_t FirstAtMost(const PlanContext& ctx, int32_t a, int32_t b, int64_t m) {
  if (a > b || MinLcp(ctx, a, b) > m) return -1;
  while (a < b) {  // MinLcp(a, b) <= m holds
    const int32_t mid = a + (b - a) / 2;
    if (MinLcp(ctx, a, mid) <= m) {
      b = mid;
    } else {
      a = mid + 1;
    }
  }
  return a;
}

// Smallest t in [a, b] with pred(t), for a predicate false then true on [a, b]; b + 1 if none.
template <typename Pred>
int32_t FirstTrue(int32_t a, int32_t b, Pred pred) {
  int32_t hi = b + 1;
  while (a < hi) {
    const int32_t mid = a + (hi - a) / 2;
    if (pred(mid)) {
      hi = mid;
    } else {
      a = mid + 1;
    }
  }
  return a;
}

}  // namespace

int32_t BestValleyCut(const PlanContext& ctx, int32_t lo, int32_t hi, bool with_difference) {
  assert(hi - lo >= 2);
  const int32_t a = lo + 1, b = hi - 1;  // the cuts
  const int64_t m = MinLcp(ctx, a, b);
  auto wl = [&](int32_t t) { return ctx.Work(lo, t); };
  auto wr = [&](int32_t t) { return ctx.Work(t, hi); };
  auto key = [&](int32_t t) {
    const int64_t l = wl(t), r = wr(t);
    return std::make_tuple(std::max(l, r), with_difference ? (l > r ? l - r : r - l) : 0, t);
  };
  // Left part: cuts with W(lo, t) <= W(t, hi), a prefix [a, c]; right part: W(lo, t) >= W(t, hi), a
  // suffix [c2, b].
  const int32_t c = FirstTrue(a, b, [&](int32_t t) { return wl(t) > wr(t); }) - 1;
  const int32_t c2 = FirstTrue(a, b, [&](int32_t t) { return wl(t) >= wr(t); });
  int32_t best = -1;
  const int32_t t1 = LastAtMost(ctx, a, c, m);
  if (t1 >= 0) {
    // Keys 2-3 are nonincreasing on the left part; equal keys span the cuts with the same sides
    // (with_difference) or the same W(t, hi), a range ending at t1: take its first valley.
    const int64_t l1 = wl(t1), r1 = wr(t1);
    int32_t from = FirstTrue(a, t1, [&](int32_t t) { return wr(t) == r1; });
    if (with_difference) from = std::max(from, FirstTrue(a, t1, [&](int32_t t) { return wl(t) == l1; }));
    best = FirstAtMost(ctx, from, t1, m);
  }
  const int32_t t2 = FirstAtMost(ctx, c2, b, m);  // keys 2-3 nondecreasing on the right part
  if (t2 >= 0 && (best < 0 || key(t2) < key(best))) best = t2;
  assert(best >= a && best <= b);
  return best;
}

std::vector<int32_t> NaturalPartition(const PlanContext& ctx, CancelToken* cancel) {
  const int64_t n = ctx.size();
  const int64_t cap = ctx.capacity();
  std::vector<int32_t> cuts = {0};
  // Intervals still to visit, left to right: pop the leftmost (stack top).
  std::vector<std::pair<int32_t, int32_t>> stack = {{0, static_cast<int32_t>(n)}};
  while (!stack.empty()) {
    Poll(cancel);
    const auto [lo, hi] = stack.back();
    stack.pop_back();
    if (hi - lo == 1 || ctx.Work(lo, hi) <= cap) {
      cuts.push_back(hi);
      continue;
    }
    const int32_t best = BestValleyCut(ctx, lo, hi, true);
    stack.push_back({best, hi});
    stack.push_back({lo, best});
  }
  return cuts;
}

}  // namespace harts
