// Segment forest of a set of trajectories: the compact trie with every maximal
// fork-free path contracted into one vertex (Section 3.3 of the paper).
//
// Glossary
//   item        one trajectory of the input set, identified by its position k in the
//               given lexicographic order (0 <= k < K) and carrying a caller id.
//   node        a trie node at which the compact trie forks (two or more children)
//               or at which some trajectory ends; plus the virtual root (depth 0).
//   segment v   the token path between a node and its nearest node ancestor:
//               absolute positions [start_v, end_v), start_v < end_v, with no fork and
//               no trajectory end strictly inside. A segment with start_v = 0 is a root;
//               one rollout tree (connected component of the trie) has exactly one root.
//   children    ch(v): the segments starting at end_v below v, in lexicographic order.
//   ending(v)   ids of the trajectories whose last token is at position end_v - 1 of v,
//               in lexicographic (rank) order; identical trajectories all end at v.
//   owner(v)    the first item (in the given order) whose path contains v.
//   rows        the set's own compact rows, numbered in lexicographic DFS preorder, so
//               that segment v occupies the contiguous rows [row_begin_v, row_begin_v +
//               end_v - start_v) and row_begin increases along the preorder.
//
// Segments are numbered in preorder (roots in lexicographic order), so the subtree of v
// is the contiguous id range [v, subtree_end_v).
//
// Complexity: BuildSegmentForest is O(K) time and space (one stack pass over the
// adjacent LCPs, the classic LCP-interval construction), independent of token counts. It polls
// `cancel` (cancel.h; may be null) once per item and segment and throws Cancelled when it fires.
#ifndef HARTS_SEGMENT_FOREST_H_
#define HARTS_SEGMENT_FOREST_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"

namespace harts {

struct SegmentForest {
  // Per segment v, v in [0, size()).
  std::vector<int32_t> start;          // start_v
  std::vector<int32_t> end;            // end_v
  std::vector<int32_t> parent;         // parent segment, -1 for a root
  std::vector<int32_t> subtree_end;    // subtree of v is [v, subtree_end_v)
  std::vector<int32_t> owner;          // item position (not id) of owner(v)
  std::vector<int64_t> row_begin;      // first compact row of v
  std::vector<int32_t> multiplicity;   // number of items whose path contains v
  std::vector<int64_t> child_offsets;  // CSR: ch(v) = children[child_offsets[v], child_offsets[v+1])
  std::vector<int32_t> children;
  std::vector<int64_t> end_offsets;  // CSR: ending(v) = ending[end_offsets[v], end_offsets[v+1])
  std::vector<int32_t> ending;       // trajectory ids
  std::vector<int32_t> roots;        // root segments in lexicographic order
  // Per item position k: the segment at whose end the item's trajectory ends.
  std::vector<int32_t> item_segment;
  int64_t num_rows = 0;  // compact rows of the set: sum_k (len_k - lcp_k)

  int64_t size() const { return static_cast<int64_t>(start.size()); }
  int64_t num_children(int64_t v) const { return child_offsets[v + 1] - child_offsets[v]; }
};

// Builds the segment forest of K trajectories given in lexicographic order.
//   ids[k]      caller id of item k (stored in `ending`).
//   lengths[k]  |x_k| >= 1.
//   lcp[k]      LCP(x_{k-1}, x_k) for k >= 1; lcp[0] is ignored (treated as 0).
// Preconditions: the items are sorted lexicographically and the LCPs are exact
// (0 <= lcp[k] <= min(lengths[k-1], lengths[k])). Violations are not detected.
SegmentForest BuildSegmentForest(const int32_t* ids, const int64_t* lengths, const int32_t* lcp, int64_t num_items,
                                 CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_SEGMENT_FOREST_H_
