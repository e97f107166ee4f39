#include "harts/evolution.h"

#include <algorithm>
#include <functional>
#include <map>
#include <queue>
#include <set>
#include <tuple>

#include "harts/natural_partition.h"

namespace harts {
namespace {

// The merge sequence: cuts as a doubly linked list over rank positions, and a min-heap of
// (-saving, merged work, cut) entries, re-validated on pop.
class Merger {
 public:
  Merger(const PlanContext& ctx, const std::vector<int32_t>& cuts)
      : ctx_(ctx), prev_(ctx.size() + 1, -1), next_(ctx.size() + 1, -1), count_(cuts.size() - 1) {
    for (size_t i = 0; i < cuts.size(); ++i) {
      if (i > 0) prev_[cuts[i]] = cuts[i - 1];
      if (i + 1 < cuts.size()) next_[cuts[i]] = cuts[i + 1];
    }
    for (size_t i = 1; i + 1 < cuts.size(); ++i) Push(cuts[i]);
  }

  int64_t count() const { return count_; }

  // Merges the best feasible adjacent pair; false if none fits the capacity.
  bool MergeOnce() {
    while (!heap_.empty()) {
      const auto [neg_saving, w, c] = heap_.top();
      heap_.pop();
      if (prev_[c] < 0 || next_[c] < 0 || ctx_.Work(prev_[c], next_[c]) != w) continue;  // stale
      const int32_t p = prev_[c], q = next_[c];
      next_[p] = q;
      prev_[q] = p;
      prev_[c] = next_[c] = -1;
      --count_;
      if (p != 0) Push(p);
      if (q != ctx_.size()) Push(q);
      return true;
    }
    return false;
  }

  std::vector<int32_t> Cuts() const {
    std::vector<int32_t> cuts = {0};
    for (int32_t c = 0; c != ctx_.size();) cuts.push_back(c = next_[c]);
    return cuts;
  }

 private:
  // An entry for inner cut c when merging its two sides fits the capacity (merged work only
  // grows as merges go on, so an infeasible pair stays infeasible).
  void Push(int32_t c) {
    const int64_t w = ctx_.Work(prev_[c], next_[c]);
    if (w <= ctx_.capacity()) heap_.push({-ctx_.AdjacentLcp(c), w, c});
  }

  using Entry = std::tuple<int64_t, int64_t, int32_t>;
  const PlanContext& ctx_;
  std::vector<int32_t> prev_, next_;  // -1: not a cut (or no neighbour)
  int64_t count_;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap_;
};

// The split sequence: an ordered set of (L_t, max side work, t) per non-singleton microbatch.
class Splitter {
 public:
  Splitter(const PlanContext& ctx, const std::vector<int32_t>& cuts) : ctx_(ctx), cuts_(cuts.begin(), cuts.end()) {
    for (size_t i = 0; i + 1 < cuts.size(); ++i) Add(cuts[i], cuts[i + 1]);
  }

  int64_t count() const { return static_cast<int64_t>(cuts_.size()) - 1; }

  // Splits the best microbatch; false if every microbatch is a singleton.
  bool SplitOnce() {
    if (best_.empty()) return false;
    const auto [cost, mx, t] = *best_.begin();
    best_.erase(best_.begin());
    const auto it = cuts_.upper_bound(t);
    const int32_t hi = *it, lo = *std::prev(it);
    cuts_.insert(t);
    Add(lo, t);
    Add(t, hi);
    return true;
  }

  std::vector<int32_t> Cuts() const { return std::vector<int32_t>(cuts_.begin(), cuts_.end()); }

 private:
  void Add(int32_t lo, int32_t hi) {
    if (hi - lo < 2) return;
    const int32_t t = BestValleyCut(ctx_, lo, hi, false);
    best_.insert({ctx_.AdjacentLcp(t), std::max(ctx_.Work(lo, t), ctx_.Work(t, hi)), t});
  }

  const PlanContext& ctx_;
  std::set<int32_t> cuts_;
  std::set<std::tuple<int64_t, int64_t, int32_t>> best_;
};

}  // namespace

std::vector<EvolvedPartition> EvolvePartition(const PlanContext& ctx, const std::vector<int32_t>& natural,
                                              const std::vector<int64_t>& targets, CancelToken* cancel) {
  std::map<int64_t, EvolvedPartition> done;
  std::vector<int64_t> down, up;
  const int64_t k0 = static_cast<int64_t>(natural.size()) - 1;
  for (int64_t k : targets) (k <= k0 ? down : up).push_back(k);
  std::sort(down.begin(), down.end(), std::greater<int64_t>());
  std::sort(up.begin(), up.end());

  if (!down.empty()) {
    Merger merger(ctx, natural);
    bool alive = true;
    for (int64_t k : down) {
      while (alive && merger.count() > k) {
        Poll(cancel);
        alive = merger.MergeOnce();
      }
      EvolvedPartition& e = done[k];
      e.k = k;
      e.feasible = alive && k >= 1;
      if (e.feasible) e.cuts = merger.Cuts();
    }
  }
  if (!up.empty()) {
    Splitter splitter(ctx, natural);
    bool alive = true;
    for (int64_t k : up) {
      while (alive && splitter.count() < k) {
        Poll(cancel);
        alive = splitter.SplitOnce();
      }
      EvolvedPartition& e = done[k];
      e.k = k;
      e.feasible = alive;
      if (e.feasible) e.cuts = splitter.Cuts();
    }
  }
  std::vector<EvolvedPartition> out;
  for (int64_t k : targets) out.push_back(done[k]);
  return out;
}

}  // namespace harts
