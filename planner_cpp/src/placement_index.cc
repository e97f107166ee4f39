#include "harts/placement_index.h"

#include <algorithm>
#include <cassert>
#include <limits>

namespace harts {

PlacementIndex::PlacementIndex(const PlanContext& ctx, int32_t lo, int32_t hi, Grouping* g, CancelToken* cancel,
                               int32_t min_node, int32_t max_depth)
    : ctx_(ctx), lo_(lo), hi_(hi), g_(g), cell_of_(std::max(0, hi - lo), 0) {
  assert(0 <= lo && lo <= hi && hi <= ctx.size());
  nodes_.emplace_back();
  if (hi > lo) Build(0, lo, hi, 0, std::max(min_node, 2), max_depth);
  const int64_t k = g->size();
  live_.assign(k, 1);
  mark_.assign(k, 0);
  node_count_.resize(k);
  for (int64_t j = 0; j < k; ++j) {
    Poll(cancel);
    for (int32_t r : g->groups[j]) Count(static_cast<int32_t>(j), r, +1);
    Entries(static_cast<int32_t>(j), true);
  }
}

void PlacementIndex::Release(CancelToken* cancel) {
  const auto pop_blocks = [cancel](auto& v) {
    while (!v.empty()) {
      Poll(cancel);
      for (int64_t i = 0; i < kPollBlock && !v.empty(); ++i) v.pop_back();
    }
    v.shrink_to_fit();
  };
  pop_blocks(cells_);
  pop_blocks(node_count_);
  for (Node& u : nodes_) {
    while (!u.touching.empty()) {
      Poll(cancel);
      auto last = u.touching.begin();
      for (int64_t i = 0; i < kPollBlock && last != u.touching.end(); ++i) ++last;
      u.touching.erase(u.touching.begin(), last);
    }
  }
  pop_blocks(nodes_);
}

void PlacementIndex::Build(int32_t node, int32_t lo, int32_t hi, int32_t depth, int32_t min_node, int32_t max_depth) {
  int64_t floor = 0;
  if (hi - lo >= 2) {
    floor = std::numeric_limits<int64_t>::max();
    for (int32_t t = lo + 1; t < hi; ++t) floor = std::min(floor, ctx_.AdjacentLcp(t));
  }
  nodes_[node].floor = floor;
  for (int32_t a = lo; a < hi;) {
    int32_t b = a + 1;
    while (b < hi && ctx_.AdjacentLcp(b) != floor) ++b;
    if (b - a >= min_node && depth + 1 <= max_depth && b - a < hi - lo) {
      const int32_t child = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
      nodes_[child].parent = node;
      Build(child, a, b, depth + 1, min_node, max_depth);
    } else {
      const int32_t cell = static_cast<int32_t>(cells_.size());
      cells_.push_back(Cell{node, {}});
      for (int32_t r = a; r < b; ++r) cell_of_[r - lo_] = cell;
    }
    a = b;
  }
}

int32_t& PlacementIndex::NodeCount(int32_t k, int32_t u) {
  std::vector<std::pair<int32_t, int32_t>>& list = node_count_[k];
  for (auto& [node, count] : list)
    if (node == u) return count;
  list.push_back({u, 0});
  return list.back().second;
}

bool PlacementIndex::Touches(int32_t k, int32_t u) const {
  if (u == 0) return true;  // every live group touches the root (not kept in node_count_)
  for (const auto& [node, count] : node_count_[k])
    if (node == u) return true;
  return false;
}

void PlacementIndex::Count(int32_t k, int32_t r, int32_t delta) {
  const int32_t c = cell_of_[r - lo_];
  std::vector<std::pair<int32_t, int32_t>>& touch = cells_[c].touch;
  bool found = false;
  for (size_t i = 0; i < touch.size(); ++i) {
    if (touch[i].first != k) continue;
    touch[i].second += delta;
    if (touch[i].second == 0) {
      touch[i] = touch.back();
      touch.pop_back();
    }
    found = true;
    break;
  }
  if (!found) {
    assert(delta > 0);
    touch.push_back({k, delta});
  }
  for (int32_t u = cells_[c].parent; u > 0; u = nodes_[u].parent) {
    NodeCount(k, u) += delta;
    if (NodeCount(k, u) == 0) {
      std::vector<std::pair<int32_t, int32_t>>& list = node_count_[k];
      list.erase(std::find_if(list.begin(), list.end(), [u](const auto& e) { return e.first == u; }));
    }
  }
}

void PlacementIndex::Entries(int32_t k, bool add) {
  const std::pair<int64_t, int32_t> key{g_->work[k], -k};
  auto apply = [&](int32_t u) {
    if (add) {
      nodes_[u].touching.insert(key);
    } else {
      nodes_[u].touching.erase(key);
    }
  };
  apply(0);
  for (const auto& [u, count] : node_count_[k]) apply(u);
}

PlacementIndex::Choice PlacementIndex::Best(int32_t r, GreedyPolicy policy, int64_t exclude) {
  assert(lo_ <= r && r < hi_);
  const int64_t cap = ctx_.capacity();
  const int64_t len = ctx_.Length(r);
  const int32_t c = cell_of_[r - lo_];
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
  // The cell: exact shared amounts.
  for (const auto& [k, count] : cells_[c].touch) {
    mark_[k] = stamp_;
    if (k == exclude || !live_[k]) continue;
    const int64_t shared = SharedAmount(ctx_, g_->groups[k], r);
    const int64_t after = g_->work[k] + len - shared;
    if (after > cap) continue;
    const Choice cand{k, after, shared};
    if (better(cand, best)) best = cand;
  }
  // Max-shared: a group touching the cell shares more than any level above offers.
  if (policy == GreedyPolicy::kMaxShared && best.group >= 0) return best;
  // The levels, deepest first: at node u (next on the path: `below`, -1 for the cell) the groups
  // touching u but not `below` share exactly F(u); the best has the largest work <= T - len + F(u).
  int32_t below = -1;
  for (int32_t u = cells_[c].parent; u >= 0; below = u, u = nodes_[u].parent) {
    const WorkSet& set = nodes_[u].touching;
    const int64_t floor = nodes_[u].floor;
    auto it = set.upper_bound({cap - len + floor, std::numeric_limits<int32_t>::max()});
    bool found = false;
    while (it != set.begin()) {
      --it;
      const int32_t k = -it->second;
      if (k == exclude) continue;
      if (below < 0 ? mark_[k] == stamp_ : Touches(k, below)) continue;
      const Choice cand{k, it->first + len - floor, floor};
      if (better(cand, best)) best = cand;
      found = true;
      break;
    }
    if (policy == GreedyPolicy::kMaxShared && found) return best;  // shallower levels share less
  }
  return best;
}

void PlacementIndex::Rekey(int32_t k, int64_t work) {
  const int64_t old = g_->work[k];
  g_->work[k] = work;
  if (work == old) return;
  auto move = [&](int32_t u) {  // reuses the set node: no allocation
    auto handle = nodes_[u].touching.extract({old, -k});
    handle.value().first = work;
    nodes_[u].touching.insert(std::move(handle));
  };
  move(0);
  for (const auto& [u, count] : node_count_[k]) move(u);
}

void PlacementIndex::Insert(int64_t k, int32_t r, int64_t work) {
  assert(live_[k]);
  const int32_t id = static_cast<int32_t>(k);
  InsertSorted(g_->groups[k], r);
  if (Touches(id, cells_[cell_of_[r - lo_]].parent)) {  // then every node above it too: same sets
    Rekey(id, work);
    Count(id, r, +1);
    return;
  }
  Entries(id, false);
  g_->work[k] = work;
  Count(id, r, +1);
  Entries(id, true);
}

void PlacementIndex::Erase(int64_t k, int32_t r, int64_t work) {
  assert(live_[k]);
  const int32_t id = static_cast<int32_t>(k);
  EraseSorted(g_->groups[k], r);
  const int32_t parent = cells_[cell_of_[r - lo_]].parent;
  if (parent == 0 || NodeCount(id, parent) >= 2) {  // stays in every node above: same sets
    Rekey(id, work);
    Count(id, r, -1);
    return;
  }
  Entries(id, false);
  g_->work[k] = work;
  Count(id, r, -1);
  Entries(id, true);
}

int64_t PlacementIndex::NewGroup(int32_t r) {
  const int32_t k = static_cast<int32_t>(g_->size());
  g_->groups.push_back({r});
  g_->work.push_back(ctx_.Length(r));
  live_.push_back(1);
  mark_.push_back(0);
  node_count_.emplace_back();
  Count(k, r, +1);
  Entries(k, true);
  return k;
}

void PlacementIndex::Retire(int64_t k) {
  assert(live_[k]);
  const int32_t id = static_cast<int32_t>(k);
  Entries(id, false);
  for (int32_t r : g_->groups[k]) Count(id, r, -1);
  live_[k] = 0;
}

}  // namespace harts
