#include "harts/placement_index.h"

#include <algorithm>
#include <cassert>
#include <limits>

namespace harts {

PlacementIndex::PlacementIndex(const PlanContext& ctx, int32_t lo, int32_t hi, Grouping* g)
    : ctx_(ctx), lo_(lo), hi_(hi), g_(g), comp_(std::max(0, hi - lo), 0) {
  assert(0 <= lo && lo <= hi && hi <= ctx.size());
  if (hi - lo >= 2) {
    floor_ = std::numeric_limits<int64_t>::max();
    for (int32_t t = lo + 1; t < hi; ++t) floor_ = std::min(floor_, ctx.AdjacentLcp(t));
  }
  int32_t c = 0;
  for (int32_t t = lo + 1; t < hi; ++t) {
    if (ctx.AdjacentLcp(t) == floor_) ++c;
    comp_[t - lo] = c;
  }
  touch_.resize(hi > lo ? c + 1 : 0);
  const int64_t k = g->size();
  live_.assign(k, 1);
  mark_.assign(k, 0);
  for (int64_t j = 0; j < k; ++j) {
    by_work_.insert({g->work[j], -static_cast<int32_t>(j)});
    for (int32_t r : g->groups[j]) Touch(Component(r), static_cast<int32_t>(j), +1);
  }
}

void PlacementIndex::Touch(int32_t c, int32_t k, int32_t delta) {
  std::vector<std::pair<int32_t, int32_t>>& list = touch_[c];
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i].first != k) continue;
    list[i].second += delta;
    if (list[i].second == 0) {
      list[i] = list.back();
      list.pop_back();
    }
    return;
  }
  assert(delta > 0);
  list.push_back({k, delta});
}

PlacementIndex::Choice PlacementIndex::Best(int32_t r, GreedyPolicy policy, int64_t exclude) {
  assert(lo_ <= r && r < hi_);
  const int64_t cap = ctx_.capacity();
  const int64_t len = ctx_.Length(r);
  const int32_t c = Component(r);
  Choice best;
  // Better under the policy's order; `b` is the incumbent (group -1: none).
  auto better = [policy](const Choice& a, const Choice& b) {
    if (b.group < 0) return true;
    if (policy == GreedyPolicy::kMaxShared && a.shared != b.shared) return a.shared > b.shared;
    if (a.after != b.after) return a.after > b.after;
    return a.group < b.group;
  };
  if (++stamp_ == 0) {  // wrapped: clear the marks once
    std::fill(mark_.begin(), mark_.end(), 0);
    stamp_ = 1;
  }
  for (const auto& [k, count] : touch_[c]) {
    mark_[k] = stamp_;
    if (k == exclude || !live_[k]) continue;
    const int64_t shared = SharedAmount(ctx_, g_->groups[k], r);
    const int64_t after = g_->work[k] + len - shared;
    if (after > cap) continue;
    const Choice cand{k, after, shared};
    if (better(cand, best)) best = cand;
  }
  // Max-shared: any group touching c shares more than F, so it beats every other group.
  if (policy == GreedyPolicy::kMaxShared && best.group >= 0) return best;
  // Other groups: h = F; the largest work <= cap - len + F, ties to the lowest index.
  const int64_t limit = cap - len + floor_;
  auto it = by_work_.upper_bound({limit, std::numeric_limits<int32_t>::max()});
  while (it != by_work_.begin()) {
    --it;
    const int64_t k = -static_cast<int64_t>(it->second);
    if (k == exclude || mark_[k] == stamp_) continue;
    const Choice cand{k, it->first + len - floor_, floor_};
    if (better(cand, best)) best = cand;
    break;
  }
  return best;
}

void PlacementIndex::Rekey(int64_t k, int64_t work) {
  const int32_t id = -static_cast<int32_t>(k);
  if (work != g_->work[k]) {  // reuse the set node: no allocation
    auto node = by_work_.extract({g_->work[k], id});
    node.value().first = work;
    by_work_.insert(std::move(node));
    g_->work[k] = work;
  }
}

void PlacementIndex::Insert(int64_t k, int32_t r, int64_t work) {
  assert(live_[k]);
  Rekey(k, work);
  InsertSorted(g_->groups[k], r);
  Touch(Component(r), static_cast<int32_t>(k), +1);
}

void PlacementIndex::Erase(int64_t k, int32_t r, int64_t work) {
  assert(live_[k]);
  Rekey(k, work);
  EraseSorted(g_->groups[k], r);
  Touch(Component(r), static_cast<int32_t>(k), -1);
}

int64_t PlacementIndex::NewGroup(int32_t r) {
  const int64_t k = g_->size();
  g_->groups.push_back({r});
  g_->work.push_back(ctx_.Length(r));
  live_.push_back(1);
  mark_.push_back(0);
  by_work_.insert({ctx_.Length(r), -static_cast<int32_t>(k)});
  Touch(Component(r), static_cast<int32_t>(k), +1);
  return k;
}

void PlacementIndex::Retire(int64_t k) {
  assert(live_[k]);
  live_[k] = 0;
  by_work_.erase({g_->work[k], -static_cast<int32_t>(k)});
  for (int32_t r : g_->groups[k]) Touch(Component(r), static_cast<int32_t>(k), -1);
}

}  // namespace harts
