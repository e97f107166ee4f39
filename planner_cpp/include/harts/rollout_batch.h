// Rollout-batch ingestion: the compact view of a batch of trajectories (Sections 2.1,
// 3.1 and 3.2 "Exact prefix cost" of the paper).
//
// Glossary
//   trajectory x_i   tokens[offsets[i], offsets[i+1]), i in [0, N); a root-to-leaf path
//                    of some rollout tree. tree_ids[i] optionally names that tree.
//   semantic pos s   flat index offsets[i] + p of token p of trajectory i; S = offsets[N].
//   compact row c    one unique token prefix; semantic positions with the same actual
//                    token prefix share one row, whichever tree they came from. Rows are
//                    numbered in lexicographic DFS preorder of the compact trie.
//   m                row_of_position[s]: the compact row of semantic position s (Eq. 3).
//   q_c              multiplicity[c]: number of semantic positions mapped to c (Eq. 20).
//   rank             position in the stable lexicographic order of trajectories.
//   W(lo, hi)        compact work of the trajectories of ranks [lo, hi) (Eq. 5).
//
// Limits (limits.h; violations throw ResourceExhausted naming the field):
//   1 <= N <= kMaxTrajectories, S <= kMaxSemanticTokens (so every row and position fits
//   int32). Preconditions (violations throw InvalidArgument naming the field):
//   offsets has N + 1 entries, offsets[0] = 0, offsets[N] = len(tokens), strictly
//   increasing (no empty trajectory); tokens >= 0; tree_ids, if given, has N entries >= 0.
//
// A batch can also be built from an already compacted segment tree (FromSegmentTree, the
// length form of segment_tree.h): per segment its parent and token count, per trajectory
// the segment at whose end it ends. The tree stands for the tokens: sibling order
// (increasing segment id, roots likewise) is the lexicographic order, siblings are
// distinct, and trajectories ending at the same segment are identical. The result equals, array for array, the batch
// ingested from any token buffer with that tree (such as the tree of a batch's own segment forest: parent, end - start,
// and the segment each trajectory ends at), so every plan made from it is identical too.
//
// Complexity: Ingest is O(N log N) trajectory comparisons (each O(LCP / 16)), plus O(S)
// for the map m, plus O(N log N) for the RMQ index. FromSegmentTree is O(V + N log N),
// independent of S: the per-row arrays (row_of_position, multiplicity, row_parent,
// row_depth, row_segment) are then built on first use, O(S), thread-safe. Lcp and
// IntervalWork are O(1); SubsetWork is O(k log k) for k trajectories.
//
// Cancellation: Ingest, FromSegmentTree and ValidateTrajectories take a trailing `cancel`
// (cancel.h; may be null), poll it in every loop (once per trajectory comparison, once per block
// of tokens) and throw Cancelled when it fires; no batch is returned then.
#ifndef HARTS_ROLLOUT_BATCH_H_
#define HARTS_ROLLOUT_BATCH_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "harts/cancel.h"
#include "harts/lex_order.h"
#include "harts/limits.h"
#include "harts/rmq.h"
#include "harts/segment_forest.h"
#include "harts/segment_tree.h"

namespace harts {

// The offsets checks of ValidateTrajectories (counts and limits, offsets[0] = 0, strictly
// increasing, offsets[N] = num_tokens), without reading a token. O(N).
void ValidateOffsets(int64_t num_tokens, const int64_t* offsets, int64_t num_offsets, CancelToken* cancel = nullptr);

// Checks the preconditions above; throws InvalidArgument / ResourceExhausted.
void ValidateTrajectories(const int32_t* tokens, int64_t num_tokens, const int64_t* offsets, int64_t num_offsets,
                          const int64_t* tree_ids, int64_t num_tree_ids, CancelToken* cancel = nullptr);

// Throws InvalidArgument naming `field` ("trajectory index i is out of range [0, n)") unless
// 0 <= i < n.
void CheckTrajectoryIndex(int64_t i, int64_t n, const std::string& field);

class RolloutBatch {
 public:
  // Validates and ingests. `tree_ids` may be null (num_tree_ids ignored then).
  // The token buffer is read during the call only; nothing keeps a pointer to it.
  static std::unique_ptr<RolloutBatch> Ingest(const int32_t* tokens, int64_t num_tokens, const int64_t* offsets,
                                              int64_t num_offsets, const int64_t* tree_ids, int64_t num_tree_ids,
                                              CancelToken* cancel = nullptr);

  // Validates (SegmentForestFromTree, tree_ids as in ValidateTrajectories) and builds the
  // batch of a compacted segment tree; trajectory i is the root-to-trajectory_end[i] path,
  // offsets are the prefix sums of the lengths. O(V + N log N); no per-token work.
  static std::unique_ptr<RolloutBatch> FromSegmentTree(const SegmentTreeView& tree, const int64_t* tree_ids,
                                                       int64_t num_tree_ids, CancelToken* cancel = nullptr);

  int64_t num_trajectories() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t semantic_tokens() const { return offsets_.back(); }
  int64_t compact_tokens() const { return forest_.num_rows; }

  // LCP(x_i, x_j) of trajectory indices i, j in [0, N). O(1).
  int64_t Lcp(int64_t i, int64_t j) const;
  // LCP of the trajectories at ranks a, b in [0, N). O(1).
  int64_t RankLcp(int64_t a, int64_t b) const;
  // W(lo, hi): compact work of ranks [lo, hi), 0 <= lo < hi <= N. O(1).
  int64_t IntervalWork(int64_t lo, int64_t hi) const;
  // Compact work C(M) of a set of distinct trajectory indices (Eq. 5). O(k log k).
  // Throws InvalidArgument naming `field` for an out-of-range or repeated index.
  int64_t SubsetWork(const int32_t* ids, int64_t k, const char* field = "trajectories") const;
  // Checks a set of trajectory indices (range, no repeats) and returns their ranks sorted.
  std::vector<int32_t> SortedRanks(const int32_t* ids, int64_t k, const char* field) const;

  const std::vector<int64_t>& lengths() const { return lengths_; }
  const std::vector<int64_t>& offsets() const { return offsets_; }
  const std::vector<int64_t>& tree_ids() const { return tree_ids_; }
  const std::vector<int32_t>& order() const { return order_; }
  const std::vector<int32_t>& rank() const { return rank_; }
  const std::vector<int32_t>& adjacent_lcp() const { return lcp_; }
  // Per-row arrays; the first call builds them (O(S)) when FromSegmentTree made the batch. The
  // build (and Ingest) throws ResourceExhausted naming "tokens" (Ingest) or "length"
  // (FromSegmentTree) when the arrays' 4 S + 16 C bytes exceed MaxPlanBytes() (plan_cost.h).
  const std::vector<int32_t>& row_of_position() const {
    EnsureRows();
    return row_of_position_;
  }
  const std::vector<int32_t>& multiplicity() const {
    EnsureRows();
    return multiplicity_;
  }
  const std::vector<int32_t>& row_parent() const {
    EnsureRows();
    return row_parent_;
  }
  const std::vector<int32_t>& row_depth() const {
    EnsureRows();
    return row_depth_;
  }
  const std::vector<int32_t>& row_segment() const {
    EnsureRows();
    return row_segment_;
  }
  const std::vector<int32_t>& segment_root() const { return segment_root_; }
  const std::vector<int32_t>& component() const { return component_; }
  const SegmentForest& forest() const { return forest_; }
  // True once the per-row arrays exist (always for Ingest; after the first per-row getter for
  // FromSegmentTree). Call planning (call_layout.h) never builds them.
  bool rows_built() const { return rows_built_.load(std::memory_order_acquire); }

 private:
  RolloutBatch() = default;
  // From offsets_, lengths_, order_ and lcp_: rank, prefix sums, RMQ, forest, components
  // and tree ids (the input ids, or the component index when tree_ids is null).
  void BuildIndex(const int64_t* tree_ids, CancelToken* cancel);
  void BuildCompactTrie(CancelToken* cancel) const;
  // A throwing (cancelled) build leaves the flag unset: the next call builds again.
  void EnsureRows(CancelToken* cancel = nullptr) const {
    std::call_once(rows_once_, [this, cancel] {
      BuildCompactTrie(cancel);
      rows_built_.store(true, std::memory_order_release);
    });
  }

  std::vector<int64_t> offsets_;        // N + 1
  std::vector<int64_t> lengths_;        // N
  std::vector<int64_t> tree_ids_;       // N (input ids, or the component index)
  std::vector<int32_t> order_, rank_;   // N
  std::vector<int32_t> lcp_;            // N, adjacent LCP in rank order
  std::vector<int64_t> prefix_length_;  // N + 1, prefix sums of lengths in rank order
  std::vector<int64_t> prefix_lcp_;     // N + 1, prefix sums of lcp_
  SparseTableRmq rmq_;                  // over lcp_
  // Built once by EnsureRows (INVARIANT: only read after it).
  mutable std::once_flag rows_once_;
  const char* rows_field_ = "tokens";  // the input a refused per-row build names
  mutable std::atomic<bool> rows_built_{false};
  mutable std::vector<int32_t> row_of_position_;  // S
  mutable std::vector<int32_t> multiplicity_;     // C
  mutable std::vector<int32_t> row_parent_;       // C, -1 for a root row
  mutable std::vector<int32_t> row_depth_;        // C
  mutable std::vector<int32_t> row_segment_;      // C
  std::vector<int32_t> segment_root_;             // V: root segment of v's tree
  std::vector<int32_t> component_;                // N: index into forest_.roots of x_i's tree
  SegmentForest forest_;
};

}  // namespace harts

#endif  // HARTS_ROLLOUT_BATCH_H_
