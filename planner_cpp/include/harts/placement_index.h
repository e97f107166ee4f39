// Destination search of the trie-aware greedy (greedy.h) without probing every microbatch.
//
// The greedy places a rank r into the microbatch M that maximizes a policy key among those
// that can take it (w(M) + dC <= T, dC = len(r) - h_M(r) by Eq. 10), where
//   h_M(r) = max(LCP(p, r), LCP(r, q)), p / q the members of M just below / above r,
// the shared amount of microbatch.h. Probing all K microbatches costs O(K log) per rank.
//
// Glossary
//   range [lo, hi)  the ranks the index covers; every group of the grouping holds ranks of it.
//   floor F         min of the adjacent LCPs L_t, lo < t < hi (0 when hi - lo < 2): every two
//                   ranks of the range share at least F tokens.
//   component       a maximal run of ranks of the range with no L_t == F inside (for F = 0 the
//                   rollout trees as recovered from shared tokens). Two ranks of one component
//                   share more than F tokens, two ranks of different components exactly F.
//   touching        a group touches a component when it holds one of its ranks.
//
// So for rank r of component c, a group that does not touch c has h = F exactly, and a
// group that touches c has h > F. Best() therefore evaluates the groups touching c one by
// one (exact h, O(log |M|) each) and takes the best of all other groups from one ordered set
// keyed by work: under either policy the best group with a fixed h = F is the one with the
// largest work <= T - len(r) + F (ties: the lowest index). The answer equals the full probe
// of greedy.h, tie rules included:
//   kBestFit    max (w(M) + dC, -index)
//   kMaxShared  max (h_M(r), w(M) + dC, -index)
//
// Complexity: O(t_c log + (1 + s) log K) per Best() for t_c the groups touching r's
// component and s the groups touching it that the ordered-set scan skips (s <= t_c); every
// update O(log K + |M|). For rollout batches (trees of bounded size, any common prefix)
// t_c is bounded by the tree's trajectories, so a greedy pass is O(N log N). A single
// component spread over all K groups is the worst case: O(K log) per Best(), as probing.
#ifndef HARTS_PLACEMENT_INDEX_H_
#define HARTS_PLACEMENT_INDEX_H_

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "harts/microbatch.h"

namespace harts {

enum class GreedyPolicy { kBestFit = 0, kMaxShared = 1 };

class PlacementIndex {
 public:
  // Indexes `g` (may be empty; every group's ranks in [lo, hi)), which it then owns the updates
  // of: change it only through Insert / Erase / NewGroup / Retire. O((hi - lo) + sum |M| + K log K).
  PlacementIndex(const PlanContext& ctx, int32_t lo, int32_t hi, Grouping* g);

  struct Choice {
    int64_t group = -1;  // -1: no live group can take the rank
    int64_t after = 0;   // the group's work with the rank
    int64_t shared = 0;  // h_M(r)
  };

  // The best live group for rank r (in [lo, hi), not a member of the result) under `policy`,
  // skipping `exclude` (-1: none).
  Choice Best(int32_t r, GreedyPolicy policy, int64_t exclude = -1);

  // Adds rank r to live group k, whose work becomes `work`. O(|M| + log K).
  void Insert(int64_t k, int32_t r, int64_t work);
  // Removes member r from live group k, whose work becomes `work`. O(|M| + log K).
  void Erase(int64_t k, int32_t r, int64_t work);
  // A new live group {r}; returns its index.
  int64_t NewGroup(int32_t r);
  // Group k stops being a destination (dissolved); its members stay in g->groups[k].
  void Retire(int64_t k);

  bool live(int64_t k) const { return live_[k] != 0; }
  int64_t floor() const { return floor_; }
  int64_t num_components() const { return static_cast<int64_t>(touch_.size()); }

 private:
  int32_t Component(int32_t r) const { return comp_[r - lo_]; }
  void Touch(int32_t c, int32_t k, int32_t delta);
  void Rekey(int64_t k, int64_t work);  // g_->work[k] = work, keeping by_work_ in step

  const PlanContext& ctx_;
  int32_t lo_, hi_;
  Grouping* g_;
  int64_t floor_ = 0;
  std::vector<int32_t> comp_;                                    // hi - lo: component of each rank
  std::vector<std::vector<std::pair<int32_t, int32_t>>> touch_;  // per component: (group, members in it)
  // INVARIANT: holds (work, -k) for every live group k.
  std::set<std::pair<int64_t, int32_t>> by_work_;
  std::vector<char> live_;
  std::vector<uint32_t> mark_;  // per group: == stamp_ while it touches the queried component
  uint32_t stamp_ = 0;
};

}  // namespace harts

#endif  // HARTS_PLACEMENT_INDEX_H_
