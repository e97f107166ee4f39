#include "harts/placement_index.h"

#include <algorithm>
#include <cassert>
#include <limits>

namespace harts {

PlacementIndex::PlacementIndex(const PlanContext& ctx, int32_t lo, int32_t hi, Grouping* g, CancelToken* cancel,
                               int32_t min_node, int32_t max_depth)
    : ctx_(ctx), lo_(lo), hi_(hi), g_(g), cell_of_(std::max(0, hi - lo), 0) {
  assert(0 <= lo && lo <= hi && hi <= ctx.size());
  nodes_.emplace_back(pool_);
  nodes_[0].lo = lo;
  nodes_[0].hi = hi;
  if (hi > lo) Build(0, lo, hi, 0, std::max(min_node, 2), max_depth);
  BuildChains();
  const int64_t k = g->size();
  live_.assign(k, 1);
  mark_.assign(k, 0);
  depths_.resize(k);
  // Per chain / cell: the last group registered there (+1), and that group's depth in the chain.
  const int32_t num_chains = static_cast<int32_t>(chain_offset_.size()) - 1;
  std::vector<int32_t> chain_seen(num_chains, 0), chain_depth(num_chains, 0), cell_seen(cells_.size(), 0);
  std::vector<int32_t> chains;
  for (int64_t j = 0; j < k; ++j) {
    Poll(cancel);
    const int32_t id = static_cast<int32_t>(j);
    chains.clear();
    for (int32_t r : g->groups[j]) {
      const int32_t c = cell_of_[r - lo_];
      ++steps_;
      if (cell_seen[c] == id + 1) continue;  // r's cell, and so its whole path, is registered
      cell_seen[c] = id + 1;
      cells_[c].touch.push_back(id);
      for (int32_t u = cells_[c].parent; u >= 0;) {
        ++steps_;
        const int32_t ch = nodes_[u].chain;
        if (chain_seen[ch] == id + 1) {  // the chain, and every chain above it, is registered
          chain_depth[ch] = std::max(chain_depth[ch], nodes_[u].pos);
          break;
        }
        chain_seen[ch] = id + 1;
        chain_depth[ch] = nodes_[u].pos;
        chains.push_back(ch);
        u = nodes_[ChainNode(ch, 0)].parent;
      }
    }
    std::sort(chains.begin(), chains.end());
    const std::pair<int64_t, int32_t> key{g->work[j], -id};
    for (int32_t ch : chains) {
      ++steps_;
      depths_[j].push_back({ch, chain_depth[ch]});
      nodes_[ChainNode(ch, chain_depth[ch])].exact.insert(key);
    }
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
  pop_blocks(depths_);
  for (Node& u : nodes_) {
    while (!u.exact.empty()) {
      Poll(cancel);
      auto last = u.exact.begin();
      for (int64_t i = 0; i < kPollBlock && last != u.exact.end(); ++i) ++last;
      u.exact.erase(u.exact.begin(), last);
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
  steps_ += hi - lo;
  nodes_[node].floor = floor;
  for (int32_t a = lo; a < hi;) {
    int32_t b = a + 1;
    while (b < hi && ctx_.AdjacentLcp(b) != floor) ++b;
    if (b - a >= min_node && depth + 1 <= max_depth && b - a < hi - lo) {
      const int32_t child = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back(pool_);
      nodes_[child].parent = node;
      nodes_[child].lo = a;
      nodes_[child].hi = b;
      Build(child, a, b, depth + 1, min_node, max_depth);
    } else {
      const int32_t cell = static_cast<int32_t>(cells_.size());
      cells_.push_back(Cell{node, a, b, {}});
      for (int32_t r = a; r < b; ++r) cell_of_[r - lo_] = cell;
    }
    a = b;
  }
}

void PlacementIndex::BuildChains() {
  // Nodes are numbered in preorder (a parent before its children, siblings left to right).
  const int32_t m = static_cast<int32_t>(nodes_.size());
  std::vector<int32_t> heavy(m, -1);
  for (int32_t v = 1; v < m; ++v) {
    const int32_t p = nodes_[v].parent;
    const auto size = [&](int32_t x) { return nodes_[x].hi - nodes_[x].lo; };
    if (heavy[p] < 0 || size(v) > size(heavy[p])) heavy[p] = v;  // ties: the first child
  }
  chain_offset_.assign(1, 0);
  for (int32_t top = 0; top < m; ++top) {
    if (top > 0 && heavy[nodes_[top].parent] == top) continue;  // inside its parent's chain
    const int32_t chain = static_cast<int32_t>(chain_offset_.size()) - 1;
    int32_t pos = 0;
    for (int32_t v = top; v >= 0; v = heavy[v]) {
      nodes_[v].chain = chain;
      nodes_[v].pos = pos++;
      chain_nodes_.push_back(v);
    }
    chain_offset_.push_back(static_cast<int32_t>(chain_nodes_.size()));
  }
  steps_ += m;
}

bool PlacementIndex::HasMember(int32_t k, int32_t lo, int32_t hi) {
  ++steps_;
  const std::vector<int32_t>& m = g_->groups[k];
  const auto it = std::lower_bound(m.begin(), m.end(), lo);
  return it != m.end() && *it < hi;
}

PlacementIndex::Depths::iterator PlacementIndex::FindDepth(int32_t k, int32_t chain) {
  Depths& d = depths_[k];
  ++steps_;
  const auto it = std::lower_bound(d.begin(), d.end(), std::make_pair(chain, std::numeric_limits<int32_t>::min()));
  return it != d.end() && it->first == chain ? it : d.end();
}

void PlacementIndex::Rekey(int32_t k, int64_t work) {
  const int64_t old = g_->work[k];
  g_->work[k] = work;
  if (work == old) return;
  for (const auto& [chain, depth] : depths_[k]) {  // the node goes back to the pool and out again
    // (not extract / insert: libstdc++'s node handles leak a copy of a stateful allocator)
    WorkSet& set = nodes_[ChainNode(chain, depth)].exact;
    set.erase({old, -k});
    set.insert({work, -k});
  }
  steps_ += static_cast<int64_t>(depths_[k].size());
}

void PlacementIndex::Attach(int32_t k, int32_t r) {
  const int32_t c = cell_of_[r - lo_];
  if (!g_->groups[k].empty() && HasMember(k, cells_[c].lo, cells_[c].hi)) return;  // the whole path is touched
  cells_[c].touch.push_back(k);
  const std::pair<int64_t, int32_t> key{g_->work[k], -k};
  Depths& d = depths_[k];
  for (int32_t u = cells_[c].parent; u >= 0;) {
    const int32_t chain = nodes_[u].chain, pos = nodes_[u].pos;
    const auto it = d.empty() ? d.end() : FindDepth(k, chain);
    if (it != d.end()) {  // k touches the chain's top, so every node above it
      if (it->second < pos) {
        ++steps_;
        nodes_[ChainNode(chain, it->second)].exact.erase(key);
        nodes_[u].exact.insert(key);
        it->second = pos;
      }
      return;
    }
    ++steps_;
    d.insert(std::lower_bound(d.begin(), d.end(), std::make_pair(chain, 0)), {chain, pos});
    nodes_[u].exact.insert(key);
    u = nodes_[ChainNode(chain, 0)].parent;
  }
}

void PlacementIndex::Detach(int32_t k, int32_t r) {
  const int32_t c = cell_of_[r - lo_];
  if (HasMember(k, cells_[c].lo, cells_[c].hi)) return;  // still touched, and its whole path
  std::vector<int32_t>& touch = cells_[c].touch;
  steps_ += static_cast<int64_t>(touch.size());
  *std::find(touch.begin(), touch.end(), k) = touch.back();
  touch.pop_back();
  const std::pair<int64_t, int32_t> key{g_->work[k], -k};
  Depths& d = depths_[k];
  for (int32_t u = cells_[c].parent; u >= 0;) {
    const int32_t chain = nodes_[u].chain, pos = nodes_[u].pos;
    const auto it = FindDepth(k, chain);
    assert(it != d.end() && it->second >= pos);
    if (it->second > pos || HasMember(k, nodes_[u].lo, nodes_[u].hi)) return;  // the path stays touched
    int32_t depth = pos - 1;  // k's new depth: the deepest chain node above u with a member
    while (depth >= 0) {
      const Node& v = nodes_[ChainNode(chain, depth)];
      if (HasMember(k, v.lo, v.hi)) break;
      --depth;
    }
    ++steps_;
    nodes_[u].exact.erase(key);
    if (depth >= 0) {  // still touches the chain's top, so every node above it
      nodes_[ChainNode(chain, depth)].exact.insert(key);
      it->second = depth;
      return;
    }
    d.erase(it);
    u = nodes_[ChainNode(chain, 0)].parent;
  }
}

template <typename Better>
bool PlacementIndex::ScanLevel(const WorkSet& set, int64_t limit, int64_t len, int64_t floor, int64_t exclude,
                               int32_t skip_node, bool skip, Choice& best, Better better) {
  if (set.empty()) return false;  // O(1): not counted (at most max_depth + 1 per chain and query)
  ++steps_;
  auto it = set.upper_bound({limit, std::numeric_limits<int32_t>::max()});
  while (it != set.begin()) {
    --it;
    ++steps_;
    const int32_t k = -it->second;
    // Descending (work, -group): nothing further in this set beats the incumbent.
    const int64_t after = it->first + len - floor;
    if (best.group >= 0 && (after < best.after || (after == best.after && k > best.group))) return false;
    if (k == exclude) continue;
    if (skip && (skip_node < 0 ? mark_[k] == stamp_ : HasMember(k, nodes_[skip_node].lo, nodes_[skip_node].hi)))
      continue;
    const Choice cand{k, after, floor};
    if (better(cand, best)) best = cand;
    return true;
  }
  return false;
}

PlacementIndex::Choice PlacementIndex::Best(int32_t r, GreedyPolicy policy, int64_t exclude) {
  assert(lo_ <= r && r < hi_);
  const int64_t cap = ctx_.capacity();
  const int64_t len = ctx_.Length(r);
  const int32_t c = cell_of_[r - lo_];
  const std::vector<int32_t>& touch = cells_[c].touch;
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
  for (int32_t k : touch) mark_[k] = stamp_;
  steps_ += 1 + static_cast<int64_t>(touch.size());
  // The cell's groups, with exact shared amounts. Under best-fit they come last, bounded first:
  // a group touching the cell shares more than the cell parent's floor and at most as much as r
  // shares with a neighbouring rank, which brackets its work after r.
  const int64_t floor_above = nodes_[cells_[c].parent].floor;
  const int64_t most_shared =
      std::max(r > 0 ? ctx_.AdjacentLcp(r) : int64_t{0}, r + 1 < ctx_.size() ? ctx_.AdjacentLcp(r + 1) : int64_t{0});
  auto scan_cell = [&] {
    for (int32_t k : touch) {
      if (k == exclude || !live_[k]) continue;
      if (g_->work[k] + len - most_shared > cap) continue;  // over T whatever it shares
      if (policy == GreedyPolicy::kBestFit && best.group >= 0) {
        const int64_t most = g_->work[k] + len - floor_above - 1;
        if (most < best.after || (most == best.after && k > best.group)) continue;
      }
      ++steps_;
      const int64_t shared = SharedAmount(ctx_, g_->groups[k], r);
      const int64_t after = g_->work[k] + len - shared;
      if (after > cap) continue;
      const Choice cand{k, after, shared};
      if (better(cand, best)) best = cand;
    }
  };
  if (policy == GreedyPolicy::kMaxShared) {
    scan_cell();
    if (best.group >= 0) return best;  // a group touching the cell shares more than any level above
  }
  // The path's chains, bottom-up. The path leaves chain `chain` at its node u (position j) into
  // `below` (-1: the cell). Level u: groups of chain depth >= j not touching `below`; level of
  // position t < j: the exact set of t (the path goes on into t + 1, which they do not touch).
  int32_t below = -1;
  for (int32_t u = cells_[c].parent; u >= 0;) {
    const int32_t chain = nodes_[u].chain, j = nodes_[u].pos;
    const int32_t length = ChainLength(chain);
    const int64_t floor = nodes_[u].floor;
    bool found = false;
    for (int32_t t = j; t < length; ++t)
      found |= ScanLevel(nodes_[ChainNode(chain, t)].exact, cap - len + floor, len, floor, exclude, below, true, best,
                         better);
    if (policy == GreedyPolicy::kMaxShared && found) return best;  // shallower levels share less
    for (int32_t t = j - 1; t >= 0; --t) {
      const Node& v = nodes_[ChainNode(chain, t)];
      found = ScanLevel(v.exact, cap - len + v.floor, len, v.floor, exclude, -1, false, best, better);
      if (policy == GreedyPolicy::kMaxShared && found) return best;
    }
    below = ChainNode(chain, 0);
    u = nodes_[below].parent;
  }
  if (policy == GreedyPolicy::kBestFit) scan_cell();
  return best;
}

void PlacementIndex::Insert(int64_t k, int32_t r, int64_t work) {
  assert(live_[k]);
  const int32_t id = static_cast<int32_t>(k);
  Rekey(id, work);
  Attach(id, r);
  InsertSorted(g_->groups[k], r);
}

void PlacementIndex::Erase(int64_t k, int32_t r, int64_t work) {
  assert(live_[k]);
  const int32_t id = static_cast<int32_t>(k);
  EraseSorted(g_->groups[k], r);
  Detach(id, r);
  Rekey(id, work);
}

int64_t PlacementIndex::NewGroup(int32_t r) {
  const int32_t k = static_cast<int32_t>(g_->size());
  g_->groups.emplace_back();
  g_->work.push_back(ctx_.Length(r));
  live_.push_back(1);
  mark_.push_back(0);
  depths_.emplace_back();
  Attach(k, r);  // (no members yet: every chain on r's path is new to k)
  g_->groups[k].assign(1, r);
  return k;
}

void PlacementIndex::Retire(int64_t k) {
  assert(live_[k]);
  const int32_t id = static_cast<int32_t>(k);
  const std::pair<int64_t, int32_t> key{g_->work[k], -id};
  for (const auto& [chain, depth] : depths_[k]) nodes_[ChainNode(chain, depth)].exact.erase(key);
  steps_ += static_cast<int64_t>(depths_[k].size());
  depths_[k].clear();
  int32_t last = -1;
  for (int32_t r : g_->groups[k]) {
    const int32_t c = cell_of_[r - lo_];
    ++steps_;
    if (c == last) continue;  // members are sorted, so a cell's members are consecutive
    last = c;
    std::vector<int32_t>& touch = cells_[c].touch;
    steps_ += static_cast<int64_t>(touch.size());
    *std::find(touch.begin(), touch.end(), id) = touch.back();
    touch.pop_back();
  }
  live_[k] = 0;
}

}  // namespace harts
