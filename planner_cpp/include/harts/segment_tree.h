// Segment trees given as per-segment arrays: the one validator and builder behind both array
// inputs of the planner (segments as in Section 3.3 of the paper and segment_forest.h).
//
//   length form    parent[v], length[v], and trajectory_end[i] per trajectory: the compacted
//                  tree of a whole batch (the sidecar's "compacted tree" request), read by
//                  RolloutBatch::FromSegmentTree.
//   position form  parent[v], start[v], end[v]: the bare segment forest of one microbatch,
//                  read by PlanSegmentForest (call_layout.h).
//
// Glossary
//   V              number of segments; ids v in [0, V).
//   parent[v]      -1 for a root, otherwise the id of v's parent segment.
//   child order    the children of a segment, and the roots, by increasing id. It is the
//                  lexicographic order of a length-form tree and the child order in which
//                  Algorithm 1 (min_call.h) tries direct continuations.
//   preorder       DFS preorder in child order, the roots' subtrees one after another.
//   positions      [start_v, end_v), start_v < end_v: a root starts at 0, a child where its
//                  parent ends. The length form derives them (end_v = start_v + length[v]);
//                  the position form gives them, and they are checked.
//   rows           compact rows numbered along the preorder: v holds [row_begin_v,
//                  row_begin_v + end_v - start_v); num_rows is the sum of the lengths.
//   trajectory i   (length form) the path from a root to the last token of segment
//                  trajectory_end[i]; N trajectories.
//
// Checks, in this order; the first violation throws (InvalidArgument unless marked RE =
// ResourceExhausted), naming the field:
//   1. sizes     length, or start and end, have V entries           "length" / "start", "end"
//   2. counts    V >= 1                                              "parent"
//                V <= kMaxTreeSegments (length form) or
//                     kMaxForestSegments (position form)             RE "parent"
//                (length form) N >= 1; RE N <= kMaxTrajectories      "trajectory_end"
//   3. segments  by id: -1 <= parent[v] < V and parent[v] != v       "parent[v]"
//                length[v] >= 1                                      "length[v]"
//                start[v] >= 0; end[v] > start[v]                    "start[v]"; "end[v]"
//   4. positions (position form) RE num_rows <= kMaxForestRows       "end"
//                by id: start[v] = 0 for a root, end[parent[v]] else "start[v]"
//   5. acyclic   every segment is reached from a root; else the      "parent[v]"
//                smallest unreached v (on or below a parent cycle, no root above it); in
//                the position form 4 implies it (positions grow along parent links)
//   6. ends      (length form) by index: 0 <= trajectory_end[i] < V  "trajectory_end[i]"
//                RE the trajectories 0..i hold <= kMaxSemanticTokens "trajectory_end[i]"
//                every leaf ends a trajectory                        "trajectory_end"
// A valid length-form tree therefore has every position, row and id inside int32.
//
// Complexity: O(V) time and space for the position form, O(V + N) for the length form; no
// recursion. Both poll `cancel` (cancel.h; may be null) in their loops and throw Cancelled when it
// fires.
#ifndef HARTS_SEGMENT_TREE_H_
#define HARTS_SEGMENT_TREE_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"
#include "harts/limits.h"
#include "harts/segment_forest.h"

namespace harts {

// Length form. Pointers may be null when the matching count is 0.
//   parent[v]          -1 (a root) or a segment id; no cycles.
//   length[v]          tokens of segment v, >= 1.
//   trajectory_end[i]  the segment at whose last token trajectory i ends.
// Unary segments at which no trajectory ends are allowed (ingestion merges them with their
// child, as ingestion from tokens would); every leaf must end a trajectory, so that no token
// belongs to no trajectory.
struct SegmentTreeView {
  const int32_t* parent = nullptr;
  int64_t num_segments = 0;  // V = len(parent)
  const int32_t* length = nullptr;
  int64_t num_lengths = 0;
  const int32_t* trajectory_end = nullptr;
  int64_t num_trajectories = 0;  // N
};

// Position form. Pointers may be null when the matching count is 0.
struct SegmentForestView {
  const int32_t* parent = nullptr;
  int64_t num_segments = 0;  // V = len(parent)
  const int32_t* start = nullptr;
  int64_t num_starts = 0;
  const int32_t* end = nullptr;
  int64_t num_ends = 0;
};

// Both builders check the tree (above) and return its topology as a SegmentForest with ids
// kept: start, end, parent, child_offsets, children, roots, row_begin and num_rows. The
// trajectory fields (subtree_end, owner, multiplicity, end_offsets, ending, item_segment)
// stay empty: a tree from arrays need not be canonical (ids need not follow the preorder;
// the length form may have unary segments). When `preorder` is non-null it receives the V
// segment ids in preorder.
SegmentForest SegmentForestFromTree(const SegmentTreeView& tree, std::vector<int32_t>* preorder = nullptr,
                                    CancelToken* cancel = nullptr);
SegmentForest SegmentForestFromArrays(const SegmentForestView& forest, std::vector<int32_t>* preorder = nullptr,
                                      CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_SEGMENT_TREE_H_
