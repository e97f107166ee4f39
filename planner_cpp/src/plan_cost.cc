#include "harts/plan_cost.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "harts/call_layout.h"
#include "harts/errors.h"
#include "harts/min_call.h"

namespace harts {
namespace {

std::atomic<int64_t> max_plan_bytes{kDefaultMaxPlanBytes};

// Saturating arithmetic on costs in [0, kMaxCost].
int64_t Add(int64_t a, int64_t b) { return a >= kMaxCost - b ? kMaxCost : a + b; }
int64_t Mul(int64_t a, int64_t b) {
  if (a <= 0 || b <= 0) return 0;
  return a > kMaxCost / b ? kMaxCost : a * b;
}
// sum of coefficient * count over the terms.
int64_t Linear(std::initializer_list<std::pair<int64_t, int64_t>> terms) {
  int64_t total = 0;
  for (const auto& [coefficient, count] : terms) total = Add(total, Mul(coefficient, count));
  return total;
}

// floor(log2 x) for x >= 1.
int64_t FloorLog2(int64_t x) { return 63 - __builtin_clzll(static_cast<uint64_t>(x)); }

// The replay walk of a sequence covers positions [max(0, b - w + 1), s_head) with
// s_head - b < B; so at most B - 1 + (w - 1) rows, and at most the deepest start.
int64_t WalkBound(int64_t chunk_size, int64_t conv_width, int64_t deepest_start) {
  return std::min(chunk_size - 1 + conv_width - 1, deepest_start);
}

}  // namespace

int64_t MaxPlanBytes() { return max_plan_bytes.load(std::memory_order_relaxed); }

int64_t SetMaxPlanBytes(int64_t bytes) {
  RequireAtLeast(bytes, 1, "max_plan_bytes");
  return max_plan_bytes.exchange(bytes, std::memory_order_relaxed);
}

int64_t CallBytes::total() const { return Add(retained, scratch); }

void CheckMicrobatchIds(const int32_t* ids, int64_t k, int64_t n) {
  if (ids == nullptr) return;
  if (k == 0) throw InvalidArgument("trajectories", "a microbatch needs at least one trajectory");
  std::vector<char> seen(n, 0);
  for (int64_t j = 0; j < k; ++j) {
    if (ids[j] < 0 || ids[j] >= n) CheckTrajectoryIndex(ids[j], n, Indexed("trajectories", j));
    if (seen[ids[j]])
      throw InvalidArgument("trajectories", "trajectory index " + std::to_string(ids[j]) + " appears more than once");
    seen[ids[j]] = 1;
  }
}

CallShape TreeCallShape(const SegmentTreeView& tree, const int32_t* ids, int64_t k, int64_t chunk_size,
                        int64_t conv_width, int64_t* canonical_segments, CancelToken* cancel) {
  ValidateChunkSize(chunk_size);
  ValidateConvWidth(conv_width);
  std::vector<int32_t> preorder;
  const SegmentForest t = SegmentForestFromTree(tree, &preorder, cancel);
  const int64_t n = tree.num_trajectories, v_count = tree.num_segments;
  CheckMicrobatchIds(ids, k, n);
  const int64_t items = ids == nullptr ? n : k;
  // marked_children[u]: -1 while u is on no microbatch path, then its children on one.
  std::vector<int32_t> marked_children(v_count, -1);
  std::vector<char> ends(v_count, 0);
  std::vector<int32_t> order;  // marked segments, parents first (each walk reversed)
  std::vector<int32_t> walk;
  CallShape s;
  s.trajectories = items;
  s.exact = true;
  int64_t longest = 0;
  for (int64_t j = 0; j < items; ++j) {
    Poll(cancel);
    int32_t u = tree.trajectory_end[ids == nullptr ? j : ids[j]];
    s.semantic_tokens += t.end[u];
    longest = std::max<int64_t>(longest, t.end[u]);
    ends[u] = 1;
    walk.clear();
    for (; u >= 0 && marked_children[u] < 0; u = t.parent[u]) {
      marked_children[u] = 0;
      walk.push_back(u);
    }
    for (auto it = walk.rbegin(); it != walk.rend(); ++it) {
      if (t.parent[*it] >= 0) ++marked_children[t.parent[*it]];
      order.push_back(*it);
    }
  }
  std::vector<int32_t> depth(v_count, 0);
  for (const int32_t u : order) {
    const int32_t c = marked_children[u];
    const bool node = c != 1 || ends[u];
    s.rows += t.end[u] - t.start[u];
    s.segments += node;
    s.sequences += c == 0;
    s.roots += t.parent[u] < 0;
    if (c >= 2) s.replay_rows += (c - 1) * (t.end[u] % chunk_size);
    depth[u] = (t.parent[u] < 0 ? 0 : depth[t.parent[u]]) + node;
    s.height = std::max<int64_t>(s.height, depth[u]);
  }
  s.state_slots = s.sequences - s.roots;
  s.longest_walk = WalkBound(chunk_size, conv_width, longest);
  if (canonical_segments != nullptr) {
    std::fill(ends.begin(), ends.end(), 0);
    for (int64_t i = 0; i < n; ++i) ends[tree.trajectory_end[i]] = 1;
    int64_t canonical = 0;
    for (int64_t u = 0; u < v_count; ++u) canonical += t.child_offsets[u + 1] - t.child_offsets[u] != 1 || ends[u];
    *canonical_segments = canonical;
  }
  return s;
}

CallShape BatchCallShape(const RolloutBatch& batch, const int32_t* ids, int64_t k, int64_t chunk_size,
                         int64_t conv_width, CancelToken* cancel) {
  Check(cancel);
  ValidateChunkSize(chunk_size);
  ValidateConvWidth(conv_width);
  const int64_t n = batch.num_trajectories();
  std::vector<int32_t> ranks;
  if (ids == nullptr) {
    ranks.resize(n);
    for (int64_t r = 0; r < n; ++r) ranks[r] = static_cast<int32_t>(r);
  } else {
    if (k == 0) throw InvalidArgument("trajectories", "a microbatch needs at least one trajectory");
    ranks = batch.SortedRanks(ids, k, "trajectories");
  }
  const int64_t items = static_cast<int64_t>(ranks.size());
  CallShape s;
  s.trajectories = items;
  s.exact = true;
  // The nodes on the current path, as BuildSegmentForest's stack holds them (the virtual root, at
  // depth 0, at the bottom): their depths, and the heights (in nodes) of their subtrees so far.
  std::vector<int64_t> depth = {0}, height = {1};
  auto pop = [&] {  // closes the top node into its parent
    const int64_t h = height.back();
    depth.pop_back();
    height.pop_back();
    height.back() = std::max(height.back(), h + 1);
  };
  int64_t previous_length = 0, longest = 0;
  for (int64_t j = 0; j < items; ++j) {
    Poll(cancel);
    const int64_t length = batch.lengths()[batch.order()[ranks[j]]];
    const int64_t l = j == 0 ? 0 : batch.RankLcp(ranks[j - 1], ranks[j]);
    s.semantic_tokens += length;
    s.rows += length - l;
    longest = std::max(longest, length);
    if (l < length && (j == 0 || l < previous_length) && l > 0) s.replay_rows += l % chunk_size;  // a fork at l
    if (j > 0 && l < previous_length) ++s.sequences;  // the previous item's node stays a leaf
    if (l == 0) ++s.roots;
    while (depth.back() > l) {
      if (depth[depth.size() - 2] >= l) {
        pop();
      } else {  // a new fork at depth l above the top node
        depth.back() = l;
        height.back() += 1;
        ++s.segments;
      }
    }
    if (length > l) {
      depth.push_back(length);
      height.push_back(1);
      ++s.segments;
    }
    previous_length = length;
  }
  while (depth.size() > 1) pop();
  s.height = height[0] - 1;
  ++s.sequences;  // the last item ends a leaf
  s.state_slots = s.sequences - s.roots;
  s.longest_walk = WalkBound(chunk_size, conv_width, longest);
  return s;
}

CallShape ForestCallShape(const SegmentForest& f, int64_t chunk_size, int64_t conv_width) {
  CallShape s;
  s.exact = true;
  s.batch_links = false;
  s.segments = f.size();
  s.rows = f.num_rows;
  s.replay_rows = MandatoryReplay(f, chunk_size);
  s.roots = static_cast<int64_t>(f.roots.size());
  std::vector<int32_t> depth(f.size(), 0);
  int64_t deepest_start = 0;
  for (const int32_t v : ParentsFirstOrder(f)) {
    s.sequences += f.num_children(v) == 0;
    depth[v] = (f.parent[v] < 0 ? 0 : depth[f.parent[v]]) + 1;
    s.height = std::max<int64_t>(s.height, depth[v]);
    deepest_start = std::max<int64_t>(deepest_start, f.start[v]);
  }
  s.state_slots = s.sequences - s.roots;
  s.longest_walk = WalkBound(chunk_size, conv_width, deepest_start);
  return s;
}

CallShape TokenCallShape(int64_t num_tokens, const int64_t* offsets, int64_t num_offsets, const int32_t* ids, int64_t k,
                         int64_t chunk_size, int64_t conv_width) {
  ValidateChunkSize(chunk_size);
  ValidateConvWidth(conv_width);
  ValidateOffsets(num_tokens, offsets, num_offsets);
  const int64_t n = num_offsets - 1;
  CheckMicrobatchIds(ids, k, n);
  const int64_t items = ids == nullptr ? n : k;
  CallShape s;
  s.trajectories = items;
  int64_t longest = 0;
  for (int64_t j = 0; j < items; ++j) {
    const int64_t i = ids == nullptr ? j : ids[j];
    const int64_t length = offsets[i + 1] - offsets[i];
    s.semantic_tokens += length;
    longest = std::max(longest, length);
  }
  s.rows = s.semantic_tokens;                        // C <= S_M
  s.segments = 2 * items;                            // <= one leaf and one fork per item
  s.sequences = items;                               // <= one leaf per item
  s.roots = items;                                   // <= one tree per item
  s.state_slots = items - 1;                         // P <= Q - roots, at least one root
  s.height = std::min<int64_t>(2 * items, longest);  // <= V, <= one segment per token
  // R: every fork but the roots' adds (children - 1) * (e mod B) < B per extra child, and there
  // are at most items - 1 extra children; e < the longest trajectory.
  s.replay_rows = Mul(items - 1, std::min<int64_t>(chunk_size - 1, longest - 1));
  s.longest_walk = WalkBound(chunk_size, conv_width, longest);
  return s;
}

CallBytes CallPlanBytes(const CallShape& s, int64_t chunk_size, int64_t conv_width) {
  (void)chunk_size;  // enters through s.replay_rows and s.longest_walk
  const int64_t v = s.segments, c = s.rows, r = s.replay_rows, q = s.sequences, k = s.trajectories;
  const int64_t rounds = s.rounds(), slots = s.state_slots, roots = s.roots;
  const int64_t context = Mul(q, conv_width - 1);
  CallBytes b;
  // The plan (min_call.h): t_pre, t_in, direct_child, chain, segment_sequence [V]; round offsets
  // [K + 1]; four per-sequence arrays, chain and request offsets, consumed slots [Q (+ 1)]; four
  // per-slot arrays [P].
  const int64_t plan = Linear({{20, v}, {28, q}, {4, rounds}, {16, slots}, {1, 12}});
  const int64_t plan_scratch = Linear({{29, v}, {4, q}, {4, rounds}});
  // The layout (call_layout.h): three per-row arrays, two per packed row, segment physical
  // begins, per-sequence offsets and lengths, per-round offsets (one int64), cu_seqlens [Q + K],
  // the two convolution contexts [Q * (w - 1)] and four per-request arrays [P].
  const int64_t layout =
      Linear({{12, c}, {8, Add(c, r)}, {4, v}, {12, q}, {24, rounds}, {8, context}, {16, slots}, {1, 20}});
  const int64_t layout_scratch = Mul(4, s.longest_walk);
  // ForestCallShape inside the backstop: depth and order [V].
  const int64_t shape_scratch = Mul(8, v);
  b.retained = Linear({{1, plan}, {1, layout}, {1, 4096}});  // + the MicrobatchCallPlan object
  // + the MicrobatchCallPlan and CallLayout objects built on the heap before they are moved out.
  b.scratch = Linear({{1, plan_scratch}, {1, layout_scratch}, {1, shape_scratch}, {1, 4096}});
  if (s.batch_links) {
    // BuildSegmentForest of the k items: retained start, end, parent, subtree_end, owner,
    // multiplicity, children [V], row_begin, child and end offsets [V (+ 1)] (int64), ending and
    // item_segment [k], roots (grown by doubling); scratch: the builder's nodes [2k + 1] (32 bytes
    // each), end links, row bases [k], its stack and DFS frames, child counts, fill cursors.
    const int64_t forest = Linear({{56, v}, {8, k}, {8, roots}, {1, 16}});
    const int64_t forest_scratch = Linear({{76, k}, {84, v}, {8, roots}, {1, 48}});
    // PlanMicrobatch: trajectories [k]; row_to_global, physical_to_global [C], semantic offsets
    // [k + 1] (int64) and semantic_to_physical [S_M]; scratch: ranks, item ids, LCPs and lengths.
    const int64_t links = Linear({{4, k}, {8, c}, {8, k}, {1, 8}, {4, s.semantic_tokens}});
    const int64_t links_scratch = Mul(20, k);
    b.retained = Linear({{1, b.retained}, {1, forest}, {1, links}});
    b.scratch = Linear({{1, b.scratch}, {1, forest_scratch}, {1, links_scratch}});
  }
  return b;
}

void CheckCallPlanBudget(const CallShape& shape, int64_t chunk_size, int64_t conv_width, const char* field) {
  const int64_t needed = CallPlanBytes(shape, chunk_size, conv_width).total(), limit = MaxPlanBytes();
  if (needed <= limit) return;
  throw ResourceExhausted(field, "the call plan needs up to " + std::to_string(needed) + " bytes (" +
                                     std::to_string(shape.rows) + " compact rows, " +
                                     std::to_string(shape.replay_rows) + " replay rows), over the limit of " +
                                     std::to_string(limit) + " bytes (max_plan_bytes)");
}

int64_t TreeIngestBytes(int64_t segments, int64_t trajectories, int64_t canonical_segments) {
  const int64_t v = segments, n = trajectories, vc = canonical_segments;
  // SegmentForestFromTree: parent, children, preorder, start, end [V]; child offsets, end
  // positions, fill cursors, row_begin [V (+ 1)] (int64); the ends mark; roots and the DFS stack
  // (grown by doubling). FromSegmentTree: lengths, offsets, end offsets (int64), the ending
  // trajectories, order and LCPs; its path stack.
  const int64_t tree = Linear({{85, v}, {1, 16}});
  const int64_t from_tree = Linear({{32, v}, {28, n}, {1, 32}});
  // BuildIndex: rank, two prefix sums and the sorted lengths; the sparse table (4 bytes per entry
  // on each of floor(log2 N) + 1 levels, and its level headers); the canonical forest (as
  // CallPlanBytes counts BuildSegmentForest); segment roots, root index, components, tree ids.
  const int64_t levels = FloorLog2(std::max<int64_t>(n, 1)) + 1;
  const int64_t index = Linear({{28, n}, {Mul(4, levels), n}, {48 * 4, levels}, {1, 32}});
  const int64_t forest = Linear({{56 + 84 + 8 + 8, vc}, {8 + 76, n}, {1, 64}});
  const int64_t extras = Linear({{8, vc}, {12, n}});
  return Linear({{1, tree}, {1, from_tree}, {1, index}, {1, forest}, {1, extras}, {1, 4096}});
}

int64_t TokenIngestBytes(int64_t trajectories, int64_t semantic_tokens, int64_t compact_rows,
                         int64_t canonical_segments) {
  const int64_t n = trajectories, vc = canonical_segments;
  // Ingest: offsets, lengths (int64), order (and the stable sort's buffer), LCPs; then the index
  // as in TreeIngestBytes, and the per-row arrays.
  const int64_t levels = FloorLog2(std::max<int64_t>(n, 1)) + 1;
  const int64_t ingest = Linear({{24, n}, {1, 8}});
  const int64_t index = Linear({{28, n}, {Mul(4, levels), n}, {48 * 4, levels}, {1, 32}});
  const int64_t forest = Linear({{56 + 84 + 8 + 8, vc}, {8 + 76, n}, {1, 64}});
  const int64_t extras = Linear({{8, vc}, {12, n}});
  return Linear({{1, ingest},
                 {1, index},
                 {1, forest},
                 {1, extras},
                 {1, RowArraysBytes(semantic_tokens, compact_rows)},
                 {1, 4096}});
}

int64_t RowArraysBytes(int64_t semantic_tokens, int64_t compact_rows) {
  // row_of_position [S]; multiplicity, row_parent, row_depth, row_segment [C].
  return Linear({{4, semantic_tokens}, {16, compact_rows}});
}

int64_t StepPlanBytes(int64_t trajectories, int64_t canonical_segments, const PlannerOptions& options) {
  const int64_t n = trajectories;
  // Candidates: every sampled K (at most max_sampled_k, at most N of them) and about 32 greedy,
  // component and refined ones, each a grouping of the N trajectories with its per-microbatch
  // arrays; measured at under 10 bytes per trajectory and candidate (plan_cost_test), counted as
  // 16. Per trajectory and per segment: the planning context, orders and schedules.
  const int64_t candidates = std::min<int64_t>(std::max<int64_t>(options.max_sampled_k, 0), n) + 32;
  int64_t bytes = Linear({{16, Mul(n, candidates)}, {1024, n}, {256, canonical_segments}, {1, int64_t{1} << 20}});
  const bool exact = options.search == "exact" || (options.search == "auto" && n <= options.exact_threshold);
  if (exact) {
    // The contiguous DP's table (two int64 and one int32 per cell) and one candidate per K: at
    // most min(kMaxExactCells, (N + 1)^2) cells (PlanStep refuses a larger table).
    const int64_t cells = std::min<int64_t>(kMaxExactCells, Mul(n + 1, n + 1));
    bytes = Add(bytes, Mul(40, cells));
  }
  return bytes;
}

CallShape TreePartitionCallShape(const SegmentTreeView& tree, int64_t chunk_size, int64_t conv_width,
                                 CancelToken* cancel) {
  ValidateChunkSize(chunk_size);
  std::vector<int32_t> preorder;
  const SegmentForest t = SegmentForestFromTree(tree, &preorder, cancel);
  const int64_t n = tree.num_trajectories;
  std::vector<int64_t> through(tree.num_segments, 0);  // trajectories ending in the subtree
  CallShape s;
  s.trajectories = n;
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) {
    ++through[tree.trajectory_end[i]];
    s.semantic_tokens += t.end[tree.trajectory_end[i]];
    longest = std::max<int64_t>(longest, t.end[tree.trajectory_end[i]]);
  }
  for (auto it = preorder.rbegin(); it != preorder.rend(); ++it) {
    const int32_t u = *it;
    if (t.parent[u] >= 0) through[t.parent[u]] += through[u];
    if (t.num_children(u) >= 2) s.replay_rows = Add(s.replay_rows, Mul(through[u] - 1, t.end[u] % chunk_size));
  }
  s.rows = s.semantic_tokens;
  s.segments = 2 * n;
  s.sequences = n;
  s.roots = n;
  s.state_slots = n;
  s.height = 2 * n;
  s.longest_walk = WalkBound(chunk_size, conv_width, longest);
  return s;
}

CallShape BatchPartitionCallShape(const RolloutBatch& batch, int64_t chunk_size, int64_t conv_width) {
  ValidateChunkSize(chunk_size);
  const SegmentForest& f = batch.forest();
  const int64_t n = batch.num_trajectories();
  CallShape s;
  s.trajectories = n;
  s.semantic_tokens = batch.semantic_tokens();
  for (int64_t v = 0; v < f.size(); ++v)
    if (f.num_children(v) >= 2) s.replay_rows = Add(s.replay_rows, Mul(f.multiplicity[v] - 1, f.end[v] % chunk_size));
  int64_t longest = 0;
  for (const int64_t length : batch.lengths()) longest = std::max(longest, length);
  s.rows = s.semantic_tokens;
  s.segments = 2 * n;
  s.sequences = n;
  s.roots = n;
  s.state_slots = n;
  s.height = 2 * n;
  s.longest_walk = WalkBound(chunk_size, conv_width, longest);
  return s;
}

int64_t PartitionRetainedBytes(const CallShape& sum, int64_t plans, int64_t chunk_size, int64_t conv_width) {
  CallShape empty;
  empty.batch_links = sum.batch_links;
  const int64_t per_plan = CallPlanBytes(empty, chunk_size, conv_width).retained;
  return Add(CallPlanBytes(sum, chunk_size, conv_width).retained, Mul(std::max<int64_t>(plans - 1, 0), per_plan));
}

}  // namespace harts
