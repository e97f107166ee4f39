#include "harts/greedy.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <set>
#include <utility>

namespace harts {

const char* GreedyOrderName(GreedyOrder order) {
  switch (order) {
    case GreedyOrder::kLexAscending:
      return "lex-ascending";
    case GreedyOrder::kLexDescending:
      return "lex-descending";
    case GreedyOrder::kLengthDesc:
      return "length-descending";
    case GreedyOrder::kUniqueSuffix:
      return "unique-suffix";
  }
  return "?";
}

const char* GreedyPolicyName(GreedyPolicy policy) {
  return policy == GreedyPolicy::kBestFit ? "best-fit" : "max-shared";
}

std::vector<int32_t> ProcessingOrder(const PlanContext& ctx, GreedyOrder order, CancelToken* cancel) {
  const int64_t n = ctx.size();
  std::vector<int32_t> seq;
  ResizePolled(&seq, n, cancel);
  ForEachChunk(0, n, kPollChunk, cancel,
               [&](int64_t lo, int64_t hi) { std::iota(&seq[lo], &seq[lo] + (hi - lo), lo); });
  switch (order) {
    case GreedyOrder::kLexAscending:
      break;
    case GreedyOrder::kLexDescending:
      std::reverse(seq.begin(), seq.end());
      break;
    case GreedyOrder::kLengthDesc:
      StableSortPolled(&seq, [&](int32_t a, int32_t b) { return ctx.Length(a) > ctx.Length(b); }, cancel);
      break;
    case GreedyOrder::kUniqueSuffix: {
      std::vector<int64_t> u;
      ResizePolled(&u, n, cancel);
      ForEachBlock(0, n, cancel, [&](int64_t r) {
        const int64_t lp = r > 0 ? ctx.AdjacentLcp(r) : 0;
        const int64_t lq = r + 1 < n ? ctx.AdjacentLcp(r + 1) : 0;
        u[r] = ctx.Length(r) - std::max(lp, lq);
      });
      StableSortPolled(&seq, [&](int32_t a, int32_t b) { return u[a] > u[b]; }, cancel);
      break;
    }
  }
  return seq;
}

namespace {

// [min, max + 1) of the ranks of `g` ([0, 0) when empty).
std::pair<int32_t, int32_t> RankSpan(const Grouping& g) {
  int32_t lo = std::numeric_limits<int32_t>::max(), hi = 0;
  for (const std::vector<int32_t>& m : g.groups) {
    if (m.empty()) continue;
    lo = std::min(lo, m.front());
    hi = std::max(hi, m.back() + 1);
  }
  return lo < hi ? std::make_pair(lo, hi) : std::make_pair(0, 0);
}

// Ranks [lo, hi) cut into contiguous pieces, each extended while its work fits the capacity
// (every rank fits alone). O(hi - lo).
Grouping ContiguousFirstFit(const PlanContext& ctx, int32_t lo, int32_t hi) {
  Grouping g;
  for (int32_t a = lo; a < hi;) {
    int32_t b = a + 1;
    while (b < hi && ctx.Work(a, b + 1) <= ctx.capacity()) ++b;
    std::vector<int32_t> piece(b - a);
    std::iota(piece.begin(), piece.end(), a);
    g.groups.push_back(std::move(piece));
    g.work.push_back(ctx.Work(a, b));
    a = b;
  }
  return g;
}

}  // namespace

Grouping GreedyPlace(const PlanContext& ctx, const std::vector<int32_t>& sequence, GreedyPolicy policy,
                     CancelToken* cancel, StepBudget* budget) {
  if (sequence.empty()) return Grouping();
  Disposable<Grouping> g;
  const auto [lo, hi] = std::minmax_element(sequence.begin(), sequence.end());
  Disposable<PlacementIndex> index(ctx, *lo, *hi + 1, &*g, cancel);
  const int64_t base = budget != nullptr ? budget->used : 0;
  for (int32_t r : sequence) {
    Poll(cancel);
    if (budget != nullptr) {
      budget->used = base + index->steps();
      if (budget->exhausted()) break;
    }
    const PlacementIndex::Choice c = index->Best(r, policy);
    if (c.group < 0) {
      index->NewGroup(r);
    } else {
      index->Insert(c.group, r, c.after);
    }
  }
  if (budget != nullptr) budget->used = base + index->steps();
  index->Release(cancel);
  return std::move(*g);
}

bool EliminateSmallMicrobatches(const PlanContext& ctx, Grouping& g, CancelToken* cancel, StepBudget* budget) {
  const int64_t k = g.size();
  std::vector<int64_t> visit;
  ResizePolled(&visit, k, cancel);
  ForEachBlock(0, k, cancel, [&](int64_t c) { visit[c] = c; });
  StableSortPolled(&visit, [&](int64_t a, int64_t b) { return g.work[a] < g.work[b]; }, cancel);
  const auto [lo, hi] = RankSpan(g);
  Disposable<PlacementIndex> holder(ctx, lo, hi, &g, cancel);
  PlacementIndex& index = *holder;
  std::vector<char> removed(k, 0);
  bool any = false;
  struct Move {
    int64_t dest;
    int32_t rank;
    int64_t old_work;
  };
  std::vector<Move> moved;
  const int64_t base = budget != nullptr ? budget->used : 0;
  bool stopped = false;  // the budget ran out
  for (int64_t c : visit) {
    // Tentatively move every member of c (the smallest dC, then the largest resulting work,
    // then the lowest index: the max-shared order); undo on failure.
    moved.clear();
    bool ok = true;
    for (int32_t r : g.groups[c]) {
      Poll(cancel);
      if (budget != nullptr) {
        budget->used = base + index.steps();
        if (budget->exhausted()) {
          stopped = true;
          ok = false;
          break;
        }
      }
      const PlacementIndex::Choice best = index.Best(r, GreedyPolicy::kMaxShared, c);
      if (best.group < 0) {
        ok = false;
        break;
      }
      moved.push_back({best.group, r, g.work[best.group]});
      index.Insert(best.group, r, best.after);
    }
    if (ok) {
      removed[c] = 1;
      index.Retire(c);
      any = true;
    } else {
      for (size_t j = moved.size(); j-- > 0;) index.Erase(moved[j].dest, moved[j].rank, moved[j].old_work);
    }
    if (stopped) break;
  }
  if (budget != nullptr) budget->used = base + index.steps();
  if (any) {
    Grouping kept;
    for (int64_t c = 0; c < k; ++c) {
      Poll(cancel);
      if (removed[c]) continue;
      kept.groups.push_back(std::move(g.groups[c]));
      kept.work.push_back(g.work[c]);
    }
    ReleasePolled(&g, cancel);
    g = std::move(kept);
  }
  index.Release(cancel);
  return any;
}

bool AlignToDp(const PlanContext& ctx, Grouping& g, int64_t dp_size, CancelToken* cancel) {
  const int64_t target = (g.size() + dp_size - 1) / dp_size * dp_size;
  if (target > ctx.size()) return false;
  if (g.size() == target) return true;
  // The split cost of member r of group k is its shared amount inside k; a min-heap of
  // (cost, rank), entries re-validated on pop (a split changes its neighbours' costs only).
  std::vector<int32_t> group_of;
  AssignPolled<int32_t>(&group_of, ctx.size(), -1, cancel);
  for (int64_t k = 0; k < g.size(); ++k) {
    Poll(cancel);
    for (int32_t r : g.groups[k]) group_of[r] = static_cast<int32_t>(k);
  }
  auto cost = [&](int32_t r) { return SharedAmount(ctx, g.groups[group_of[r]], r, r); };
  using Entry = std::pair<int64_t, int32_t>;
  std::vector<Entry> heap;
  for (int64_t k = 0; k < g.size(); ++k) {
    Poll(cancel);
    if (g.groups[k].size() >= 2)
      for (int32_t r : g.groups[k]) heap.push_back({cost(r), r});
  }
  std::make_heap(heap.begin(), heap.end(), std::greater<Entry>());
  while (g.size() < target) {
    Poll(cancel);
    if (heap.empty()) return false;  // unreachable when target <= N
    std::pop_heap(heap.begin(), heap.end(), std::greater<Entry>());
    const auto [c, r] = heap.back();
    heap.pop_back();
    const int32_t k = group_of[r];
    std::vector<int32_t>& m = g.groups[k];
    if (m.size() < 2 || cost(r) != c) continue;  // stale
    const auto it = std::lower_bound(m.begin(), m.end(), r);
    const int32_t below = it != m.begin() ? *(it - 1) : -1;
    const int32_t above = it + 1 != m.end() ? *(it + 1) : -1;
    g.work[k] -= RemovalDelta(ctx, m, r);
    m.erase(it);
    const bool still_split = m.size() >= 2;  // (m dangles once g.groups grows)
    group_of[r] = static_cast<int32_t>(g.size());
    g.groups.push_back({r});
    g.work.push_back(ctx.Length(r));
    if (still_split) {
      for (int32_t nb : {below, above}) {
        if (nb < 0) continue;
        heap.push_back({cost(nb), nb});
        std::push_heap(heap.begin(), heap.end(), std::greater<Entry>());
      }
    }
  }
  return true;
}

GreedyResult RunGreedy(const PlanContext& ctx, int64_t dp_size, CancelToken* cancel,
                       std::optional<Grouping>* least_work) {
  Disposable<GreedyResult> holder;
  GreedyResult& best = *holder;
  if (least_work != nullptr) {
    least_work->reset();
    for (int64_t r = 1; r < ctx.size() && least_work != nullptr; ++r)
      if (ctx.AdjacentLcp(r) == 0) least_work = nullptr;  // several components: not needed
  }
  for (GreedyOrder order : {GreedyOrder::kLexAscending, GreedyOrder::kLexDescending, GreedyOrder::kLengthDesc,
                            GreedyOrder::kUniqueSuffix}) {
    const std::vector<int32_t> seq = ProcessingOrder(ctx, order, cancel);
    for (GreedyPolicy policy : {GreedyPolicy::kBestFit, GreedyPolicy::kMaxShared}) {
      StepBudget budget{GreedyStepBudget(ctx.size())};
      Disposable<Grouping> placed(GreedyPlace(ctx, seq, policy, cancel, &budget));
      Grouping& g = *placed;
      if (budget.exhausted()) {
        ++best.plans_over_budget;
        ReleasePolled(&g, cancel);
        continue;
      }
      EliminateSmallMicrobatches(ctx, g, cancel, &budget);
      if (least_work != nullptr) {  // RunComponentGreedy's rule for one component
        const int64_t total = g.TotalWork();
        std::optional<Grouping>& kept = *least_work;
        if (!kept || total < kept->TotalWork() || (total == kept->TotalWork() && g.size() < kept->size())) {
          if (!kept) kept.emplace();
          CopyPolled(g, &*kept, cancel);
        }
      }
      if (!AlignToDp(ctx, g, dp_size, cancel)) continue;
      const int64_t total = g.TotalWork();
      if (!best.feasible || g.size() < best.grouping.size() ||
          (g.size() == best.grouping.size() && total < best.grouping.TotalWork())) {
        best.feasible = true;
        ReleasePolled(&best.grouping, cancel);
        best.grouping = std::move(g);
        best.name = std::string(GreedyOrderName(order)) + "/" + GreedyPolicyName(policy);
      }
      ReleasePolled(&g, cancel);
    }
  }
  return std::move(best);
}

GreedyResult RunComponentGreedy(const PlanContext& ctx, int64_t dp_size, CancelToken* cancel,
                                const std::optional<Grouping>* whole) {
  const int64_t n = ctx.size();
  const int64_t cap = ctx.capacity();
  // Components: maximal rank ranges with no zero adjacent LCP inside.
  std::vector<int32_t> comp_start = {0};
  std::vector<int32_t> comp_of;
  ResizePolled(&comp_of, n, cancel);
  ForEachBlock(1, n, cancel, [&](int64_t r) {
    if (ctx.AdjacentLcp(r) == 0) comp_start.push_back(static_cast<int32_t>(r));
    comp_of[r] = static_cast<int32_t>(comp_start.size()) - 1;
  });
  const int64_t num_comp = static_cast<int64_t>(comp_start.size());
  comp_start.push_back(static_cast<int32_t>(n));

  // Items: whole components, or the pieces of the best per-component greedy plan.
  Disposable<std::vector<std::vector<int32_t>>> item_holder;
  std::vector<std::vector<int32_t>>& items = *item_holder;
  std::vector<int64_t> item_work;
  std::vector<char> large(num_comp, 0);
  for (int64_t c = 0; c < num_comp; ++c) {
    Poll(cancel);
    const int64_t w = ctx.Work(comp_start[c], comp_start[c + 1]);
    if (w <= cap) {
      std::vector<int32_t> all(comp_start[c + 1] - comp_start[c]);
      std::iota(all.begin(), all.end(), comp_start[c]);
      items.push_back(std::move(all));
      item_work.push_back(w);
    } else {
      large[c] = 1;
    }
  }
  Disposable<std::vector<std::optional<Grouping>>> best_holder(num_comp);
  std::vector<std::optional<Grouping>>& best = *best_holder;
  const bool planned = whole != nullptr && num_comp == 1 && large[0];  // RunGreedy's plans are this one's
  if (planned && *whole) {
    best[0].emplace();
    CopyPolled(**whole, &*best[0], cancel);
  }
  for (GreedyOrder order : {GreedyOrder::kLexAscending, GreedyOrder::kLexDescending, GreedyOrder::kLengthDesc,
                            GreedyOrder::kUniqueSuffix}) {
    if (planned) break;
    std::vector<std::vector<int32_t>> seqs(num_comp);
    const std::vector<int32_t> order_seq = ProcessingOrder(ctx, order, cancel);
    ForEachBlock(0, n, cancel, [&](int64_t i) {
      const int32_t r = order_seq[i];
      if (large[comp_of[r]]) seqs[comp_of[r]].push_back(r);
    });
    for (int64_t c = 0; c < num_comp; ++c) {
      if (!large[c]) continue;
      for (GreedyPolicy policy : {GreedyPolicy::kBestFit, GreedyPolicy::kMaxShared}) {
        StepBudget budget{GreedyStepBudget(comp_start[c + 1] - comp_start[c])};
        Disposable<Grouping> placed(GreedyPlace(ctx, seqs[c], policy, cancel, &budget));
        Grouping& g = *placed;
        if (budget.exhausted()) {
          ReleasePolled(&g, cancel);
          continue;
        }
        EliminateSmallMicrobatches(ctx, g, cancel, &budget);
        const int64_t total = g.TotalWork();
        if (!best[c] || total < best[c]->TotalWork() || (total == best[c]->TotalWork() && g.size() < best[c]->size())) {
          if (best[c]) ReleasePolled(&*best[c], cancel);
          best[c] = std::move(g);
        }
        ReleasePolled(&g, cancel);
      }
    }
  }
  for (int64_t c = 0; c < num_comp; ++c) {
    Poll(cancel);
    if (!large[c]) continue;
    if (!best[c]) best[c] = ContiguousFirstFit(ctx, comp_start[c], comp_start[c + 1]);  // every plan over budget
    for (int64_t k = 0; k < best[c]->size(); ++k) {
      items.push_back(std::move(best[c]->groups[k]));
      item_work.push_back(best[c]->work[k]);
    }
  }

  // Best-fit decreasing packing: the fullest bin that fits (ties: the lowest index), from an
  // ordered set of (work, -bin).
  std::vector<int64_t> by_work;
  ResizePolled(&by_work, static_cast<int64_t>(items.size()), cancel);
  ForEachBlock(0, static_cast<int64_t>(items.size()), cancel, [&](int64_t i) { by_work[i] = i; });
  StableSortPolled(
      &by_work,
      [&](int64_t a, int64_t b) {
        return item_work[a] != item_work[b] ? item_work[a] > item_work[b] : items[a].front() < items[b].front();
      },
      cancel);
  Disposable<Grouping> packed;
  Grouping& g = *packed;
  std::set<std::pair<int64_t, int32_t>> bins;
  for (int64_t it : by_work) {
    Poll(cancel);
    auto pos = bins.upper_bound({cap - item_work[it], std::numeric_limits<int32_t>::max()});
    if (pos == bins.begin()) {
      bins.insert({item_work[it], -static_cast<int32_t>(g.size())});
      g.groups.push_back(std::move(items[it]));
      g.work.push_back(item_work[it]);
    } else {
      --pos;
      const int32_t target = -pos->second;
      bins.erase(pos);
      std::vector<int32_t>& m = g.groups[target];
      const size_t mid = m.size();
      m.insert(m.end(), items[it].begin(), items[it].end());
      std::inplace_merge(m.begin(), m.begin() + mid, m.end());
      g.work[target] += item_work[it];  // distinct components share no token
      bins.insert({g.work[target], -target});
    }
  }
  GreedyResult result;
  StepBudget budget{GreedyStepBudget(n)};
  EliminateSmallMicrobatches(ctx, g, cancel, &budget);
  if (!AlignToDp(ctx, g, dp_size, cancel)) return result;
  result.feasible = true;
  result.grouping = std::move(g);
  result.name = "component";
  return result;
}

}  // namespace harts
