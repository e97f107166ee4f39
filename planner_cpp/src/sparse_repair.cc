#include "harts/sparse_repair.h"

#include <algorithm>
#include <vector>

namespace harts {
namespace {

// Max-gain tree over ranks: leaf r holds the gain of r's best update (0: none); the root
// holds the largest gain and its leftmost rank (the first found scanning r ascending).
class GainTree {
 public:
  // All n gains 0; O(n), polling `cancel` per block.
  void Reset(int64_t n, CancelToken* cancel) {
    size_ = 1;
    while (size_ < n) size_ *= 2;
    AssignPolled<int64_t>(&gain_, 2 * size_, 0, cancel);
    AssignPolled<int32_t>(&rank_, 2 * size_, 0, cancel);
    ForEachBlock(0, size_, cancel, [&](int64_t i) { rank_[size_ + i] = static_cast<int32_t>(i); });
    ForEachBlock(0, size_ - 1, cancel, [&](int64_t j) { Pull(size_ - 1 - j); });
  }
  void Set(int32_t r, int64_t gain) {
    int64_t i = size_ + r;
    gain_[i] = gain;
    for (i /= 2; i >= 1; i /= 2) Pull(i);
  }
  int64_t best_gain() const { return gain_[1]; }
  int32_t best_rank() const { return rank_[1]; }

 private:
  void Pull(int64_t i) {
    const int64_t l = 2 * i, r = 2 * i + 1;
    const int64_t from = gain_[l] >= gain_[r] ? l : r;
    gain_[i] = gain_[from];
    rank_[i] = rank_[from];
  }
  int64_t size_ = 1;
  std::vector<int64_t> gain_;
  std::vector<int32_t> rank_;
};

class Repairer {
 public:
  Repairer(const PlanContext& ctx, Grouping& g, int64_t window, CancelToken* cancel)
      : ctx_(ctx), g_(g), n_(ctx.size()), window_(window), cancel_(cancel) {
    // Every per-rank array filled in polled pieces (hundreds of MB for millions of ranks).
    ResizePolled(&group_of_, n_, cancel_);
    moves_.Reset(n_, cancel_);
    swaps_.Reset(n_, cancel_);
    AssignPolled<int32_t>(&move_dest_, n_, -1, cancel_);
    AssignPolled<int32_t>(&swap_with_, n_, -1, cancel_);
    ResizePolled(&swap_work_, n_, cancel_);
    ResizePolled(&mark_, n_, cancel_);
    ResizePolled(&seen_, g.size(), cancel_);
    for (int64_t k = 0; k < g.size(); ++k) {
      Poll(cancel_);
      for (int32_t r : g.groups[k]) group_of_[r] = static_cast<int32_t>(k);
    }
    for (int32_t r = 0; r < n_; ++r) {
      Poll(cancel_);
      EvalMove(r);
    }
  }

  // One update (the best move, else the best swap); false when none gains.
  bool Step() {
    if (moves_.best_gain() > 0) {
      const int32_t r = moves_.best_rank();
      const int32_t a = group_of_[r], b = move_dest_[r];
      g_.work[a] -= RemovalDelta(ctx_, g_.groups[a], r);
      EraseSorted(g_.groups[a], r);
      g_.work[b] += InsertionDelta(ctx_, g_.groups[b], r);
      InsertSorted(g_.groups[b], r);
      group_of_[r] = b;
      Refresh(a, b);
      return true;
    }
    if (!swaps_valid_) {
      for (int32_t r = 0; r < n_; ++r) {
        Poll(cancel_);
        EvalSwap(r);
      }
      swaps_valid_ = true;
    }
    if (swaps_.best_gain() <= 0) return false;
    const int32_t r = swaps_.best_rank(), q = swap_with_[r];
    const int32_t a = group_of_[r], b = group_of_[q];
    EraseSorted(g_.groups[a], r);
    InsertSorted(g_.groups[a], q);
    EraseSorted(g_.groups[b], q);
    InsertSorted(g_.groups[b], r);
    g_.work[a] = swap_work_[r].first;
    g_.work[b] = swap_work_[r].second;
    group_of_[r] = b;
    group_of_[q] = a;
    Refresh(a, b);
    return true;
  }

 private:
  // Best move of rank r: to the first group, scanning r' ascending in the window, with the
  // largest strictly positive gain.
  void EvalMove(int32_t r) {
    const int32_t a = group_of_[r];
    int64_t best_gain = 0;
    int32_t dest = -1;
    if (g_.groups[a].size() >= 2) {
      const int64_t saved = RemovalDelta(ctx_, g_.groups[a], r);
      const int64_t lo = std::max<int64_t>(0, r - window_), hi = std::min<int64_t>(n_ - 1, r + window_);
      if (++seen_stamp_ == 0) {
        std::fill(seen_.begin(), seen_.end(), 0);
        seen_stamp_ = 1;
      }
      for (int64_t r2 = lo; r2 <= hi; ++r2) {
        const int32_t b = group_of_[r2];
        if (b == a || seen_[b] == seen_stamp_) continue;
        seen_[b] = seen_stamp_;
        const int64_t added = InsertionDelta(ctx_, g_.groups[b], r);
        if (g_.work[b] + added > ctx_.capacity()) continue;
        if (saved - added > best_gain) {
          best_gain = saved - added;
          dest = b;
        }
      }
    }
    move_dest_[r] = dest;
    moves_.Set(r, best_gain);
  }

  // Best swap of rank r with a rank r' in (r, r + H] of another group.
  void EvalSwap(int32_t r) {
    const int32_t a = group_of_[r];
    const int64_t cap = ctx_.capacity();
    const int64_t saved_a = RemovalDelta(ctx_, g_.groups[a], r);
    int64_t best_gain = 0;
    int32_t with = -1;
    for (int64_t r2 = r + 1; r2 <= std::min<int64_t>(n_ - 1, r + window_); ++r2) {
      const int32_t b = group_of_[r2];
      if (b == a) continue;
      const int32_t q = static_cast<int32_t>(r2);
      const int64_t wa = g_.work[a] - saved_a + InsertionDelta(ctx_, g_.groups[a], q, r);
      if (wa > cap) continue;
      const int64_t wb = g_.work[b] - RemovalDelta(ctx_, g_.groups[b], q) + InsertionDelta(ctx_, g_.groups[b], r, q);
      if (wb > cap) continue;
      const int64_t gain = g_.work[a] + g_.work[b] - wa - wb;
      if (gain > best_gain) {
        best_gain = gain;
        with = q;
        swap_work_[r] = {wa, wb};
      }
    }
    swap_with_[r] = with;
    swaps_.Set(r, best_gain);
  }

  // Re-evaluates every rank whose best update may involve groups a or b: their members and
  // every rank within the window of one.
  void Refresh(int32_t a, int32_t b) {
    if (++stamp_ == 0) {
      std::fill(mark_.begin(), mark_.end(), 0);
      stamp_ = 1;
    }
    touched_.clear();
    for (int32_t k : {a, b})
      for (int32_t m : g_.groups[k]) {
        const int64_t lo = std::max<int64_t>(0, m - window_), hi = std::min<int64_t>(n_ - 1, m + window_);
        for (int64_t r = lo; r <= hi; ++r)
          if (mark_[r] != stamp_) {
            mark_[r] = stamp_;
            touched_.push_back(static_cast<int32_t>(r));
          }
      }
    for (int32_t r : touched_) {
      Poll(cancel_);
      EvalMove(r);
      if (swaps_valid_) EvalSwap(r);
    }
  }

  const PlanContext& ctx_;
  Grouping& g_;
  const int32_t n_;
  const int64_t window_;
  std::vector<int32_t> group_of_;
  GainTree moves_, swaps_;
  std::vector<int32_t> move_dest_, swap_with_;
  std::vector<std::pair<int64_t, int64_t>> swap_work_;  // (w(A'), w(B')) of r's best swap
  bool swaps_valid_ = false;                            // swaps_ is computed on first need
  std::vector<uint32_t> mark_;
  uint32_t stamp_ = 0;
  std::vector<int32_t> touched_;
  std::vector<uint32_t> seen_;  // per group: == seen_stamp_ once EvalMove has tried it
  uint32_t seen_stamp_ = 0;
  CancelToken* cancel_;
};

}  // namespace

int64_t SparseRepair(const PlanContext& ctx, Grouping& g, int64_t window, int64_t iterations, CancelToken* cancel) {
  if (iterations <= 0 || ctx.size() == 0) return 0;
  Poll(cancel);
  Repairer repair(ctx, g, window, cancel);
  int64_t applied = 0;
  for (int64_t it = 0; it < iterations; ++it) {
    Poll(cancel);
    if (!repair.Step()) break;
    ++applied;
  }
  return applied;
}

}  // namespace harts
