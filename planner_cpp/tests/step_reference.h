// Reference implementations of the step planner's phases: the straightforward versions the
// fast ones replaced (they probe every microbatch, rescan every candidate). The tests check
// that the fast phases return exactly what these return, tie rules included.
#ifndef HARTS_TESTS_STEP_REFERENCE_H_
#define HARTS_TESTS_STEP_REFERENCE_H_

#include <algorithm>
#include <cassert>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "harts/evolution.h"
#include "harts/greedy.h"
#include "harts/microbatch.h"

namespace harts::reference {

inline Grouping GreedyPlace(const PlanContext& ctx, const std::vector<int32_t>& sequence, GreedyPolicy policy) {
  Grouping g;
  const int64_t cap = ctx.capacity();
  for (int32_t r : sequence) {
    const int64_t len = ctx.Length(r);
    int64_t best = -1, best_key = -1, best_after = -1;
    for (int64_t k = 0; k < g.size(); ++k) {
      const int64_t shared = SharedAmount(ctx, g.groups[k], r);
      const int64_t after = g.work[k] + len - shared;
      if (after > cap) continue;
      const int64_t key = policy == GreedyPolicy::kBestFit ? after : shared;
      if (key > best_key || (key == best_key && after > best_after)) {
        best = k;
        best_key = key;
        best_after = after;
      }
    }
    if (best < 0) {
      g.groups.push_back({r});
      g.work.push_back(len);
    } else {
      InsertSorted(g.groups[best], r);
      g.work[best] = best_after;
    }
  }
  return g;
}

inline bool EliminateSmallMicrobatches(const PlanContext& ctx, Grouping& g) {
  const int64_t cap = ctx.capacity();
  const int64_t k = g.size();
  std::vector<int64_t> visit(k);
  std::iota(visit.begin(), visit.end(), 0);
  std::stable_sort(visit.begin(), visit.end(), [&](int64_t a, int64_t b) { return g.work[a] < g.work[b]; });
  std::vector<char> removed(k, 0);
  bool any = false;
  for (int64_t c : visit) {
    // Tentatively move every member of c; undo on failure.
    std::vector<std::pair<int64_t, int32_t>> moved;  // (destination, rank)
    std::vector<int64_t> old_work;
    bool ok = true;
    for (int32_t r : g.groups[c]) {
      int64_t best = -1, best_delta = 0, best_after = 0;
      for (int64_t d = 0; d < k; ++d) {
        if (d == c || removed[d]) continue;
        const int64_t delta = InsertionDelta(ctx, g.groups[d], r);
        const int64_t after = g.work[d] + delta;
        if (after > cap) continue;
        if (best < 0 || delta < best_delta || (delta == best_delta && after > best_after)) {
          best = d;
          best_delta = delta;
          best_after = after;
        }
      }
      if (best < 0) {
        ok = false;
        break;
      }
      moved.push_back({best, r});
      old_work.push_back(g.work[best]);
      InsertSorted(g.groups[best], r);
      g.work[best] = best_after;
    }
    if (ok) {
      removed[c] = 1;
      any = true;
    } else {
      for (size_t j = moved.size(); j-- > 0;) {
        EraseSorted(g.groups[moved[j].first], moved[j].second);
        g.work[moved[j].first] = old_work[j];
      }
    }
  }
  if (any) {
    Grouping kept;
    for (int64_t c = 0; c < k; ++c) {
      if (removed[c]) continue;
      kept.groups.push_back(std::move(g.groups[c]));
      kept.work.push_back(g.work[c]);
    }
    g = std::move(kept);
  }
  return any;
}

inline bool AlignToDp(const PlanContext& ctx, Grouping& g, int64_t dp_size) {
  const int64_t target = (g.size() + dp_size - 1) / dp_size * dp_size;
  if (target > ctx.size()) return false;
  while (g.size() < target) {
    int64_t best_group = -1, best_cost = 0;
    int32_t best_rank = 0;
    for (int64_t k = 0; k < g.size(); ++k) {
      const std::vector<int32_t>& m = g.groups[k];
      if (m.size() < 2) continue;
      for (size_t j = 0; j < m.size(); ++j) {
        const int64_t lp = j > 0 ? ctx.Lcp(m[j - 1], m[j]) : 0;
        const int64_t lq = j + 1 < m.size() ? ctx.Lcp(m[j], m[j + 1]) : 0;
        const int64_t cost = std::max(lp, lq);
        if (best_group < 0 || cost < best_cost || (cost == best_cost && m[j] < best_rank)) {
          best_group = k;
          best_cost = cost;
          best_rank = m[j];
        }
      }
    }
    if (best_group < 0) return false;  // unreachable when target <= N
    g.work[best_group] -= RemovalDelta(ctx, g.groups[best_group], best_rank);
    EraseSorted(g.groups[best_group], best_rank);
    g.groups.push_back({best_rank});
    g.work.push_back(ctx.Length(best_rank));
  }
  return true;
}

inline GreedyResult RunGreedy(const PlanContext& ctx, int64_t dp_size) {
  GreedyResult best;
  for (GreedyOrder order : {GreedyOrder::kLexAscending, GreedyOrder::kLexDescending, GreedyOrder::kLengthDesc,
                            GreedyOrder::kUniqueSuffix}) {
    const std::vector<int32_t> seq = ProcessingOrder(ctx, order);
    for (GreedyPolicy policy : {GreedyPolicy::kBestFit, GreedyPolicy::kMaxShared}) {
      Grouping g = reference::GreedyPlace(ctx, seq, policy);
      reference::EliminateSmallMicrobatches(ctx, g);
      if (!reference::AlignToDp(ctx, g, dp_size)) continue;
      const int64_t total = g.TotalWork();
      if (!best.feasible || g.size() < best.grouping.size() ||
          (g.size() == best.grouping.size() && total < best.grouping.TotalWork())) {
        best.feasible = true;
        best.grouping = std::move(g);
        best.name = std::string(GreedyOrderName(order)) + "/" + GreedyPolicyName(policy);
      }
    }
  }
  return best;
}

inline GreedyResult RunComponentGreedy(const PlanContext& ctx, int64_t dp_size) {
  const int64_t n = ctx.size();
  const int64_t cap = ctx.capacity();
  // Components: maximal rank ranges with no zero adjacent LCP inside.
  std::vector<int32_t> comp_start = {0};
  std::vector<int32_t> comp_of(n, 0);
  for (int64_t r = 1; r < n; ++r) {
    if (ctx.AdjacentLcp(r) == 0) comp_start.push_back(static_cast<int32_t>(r));
    comp_of[r] = static_cast<int32_t>(comp_start.size()) - 1;
  }
  const int64_t num_comp = static_cast<int64_t>(comp_start.size());
  comp_start.push_back(static_cast<int32_t>(n));

  // Items: whole components, or the pieces of the best per-component greedy plan.
  std::vector<std::vector<int32_t>> items;
  std::vector<int64_t> item_work;
  std::vector<char> large(num_comp, 0);
  for (int64_t c = 0; c < num_comp; ++c) {
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
  std::vector<std::optional<Grouping>> best(num_comp);
  for (GreedyOrder order : {GreedyOrder::kLexAscending, GreedyOrder::kLexDescending, GreedyOrder::kLengthDesc,
                            GreedyOrder::kUniqueSuffix}) {
    std::vector<std::vector<int32_t>> seqs(num_comp);
    for (int32_t r : ProcessingOrder(ctx, order))
      if (large[comp_of[r]]) seqs[comp_of[r]].push_back(r);
    for (int64_t c = 0; c < num_comp; ++c) {
      if (!large[c]) continue;
      for (GreedyPolicy policy : {GreedyPolicy::kBestFit, GreedyPolicy::kMaxShared}) {
        Grouping g = reference::GreedyPlace(ctx, seqs[c], policy);
        reference::EliminateSmallMicrobatches(ctx, g);
        const int64_t total = g.TotalWork();
        if (!best[c] || total < best[c]->TotalWork() || (total == best[c]->TotalWork() && g.size() < best[c]->size()))
          best[c] = std::move(g);
      }
    }
  }
  for (int64_t c = 0; c < num_comp; ++c) {
    if (!large[c]) continue;
    for (int64_t k = 0; k < best[c]->size(); ++k) {
      items.push_back(std::move(best[c]->groups[k]));
      item_work.push_back(best[c]->work[k]);
    }
  }

  // Best-fit decreasing packing.
  std::vector<int64_t> by_work(items.size());
  std::iota(by_work.begin(), by_work.end(), 0);
  std::stable_sort(by_work.begin(), by_work.end(), [&](int64_t a, int64_t b) {
    return item_work[a] != item_work[b] ? item_work[a] > item_work[b] : items[a].front() < items[b].front();
  });
  Grouping g;
  for (int64_t it : by_work) {
    int64_t target = -1;
    for (int64_t k = 0; k < g.size(); ++k)
      if (g.work[k] + item_work[it] <= cap && (target < 0 || g.work[k] > g.work[target])) target = k;
    if (target < 0) {
      g.groups.push_back(items[it]);
      g.work.push_back(item_work[it]);
    } else {
      std::vector<int32_t>& m = g.groups[target];
      const size_t mid = m.size();
      m.insert(m.end(), items[it].begin(), items[it].end());
      std::inplace_merge(m.begin(), m.begin() + mid, m.end());
      g.work[target] += item_work[it];  // distinct components share no token
    }
  }
  GreedyResult result;
  reference::EliminateSmallMicrobatches(ctx, g);
  if (!reference::AlignToDp(ctx, g, dp_size)) return result;
  result.feasible = true;
  result.grouping = std::move(g);
  result.name = "component";
  return result;
}

// natural_partition.cc before the O(log N) cut search.
inline std::vector<int32_t> NaturalPartition(const PlanContext& ctx) {
  const int64_t n = ctx.size();
  const int64_t cap = ctx.capacity();
  std::vector<int32_t> cuts = {0};
  // Intervals still to visit, left to right: pop the leftmost (stack top).
  std::vector<std::pair<int32_t, int32_t>> stack = {{0, static_cast<int32_t>(n)}};
  while (!stack.empty()) {
    const auto [lo, hi] = stack.back();
    stack.pop_back();
    if (hi - lo == 1 || ctx.Work(lo, hi) <= cap) {
      cuts.push_back(hi);
      continue;
    }
    int32_t best = -1;
    int64_t best_lcp = 0, best_max = 0, best_diff = 0;
    for (int32_t t = lo + 1; t < hi; ++t) {
      const int64_t l = ctx.AdjacentLcp(t);
      if (best >= 0 && l > best_lcp) continue;
      const int64_t wl = ctx.Work(lo, t), wr = ctx.Work(t, hi);
      const int64_t mx = std::max(wl, wr), diff = wl > wr ? wl - wr : wr - wl;
      if (best < 0 || l < best_lcp || mx < best_max || (mx == best_max && diff < best_diff)) {
        best = t;
        best_lcp = l;
        best_max = mx;
        best_diff = diff;
      }
    }
    assert(best > lo);
    stack.push_back({best, hi});
    stack.push_back({lo, best});
  }
  return cuts;
}

// evolution.cc before the heaps.
// Merges the best adjacent pair of `cuts` in place; false if no pair fits the capacity.
inline bool MergeOnce(const PlanContext& ctx, std::vector<int32_t>& cuts) {
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
inline bool SplitOnce(const PlanContext& ctx, std::vector<int32_t>& cuts) {
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

inline std::vector<EvolvedPartition> EvolvePartition(const PlanContext& ctx, const std::vector<int32_t>& natural,
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

// sparse_repair.cc before the incremental gain tree.
inline int64_t SparseRepair(const PlanContext& ctx, Grouping& g, int64_t window, int64_t iterations) {
  const int64_t n = ctx.size();
  const int64_t cap = ctx.capacity();
  std::vector<int32_t> group_of(n);
  for (int64_t k = 0; k < g.size(); ++k)
    for (int32_t r : g.groups[k]) group_of[r] = static_cast<int32_t>(k);

  int64_t applied = 0;
  std::vector<int32_t> seen;
  for (int64_t it = 0; it < iterations; ++it) {
    // Best move.
    int64_t best_gain = 0;
    int32_t move_rank = -1, move_dest = -1;
    for (int32_t r = 0; r < n; ++r) {
      const int32_t a = group_of[r];
      if (g.groups[a].size() < 2) continue;
      const int64_t saved = RemovalDelta(ctx, g.groups[a], r);
      seen.clear();
      for (int64_t r2 = std::max<int64_t>(0, r - window); r2 <= std::min<int64_t>(n - 1, r + window); ++r2) {
        const int32_t b = group_of[r2];
        if (b == a || std::find(seen.begin(), seen.end(), b) != seen.end()) continue;
        seen.push_back(b);
        const int64_t added = InsertionDelta(ctx, g.groups[b], r);
        if (g.work[b] + added > cap) continue;
        if (saved - added > best_gain) {
          best_gain = saved - added;
          move_rank = r;
          move_dest = b;
        }
      }
    }
    if (move_rank >= 0) {
      const int32_t a = group_of[move_rank];
      g.work[a] -= RemovalDelta(ctx, g.groups[a], move_rank);
      EraseSorted(g.groups[a], move_rank);
      g.work[move_dest] += InsertionDelta(ctx, g.groups[move_dest], move_rank);
      InsertSorted(g.groups[move_dest], move_rank);
      group_of[move_rank] = move_dest;
      ++applied;
      continue;
    }
    // Best swap.
    int32_t swap_r = -1, swap_r2 = -1;
    int64_t swap_wa = 0, swap_wb = 0;
    for (int32_t r = 0; r < n; ++r) {
      const int32_t a = group_of[r];
      const int64_t saved_a = RemovalDelta(ctx, g.groups[a], r);
      for (int64_t r2 = r + 1; r2 <= std::min<int64_t>(n - 1, r + window); ++r2) {
        const int32_t b = group_of[r2];
        if (b == a) continue;
        const int32_t q = static_cast<int32_t>(r2);
        const int64_t wa = g.work[a] - saved_a + InsertionDelta(ctx, g.groups[a], q, r);
        if (wa > cap) continue;
        const int64_t wb = g.work[b] - RemovalDelta(ctx, g.groups[b], q) + InsertionDelta(ctx, g.groups[b], r, q);
        if (wb > cap) continue;
        const int64_t gain = g.work[a] + g.work[b] - wa - wb;
        if (gain > best_gain) {
          best_gain = gain;
          swap_r = r;
          swap_r2 = q;
          swap_wa = wa;
          swap_wb = wb;
        }
      }
    }
    if (swap_r < 0) break;
    const int32_t a = group_of[swap_r], b = group_of[swap_r2];
    EraseSorted(g.groups[a], swap_r);
    InsertSorted(g.groups[a], swap_r2);
    EraseSorted(g.groups[b], swap_r2);
    InsertSorted(g.groups[b], swap_r);
    g.work[a] = swap_wa;
    g.work[b] = swap_wb;
    group_of[swap_r] = b;
    group_of[swap_r2] = a;
    ++applied;
  }
  return applied;
}

}  // namespace harts::reference

#endif  // HARTS_TESTS_STEP_REFERENCE_H_
