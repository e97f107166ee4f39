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
//                other part is a cell. Each rank lies in one cell, below a path of nodes. For
//                rollout batches: the root's parts are the rollout trees (F = 0), or the system
//                prompts, each a node whose parts are the trees behind it; a bushy tree nests
//                node in node as its branches peel off.
//   chains       the heavy-path decomposition of the nodes: a node's heavy child is its child
//                node with the most ranks (ties: the first); a chain runs from a node that is no
//                heavy child (its top) down through heavy children. A root-to-cell path crosses
//                O(log) chains, entering each at its top.
//   touching     a group touches a node or cell when it holds one of its ranks; the nodes it
//                touches are closed under parents, so in each chain it touches a prefix, down to
//                its chain depth t_M(C) (the deepest touched position).
//
// So for rank r in cell c below nodes u_0 (root) > u_1 > ... > u_d, a group has
//   h = exact LCP (> F(u_d))      if it touches c;
//   h = F(u_j)                    if it touches u_j but not the next node or cell on the path;
// and under either policy the best group of a level with a fixed h is the one with the largest
// work <= T - len(r) + h (ties: the lowest index). Each node keeps the ordered set (work, -index)
// of the groups whose chain depth in its chain is that node ("exact" sets); a group is in one
// set per chain it touches. Best() evaluates the groups touching c one by one (O(log |M|) each),
// then walks the path's chains bottom-up. Where the path leaves a chain at u_j (into a light
// child node or the cell), level u_j's groups are those of chain depth >= j that do not touch
// the next node or cell (already evaluated, with a larger h): the exact sets of positions >= j,
// each scanned by work from the limit, skipping those. Above u_j the next node on the path is the
// heavy child, so level u_t (t < j) is exactly the exact set of u_t: no skipping. Scans stop as
// soon as nothing further can beat the incumbent. The answer equals the full probe, tie rules
// included:
//   kBestFit    max (w(M) + dC, -index)
//   kMaxShared  max (h_M(r), w(M) + dC, -index)
//
// Complexity: Best() is O(t_c log + sum over the path's chains of (len(C) + s_C) log K) for t_c
// the groups touching r's cell, len(C) <= max_depth + 1 the chains' lengths and s_C the groups
// an exit level skips (touching the next node or cell, with a work between the incumbent's and
// the limit). An update re-keys the group in one set per chain it touches, O(|M| + n_C log K)
// for n_C such chains, plus O(log) per chain entered or left. Microbatches of contiguous rank
// ranges (the lexicographic orders, the per-tree plans) touch a few chains whatever the trie's
// depth; orders that scatter a microbatch over many subtrees make n_C and t_c grow, which
// greedy.h's step budget bounds.
#ifndef HARTS_PLACEMENT_INDEX_H_
#define HARTS_PLACEMENT_INDEX_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <set>
#include <utility>
#include <vector>

#include "harts/cancel.h"
#include "harts/microbatch.h"

namespace harts {

enum class GreedyPolicy { kBestFit = 0, kMaxShared = 1 };

// Fixed-size nodes for the index's ordered sets, carved from blocks and recycled through a free
// list: a greedy pass inserts and erases millions of set nodes, which malloc would scatter (and
// spend a fifth of the time on). One pool per index, freed with it.
class NodePool {
 public:
  // A node of `size` bytes; the first request fixes the pool's node size, and a request of another
  // size gets nullptr (its caller allocates elsewhere).
  void* Get(size_t size) {
    if (size_ == 0) size_ = Slot(size);
    if (Slot(size) != size_) return nullptr;
    if (free_ != nullptr) {
      void* p = free_;
      free_ = *static_cast<void**>(p);
      return p;
    }
    if (used_ == capacity_) {  // a new block, twice the last (small indexes stay small), not zeroed
      capacity_ = capacity_ == 0 ? kFirstBlock : std::min(2 * capacity_, kMaxBlock);
      blocks_.emplace_back(new std::max_align_t[size_ * capacity_ / sizeof(std::max_align_t)]);
      used_ = 0;
    }
    return reinterpret_cast<std::byte*>(blocks_.back().get()) + size_ * used_++;
  }
  // Whether Get(size) is served by the pool.
  bool Serves(size_t size) const { return size_ != 0 && Slot(size) == size_; }
  // Takes back a node Get returned.
  void Put(void* p) {
    *static_cast<void**>(p) = free_;
    free_ = p;
  }

 private:
  static constexpr size_t kFirstBlock = 16, kMaxBlock = 4096;  // nodes per block
  // A node's bytes rounded up to the maximal alignment (so every node of a block is aligned).
  static size_t Slot(size_t size) {
    const size_t a = alignof(std::max_align_t);
    return (std::max(size, sizeof(void*)) + a - 1) / a * a;
  }
  size_t size_ = 0;
  std::vector<std::unique_ptr<std::max_align_t[]>> blocks_;
  size_t used_ = 0, capacity_ = 0;  // nodes handed out of / in the last block
  void* free_ = nullptr;
};

// std::allocator-compatible front of a NodePool: single objects of the pool's node size come from
// it, anything else from operator new.
template <typename T>
struct PoolAllocator {
  using value_type = T;
  std::shared_ptr<NodePool> pool;
  explicit PoolAllocator(std::shared_ptr<NodePool> p) : pool(std::move(p)) {}
  template <typename U>
  PoolAllocator(const PoolAllocator<U>& o) : pool(o.pool) {}  // NOLINT(google-explicit-constructor): rebinding
  T* allocate(size_t n) {
    if (n == 1 && alignof(T) <= alignof(std::max_align_t))
      if (void* p = pool->Get(sizeof(T))) return static_cast<T*>(p);
    return static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, size_t n) {
    if (n == 1 && alignof(T) <= alignof(std::max_align_t) && Pooled()) {
      pool->Put(p);
    } else {
      ::operator delete(p);
    }
  }
  template <typename U>
  bool operator==(const PoolAllocator<U>& o) const {
    return pool == o.pool;
  }
  template <typename U>
  bool operator!=(const PoolAllocator<U>& o) const {
    return pool != o.pool;
  }

 private:
  // Whether this type's single objects come from the pool (it serves one node size).
  bool Pooled() const { return pool->Serves(sizeof(T)); }
};

class PlacementIndex {
 public:
  static constexpr int32_t kDefaultMinNode = 128;  // ranks for a part to become a node
  static constexpr int32_t kDefaultMaxDepth = 16;  // node levels below the root

  // Indexes `g` (may be empty; every group's ranks in [lo, hi)), which it then owns the updates
  // of: change it only through Insert / Erase / NewGroup / Retire.
  // O((hi - lo) depth + sum |M| + sum n_C log K).
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
  int64_t num_chains() const { return static_cast<int64_t>(chain_offset_.size()) - 1; }
  // Elementary steps spent so far (construction included): set updates, sets and groups
  // examined, hierarchy levels walked, binary searches in a group's members. Deterministic (a
  // function of the calls alone), so a caller can bound its work by it (greedy.h's step budget).
  int64_t steps() const { return steps_; }

 private:
  using Key = std::pair<int64_t, int32_t>;  // (work, -group)
  using WorkSet = std::set<Key, std::less<Key>, PoolAllocator<Key>>;

  struct Node {
    explicit Node(const std::shared_ptr<NodePool>& pool) : exact(PoolAllocator<Key>(pool)) {}
    int64_t floor = 0;
    int32_t parent = -1;     // node index; -1 for the root
    int32_t lo = 0, hi = 0;  // its ranks
    int32_t chain = 0, pos = 0;
    WorkSet exact;  // INVARIANT: the live groups whose chain depth in `chain` is `pos`
  };
  struct Cell {
    int32_t parent = 0;          // node index
    int32_t lo = 0, hi = 0;      // its ranks
    std::vector<int32_t> touch;  // INVARIANT: every live group with a member in the cell
  };
  using Depths = std::vector<std::pair<int32_t, int32_t>>;  // (chain, depth), by chain

  void Build(int32_t node, int32_t lo, int32_t hi, int32_t depth, int32_t min_node, int32_t max_depth);
  void BuildChains();
  int32_t ChainNode(int32_t chain, int32_t pos) const { return chain_nodes_[chain_offset_[chain] + pos]; }
  int32_t ChainLength(int32_t chain) const { return chain_offset_[chain + 1] - chain_offset_[chain]; }
  // Whether group k has a member in ranks [lo, hi) (binary search in its sorted members).
  bool HasMember(int32_t k, int32_t lo, int32_t hi);
  // Group k's entry of `chain` in depths_[k] (end() if none).
  Depths::iterator FindDepth(int32_t k, int32_t chain);
  // Sets g_->work[k] = work, re-keying k's entries in place (its set memberships unchanged).
  void Rekey(int32_t k, int64_t work);
  // Rank r (not a member of k yet): registers k in r's cell and deepens its chain depths along
  // r's path, with entries at g_->work[k].
  void Attach(int32_t k, int32_t r);
  // Rank r (no longer a member of k): unregisters k from r's cell and lifts its chain depths
  // along r's path to its remaining members.
  void Detach(int32_t k, int32_t r);
  // Scans set `set` from work `limit` down for level candidates of shared amount `floor`,
  // skipping `exclude` and (skip_node >= 0) groups touching that node or (skip_node == -1) the
  // queried cell; updates `best`.
  template <typename Better>
  bool ScanLevel(const WorkSet& set, int64_t limit, int64_t len, int64_t floor, int64_t exclude, int32_t skip_node,
                 bool skip, Choice& best, Better better);

  const PlanContext& ctx_;
  int32_t lo_, hi_;
  Grouping* g_;
  std::shared_ptr<NodePool> pool_ = std::make_shared<NodePool>();  // the sets' nodes (outlives them)
  std::vector<Node> nodes_;
  std::vector<Cell> cells_;
  std::vector<int32_t> cell_of_;       // hi - lo: the cell of each rank
  std::vector<int32_t> chain_nodes_;   // the nodes of every chain, top first
  std::vector<int32_t> chain_offset_;  // chain c is chain_nodes_[chain_offset_[c], chain_offset_[c + 1])
  std::vector<Depths> depths_;         // per group: its chain depth in every chain it touches
  std::vector<char> live_;
  std::vector<uint32_t> mark_;  // per group: == stamp_ while it touches the queried cell
  uint32_t stamp_ = 0;
  int64_t steps_ = 0;
};

}  // namespace harts

#endif  // HARTS_PLACEMENT_INDEX_H_
