// Destination search of the trie-aware greedy (greedy.h) without probing every microbatch.
//
// The greedy places a rank r into the microbatch M that maximizes a policy key among those
// that can take it (w(M) + dC <= T, dC = len(r) - h_M(r) by Eq. 10), where
//   h_M(r) = max(LCP(p, r), LCP(r, q)), p / q the members of M just below / above r,
// the shared amount of microbatch.h. Probing all K microbatches costs O(K log) per rank.
//
// Glossary
//   range        the ranks [lo, hi) the index covers; every group holds ranks of it.
//   floor F(u)   of a rank range u: min of the adjacent LCPs L_t inside it (lo < t < hi); any
//                two ranks of u share at least F(u) tokens.
//   parts of u   the maximal sub-ranges of u with no L_t == F(u) inside: two ranks of one part
//                share more than F(u) tokens, two ranks of different parts exactly F(u).
//   hierarchy    the range is the root node; a part of a node with at least `min_node` ranks,
//                at depth < `max_depth`, is a node itself (split again at its own floor); every
//                other part is a cell. Each rank lies in one cell, below a chain of nodes. For
//                rollout batches: the root's parts are the rollout trees (F = 0), or the system
//                prompts, each a node whose parts are the trees behind it.
//   touching     a group touches a node or cell when it holds one of its ranks.
//
// So for rank r in cell c below nodes u_0 (root) > u_1 > ... > u_d, a group has
//   h = exact LCP (> F(u_d))      if it touches c;
//   h = F(u_j)                    if it touches u_j but not the next node or cell on the path;
// and under either policy the best group of a level with a fixed h is the one with the largest
// work <= T - len(r) + h (ties: the lowest index). Best() evaluates the groups touching c one by
// one (O(log |M|) each) and each level from the node's ordered set of touching groups by work,
// skipping those that touch the next node or cell on the path (already evaluated, with a larger
// h). The answer equals the full probe, tie rules included:
//   kBestFit    max (w(M) + dC, -index)
//   kMaxShared  max (h_M(r), w(M) + dC, -index)
//
// Complexity: Best() is O(t_c log + sum_levels (1 + s_j) log K) for t_c the groups touching
// r's cell and s_j the groups a level's scan skips (those touching the next node or cell, with
// a work between the level's answer and its limit); an update re-keys the group in the set of
// every node it touches, O(|M| + n_M log K) for n_M such nodes. For rollout batches (trees of
// bounded size behind a few prompt levels) n_M and t_c are small and a greedy pass is
// O(N log N). Deep, bushy tries whose microbatches gather trajectories from many subtrees make
// n_M grow (a random recursive tree of 75k trajectories: seconds); one cell spread over all K
// groups is the worst case, O(K log) per Best(), as probing.
#ifndef HARTS_PLACEMENT_INDEX_H_
#define HARTS_PLACEMENT_INDEX_H_

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "harts/cancel.h"
#include "harts/microbatch.h"

namespace harts {

enum class GreedyPolicy { kBestFit = 0, kMaxShared = 1 };

class PlacementIndex {
 public:
  static constexpr int32_t kDefaultMinNode = 128;  // ranks for a part to become a node
  static constexpr int32_t kDefaultMaxDepth = 16;  // node levels below the root

  // Indexes `g` (may be empty; every group's ranks in [lo, hi)), which it then owns the updates
  // of: change it only through Insert / Erase / NewGroup / Retire.
  // O((hi - lo) + sum |M| depth + K depth log K).
  // (min_node, max_depth: the hierarchy's shape; the defaults suit rollout batches, and any
  // values give the same answers.) Polls `cancel` (cancel.h) per indexed group.
  PlacementIndex(const PlanContext& ctx, int32_t lo, int32_t hi, Grouping* g, CancelToken* cancel = nullptr,
                 int32_t min_node = kDefaultMinNode, int32_t max_depth = kDefaultMaxDepth);

  struct Choice {
    int64_t group = -1;  // -1: no live group can take the rank
    int64_t after = 0;   // the group's work with the rank
    int64_t shared = 0;  // h_M(r)
  };

  // The best live group for rank r (in [lo, hi), not a member of the result) under `policy`,
  // skipping `exclude` (-1: none).
  Choice Best(int32_t r, GreedyPolicy policy, int64_t exclude = -1);

  // Adds rank r to live group k, whose work becomes `work`.
  void Insert(int64_t k, int32_t r, int64_t work);
  // Removes member r from live group k, whose work becomes `work`.
  void Erase(int64_t k, int32_t r, int64_t work);
  // A new live group {r}; returns its index.
  int64_t NewGroup(int32_t r);
  // Group k stops being a destination (dissolved); its members stay in g->groups[k].
  void Retire(int64_t k);

  // Frees the index in blocks, polling `cancel` between them (its destructor would free millions
  // of small containers in one stretch); the index is unusable afterwards.
  void Release(CancelToken* cancel);

  bool live(int64_t k) const { return live_[k] != 0; }
  int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size()); }
  int64_t num_cells() const { return static_cast<int64_t>(cells_.size()); }

 private:
  using WorkSet = std::set<std::pair<int64_t, int32_t>>;  // (work, -group)

  struct Node {
    int64_t floor = 0;
    int32_t parent = -1;  // node index; -1 for the root
    WorkSet touching;     // INVARIANT: every live group touching the node
  };
  struct Cell {
    int32_t parent = 0;                              // node index
    std::vector<std::pair<int32_t, int32_t>> touch;  // (group, members in the cell)
  };

  void Build(int32_t node, int32_t lo, int32_t hi, int32_t depth, int32_t min_node, int32_t max_depth);
  // Adds or removes group k's entries in every set it belongs to, at its current work.
  void Entries(int32_t k, bool add);
  // Sets g_->work[k] = work, re-keying k's entries in place (its set memberships unchanged).
  void Rekey(int32_t k, int64_t work);
  // Member count of group k in node u > 0 (0 if none; a missing entry is added).
  int32_t& NodeCount(int32_t k, int32_t u);
  bool Touches(int32_t k, int32_t u) const;
  void Count(int32_t k, int32_t r, int32_t delta);  // counts of r's cell and nodes

  const PlanContext& ctx_;
  int32_t lo_, hi_;
  Grouping* g_;
  std::vector<Node> nodes_;
  std::vector<Cell> cells_;
  std::vector<int32_t> cell_of_;  // hi - lo: the cell of each rank
  // Per group: (node, members in it) for every node other than the root it touches.
  std::vector<std::vector<std::pair<int32_t, int32_t>>> node_count_;
  std::vector<char> live_;
  std::vector<uint32_t> mark_;  // per group: == stamp_ while it touches the queried cell
  uint32_t stamp_ = 0;
  std::vector<int32_t> path_;  // scratch: the nodes above the queried cell, deepest first
};

}  // namespace harts

#endif  // HARTS_PLACEMENT_INDEX_H_
