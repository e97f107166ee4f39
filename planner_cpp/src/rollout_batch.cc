#include "harts/rollout_batch.h"

#include <algorithm>
#include <string>

#include "harts/errors.h"
#include "harts/plan_cost.h"

namespace harts {
namespace {

// tree_ids, when given: one entry >= 0 per trajectory.
void ValidateTreeIds(const int64_t* tree_ids, int64_t num_tree_ids, int64_t n, CancelToken* cancel) {
  if (tree_ids == nullptr) return;
  RequireOnePer(num_tree_ids, n, "trajectory", "tree_ids");
  ForEachBlock(0, n, cancel, [&](int64_t i) {
    if (tree_ids[i] < 0) throw InvalidArgument(Indexed("tree_ids", i), MustBeAtLeast(0, tree_ids[i]));
  });
}

}  // namespace

void CheckTrajectoryIndex(int64_t i, int64_t n, const std::string& field) {
  if (i < 0 || i >= n)
    throw InvalidArgument(field,
                          "trajectory index " + std::to_string(i) + " is out of range [0, " + std::to_string(n) + ")");
}

void ValidateOffsets(int64_t num_tokens, const int64_t* offsets, int64_t num_offsets, CancelToken* cancel) {
  Check(cancel);
  if (num_offsets < 2)
    throw InvalidArgument("offsets",
                          "needs N + 1 >= 2 entries (at least one trajectory), got " + std::to_string(num_offsets));
  const int64_t n = num_offsets - 1;
  RequireWithinLimit(n, kMaxTrajectories, "trajectories", "offsets");
  RequireWithinLimit(num_tokens, kMaxSemanticTokens, "semantic tokens", "tokens");
  if (offsets[0] != 0) throw InvalidArgument("offsets[0]", "must be 0, got " + std::to_string(offsets[0]));
  for (int64_t i = 0; i < n; ++i) {
    if (i % kPollBlock == 0) Poll(cancel);
    if (offsets[i + 1] <= offsets[i])
      throw InvalidArgument(Indexed("offsets", i + 1), offsets[i + 1] == offsets[i]
                                                           ? "trajectory " + std::to_string(i) + " is empty"
                                                           : "offsets must be strictly increasing, got " +
                                                                 std::to_string(offsets[i + 1]) + " after " +
                                                                 std::to_string(offsets[i]));
  }
  if (offsets[n] != num_tokens)
    throw InvalidArgument(Indexed("offsets", n), "must equal len(tokens) = " + std::to_string(num_tokens) + ", got " +
                                                     std::to_string(offsets[n]));
}

void ValidateTrajectories(const int32_t* tokens, int64_t num_tokens, const int64_t* offsets, int64_t num_offsets,
                          const int64_t* tree_ids, int64_t num_tree_ids, CancelToken* cancel) {
  ValidateOffsets(num_tokens, offsets, num_offsets, cancel);
  const int64_t n = num_offsets - 1;
  int32_t min_token = 0;
  ForEachChunk(0, num_tokens, kPollChunk, cancel, [&](int64_t lo, int64_t hi) {  // vectorized between polls
    for (int64_t s = lo; s < hi; ++s) min_token = std::min(min_token, tokens[s]);
  });
  if (min_token < 0) {
    const int64_t s = std::find_if(tokens, tokens + num_tokens, [](int32_t t) { return t < 0; }) - tokens;
    const int64_t i = std::upper_bound(offsets, offsets + num_offsets, s) - offsets - 1;
    throw InvalidArgument(Indexed("tokens", s), "token ids must be >= 0, got " + std::to_string(tokens[s]) +
                                                    " (trajectory " + std::to_string(i) + ", position " +
                                                    std::to_string(s - offsets[i]) + ")");
  }
  ValidateTreeIds(tree_ids, num_tree_ids, n, cancel);
}

std::unique_ptr<RolloutBatch> RolloutBatch::Ingest(const int32_t* tokens, int64_t num_tokens, const int64_t* offsets,
                                                   int64_t num_offsets, const int64_t* tree_ids, int64_t num_tree_ids,
                                                   CancelToken* cancel) {
  ValidateTrajectories(tokens, num_tokens, offsets, num_offsets, tree_ids, num_tree_ids, cancel);
  std::unique_ptr<RolloutBatch> b(new RolloutBatch());
  const int64_t n = num_offsets - 1;
  CopyPolled(&b->offsets_, offsets, num_offsets, cancel);
  ResizePolled(&b->lengths_, n, cancel);
  ForEachBlock(0, n, cancel, [&](int64_t i) { b->lengths_[i] = offsets[i + 1] - offsets[i]; });

  const TrajectoryView view{tokens, offsets, n};
  try {
    b->order_ = LexicographicOrder(view, cancel);
    b->lcp_ = AdjacentLcp(view, b->order_, cancel);
    b->BuildIndex(tree_ids, cancel);
    b->EnsureRows(cancel);
  } catch (...) {
    DestroyInBackground(std::move(b));  // a cancelled ingestion returns without freeing its rows first
    throw;
  }
  return b;
}

std::unique_ptr<RolloutBatch> RolloutBatch::FromSegmentTree(const SegmentTreeView& t, const int64_t* tree_ids,
                                                            int64_t num_tree_ids, CancelToken* cancel) {
  std::vector<int32_t> preorder;
  const SegmentForest tree = SegmentForestFromTree(t, &preorder, cancel);  // ids kept, not canonical
  const std::vector<int32_t>& end_position = tree.end;
  const int64_t n = t.num_trajectories, v_count = t.num_segments;
  ValidateTreeIds(tree_ids, num_tree_ids, n, cancel);
  std::unique_ptr<RolloutBatch> b(new RolloutBatch());
  b->rows_field_ = "length";
  ResizePolled(&b->lengths_, n, cancel);
  ResizePolled(&b->offsets_, n + 1, cancel);
  ForEachBlock(0, n, cancel, [&](int64_t i) {
    b->lengths_[i] = end_position[t.trajectory_end[i]];
    b->offsets_[i + 1] = b->offsets_[i] + b->lengths_[i];
  });
  // Trajectories ending at each segment, by index (a stable counting sort).
  std::vector<int64_t> end_offsets;
  ResizePolled(&end_offsets, v_count + 1, cancel);
  ForEachBlock(0, n, cancel, [&](int64_t i) { ++end_offsets[t.trajectory_end[i] + 1]; });
  ForEachBlock(0, v_count, cancel, [&](int64_t v) { end_offsets[v + 1] += end_offsets[v]; });
  std::vector<int32_t> ending;
  ResizePolled(&ending, n, cancel);
  {
    std::vector<int64_t> fill;
    CopyPolled(&fill, end_offsets.data(), v_count, cancel);
    ForEachBlock(0, n, cancel, [&](int64_t i) { ending[fill[t.trajectory_end[i]]++] = static_cast<int32_t>(i); });
  }
  // Lexicographic order = preorder of the ends (a prefix precedes its extensions, siblings by
  // id). Adjacent LCP: the shallowest position the walk climbs to between two ends, i.e. the
  // start of every segment it leaves since the previous end; that is the end of their LCA.
  b->order_.reserve(n);
  ResizePolled(&b->lcp_, n, cancel);
  std::vector<int32_t> path;  // ancestors of the current segment, root first
  int64_t climb = 0;          // min start of the segments left since the previous end
  for (const int32_t v : preorder) {
    Poll(cancel);
    while (!path.empty() && path.back() != t.parent[v]) {  // leave finished segments
      const int32_t u = path.back();
      path.pop_back();
      climb = std::min<int64_t>(climb, tree.start[u]);
    }
    if (t.parent[v] < 0) climb = 0;  // a new root shares nothing with earlier trees
    path.push_back(v);
    for (int64_t k = end_offsets[v]; k < end_offsets[v + 1]; ++k) {
      const int64_t r = static_cast<int64_t>(b->order_.size());
      if (r > 0) b->lcp_[r] = static_cast<int32_t>(k == end_offsets[v] ? climb : end_position[v]);
      b->order_.push_back(ending[k]);
      climb = end_position[v];
    }
  }
  b->BuildIndex(tree_ids, cancel);
  return b;
}

void RolloutBatch::BuildIndex(const int64_t* tree_ids, CancelToken* cancel) {
  const int64_t n = num_trajectories();
  ResizePolled(&rank_, n, cancel);
  ResizePolled(&prefix_length_, n + 1, cancel);
  ResizePolled(&prefix_lcp_, n + 1, cancel);
  std::vector<int64_t> sorted_lengths;
  ResizePolled(&sorted_lengths, n, cancel);
  for (int64_t r = 0; r < n; ++r) {
    if (r % kPollBlock == 0) Poll(cancel);
    rank_[order_[r]] = static_cast<int32_t>(r);
    sorted_lengths[r] = lengths_[order_[r]];
    prefix_length_[r + 1] = prefix_length_[r] + sorted_lengths[r];
    prefix_lcp_[r + 1] = prefix_lcp_[r] + lcp_[r];
  }
  rmq_ = SparseTableRmq(lcp_, cancel);
  forest_ = BuildSegmentForest(order_.data(), sorted_lengths.data(), lcp_.data(), n, cancel);
  Check(cancel);

  const SegmentForest& f = forest_;
  ResizePolled(&segment_root_, f.size(), cancel);
  std::vector<int32_t> root_index;
  AssignPolled(&root_index, f.size(), -1, cancel);
  ForEachBlock(0, f.size(), cancel, [&](int64_t v) {  // preorder: parents come first
    segment_root_[v] = f.parent[v] < 0 ? static_cast<int32_t>(v) : segment_root_[f.parent[v]];
  });
  for (size_t k = 0; k < f.roots.size(); ++k) root_index[f.roots[k]] = static_cast<int32_t>(k);
  ResizePolled(&component_, n, cancel);
  ForEachBlock(0, n, cancel, [&](int64_t r) { component_[order_[r]] = root_index[segment_root_[f.item_segment[r]]]; });
  if (tree_ids != nullptr) {
    CopyPolled(&tree_ids_, tree_ids, n, cancel);
  } else {
    ResizePolled(&tree_ids_, n, cancel);
    ForEachBlock(0, n, cancel, [&](int64_t i) { tree_ids_[i] = component_[i]; });
  }
}

void RolloutBatch::BuildCompactTrie(CancelToken* cancel) const {
  const int64_t bytes = RowArraysBytes(semantic_tokens(), compact_tokens());
  if (bytes > MaxPlanBytes())
    throw ResourceExhausted(
        rows_field_, "the per-row arrays of " + std::to_string(semantic_tokens()) + " semantic tokens and " +
                         std::to_string(compact_tokens()) + " compact rows need " + std::to_string(bytes) +
                         " bytes, over the limit of " + std::to_string(MaxPlanBytes()) + " bytes (max_plan_bytes)");
  const int64_t n = num_trajectories();
  const SegmentForest& f = forest_;
  const int64_t num_rows = f.num_rows;
  ResizePolled(&row_of_position_, offsets_[n], cancel);
  ResizePolled(&row_parent_, num_rows, cancel);
  ResizePolled(&row_depth_, num_rows, cancel);
  ResizePolled(&multiplicity_, num_rows, cancel);
  ResizePolled(&row_segment_, num_rows, cancel);
  int64_t next_row = 0;
  for (int64_t r = 0; r < n; ++r) {
    Poll(cancel);
    const int64_t i = order_[r];
    const int64_t l = r == 0 ? 0 : lcp_[r];
    int32_t* m = row_of_position_.data() + offsets_[i];
    if (l > 0) {
      const int32_t* prev = row_of_position_.data() + offsets_[order_[r - 1]];
      ForEachChunk(0, l, kPollChunk, cancel, [&](int64_t lo, int64_t hi) { std::copy(prev + lo, prev + hi, m + lo); });
    }
    ForEachBlock(l, lengths_[i], cancel, [&](int64_t p) {
      const int32_t c = static_cast<int32_t>(next_row++);
      m[p] = c;
      row_parent_[c] = p == 0 ? -1 : m[p - 1];
      row_depth_[c] = static_cast<int32_t>(p);
    });
  }
  for (int64_t v = 0; v < f.size(); ++v) {
    const int64_t begin = f.row_begin[v], len = f.end[v] - f.start[v];
    ForEachChunk(begin, begin + len, kPollChunk, cancel, [&](int64_t lo, int64_t hi) {
      std::fill(multiplicity_.begin() + lo, multiplicity_.begin() + hi, f.multiplicity[v]);
      std::fill(row_segment_.begin() + lo, row_segment_.begin() + hi, static_cast<int32_t>(v));
    });
  }
}

int64_t RolloutBatch::RankLcp(int64_t a, int64_t b) const {
  if (a == b) return lengths_[order_[a]];
  if (a > b) std::swap(a, b);
  return rmq_.Min(a + 1, b + 1);
}

int64_t RolloutBatch::Lcp(int64_t i, int64_t j) const { return RankLcp(rank_[i], rank_[j]); }

int64_t RolloutBatch::IntervalWork(int64_t lo, int64_t hi) const {
  return (prefix_length_[hi] - prefix_length_[lo]) - (prefix_lcp_[hi] - prefix_lcp_[lo + 1]);
}

std::vector<int32_t> RolloutBatch::SortedRanks(const int32_t* ids, int64_t k, const char* field) const {
  const int64_t n = num_trajectories();
  std::vector<int32_t> ranks(k);
  for (int64_t j = 0; j < k; ++j) {
    if (ids[j] < 0 || ids[j] >= n) CheckTrajectoryIndex(ids[j], n, Indexed(field, j));  // field built on failure only
    ranks[j] = rank_[ids[j]];
  }
  std::sort(ranks.begin(), ranks.end());
  for (int64_t j = 1; j < k; ++j)
    if (ranks[j] == ranks[j - 1])
      throw InvalidArgument(field, "trajectory index " + std::to_string(order_[ranks[j]]) + " appears more than once");
  return ranks;
}

int64_t RolloutBatch::SubsetWork(const int32_t* ids, int64_t k, const char* field) const {
  const std::vector<int32_t> ranks = SortedRanks(ids, k, field);
  int64_t work = 0;
  for (int64_t j = 0; j < k; ++j) work += lengths_[order_[ranks[j]]] - (j == 0 ? 0 : RankLcp(ranks[j - 1], ranks[j]));
  return work;
}

}  // namespace harts
