// Context-parallel split of one microbatch: its compact rows divided between C ranks
// as C contiguous row ranges, balanced under a cost model, on the chunk grid, with the boundary
// states (and the ancestor rows) every rank needs from the ranks before it.
//
// Glossary (see segment_forest.h, min_call.h and call_layout.h)
//   row x        a compact row of the microbatch, numbered as the microbatch's segment forest
//                numbers them (lexicographic DFS preorder; the rows of a CallPlan of the same
//                trajectories, whose row_to_global maps them to batch rows). C_M rows.
//   pos(x)       the absolute position of row x on its path (its depth); row x is position
//                pos(x) of segment seg(x), and its path predecessor pred(x) is row x - 1 when
//                pos(x) > start of seg(x), else the last row of the parent segment (none for a
//                root row). Every ancestor of x has a smaller row number.
//   C            cp_size, the ranks of one microbatch, 1 <= C <= kMaxCpSize.
//   B            chunk_size, the linear-attention chunk; a(p) = B floor(p / B) (min_call.h).
//   split        cuts 0 = cut_0 <= cut_1 <= ... <= cut_C = C_M; rank r holds rows
//                [cut_r, cut_{r+1}) (possibly none: a microbatch with fewer legal cuts than
//                ranks leaves the last ranks empty).
//
// The chunk-grid rule. An interior cut x (0 < x < C_M) is legal iff pos(x) is a multiple of B.
// So a cut inside a path always falls on a chunk boundary of that path (the state handed on is a
// chunk-boundary state S_{pos(x)} the chunk kernel produces anyway, and no chunk is split
// between ranks); a cut before a root row (pos 0) is always legal; a cut before the first row
// of a forked segment is legal only when the fork position is on the grid. Each rank's pieces
// therefore start at grid positions (or are fork heads, which start at their anchor as in one
// process), so the ranks' local chunk partitions are exactly the one-process partition.
//
// The cost model (integers, so the split is exact and the same on every machine). Row x costs
//   cost(x) = linear_cost + attention_cost * (pos(x) + 1):
// linear_cost for everything linear in the rows (projections, MLP / experts, KDA / GDN chunk
// work, short convolutions), attention_cost per (query, key) pair of causal attention, a row at
// position p attending to its p + 1 ancestors-and-self on its path. A path of L rows thus costs
// linear_cost L + attention_cost L (L + 1) / 2: linear attention counts linearly, attention
// quadratically along the path. A rank's cost is the sum over its rows (replayed and halo rows
// are not counted). Defaults: linear_cost = 8192, attention_cost = 1 (attention's pair work
// matches a row's linear work at a context of 8192 rows: about a hybrid with one attention
// layer in four at a hidden size near 2k; set both from measured per-token and per-pair
// times). Limits: both in [0, kMaxCpCost], not both 0; the microbatch's total cost must stay
// below 2^62 (ResourceExhausted "attention_cost" otherwise).
//
// The balance. The split minimizes the largest rank cost over all legal splits (exactly:
// a binary search on the bound with a greedy feasibility test, which is exact for contiguous
// splits of non-negative costs); among the splits that reach it, the one whose cuts are each
// as far right as possible (cut_1 largest, then cut_2, ...). So max_cost equals the best max
// rank cost of any legal split (the brute-force optimum), and no rank exceeds
// ceil(total / C) + the cost of the most expensive run of rows between two consecutive legal cuts.
//
// Boundary states and halos. A row x of rank r enters from outside when pred(x) exists and
// lives on an earlier rank; this happens only at x = cut_r (a path cut on the grid, or a fork
// head at a grid position) and at the first row of a segment whose parent's last row lies on an
// earlier rank (a fork from any earlier rank). The entering rows of rank r are grouped by their
// predecessor row u (all children of one segment share it): one *receive* (r, u). With
// s = pos(u) + 1 and a = a(s), the rank starts those rows from the state S_a of u's path (the
// zero state when a = 0), replays the rows at positions [a, s) of u's path (s - a < B rows;
// none for a grid cut), and reads the w - 1 rows at positions [a - w + 1, a) as the short
// convolution's context (-1 below position 0), exactly as one process's packed sequence does
// (call_layout.h: replay and conv context). S_a is the state after the row at position a - 1 of
// u's path, its *state row*; it is produced by the rank that holds that row, always an earlier
// rank than r (it is an ancestor of u). Distinct state rows are the split's *states*, numbered
// by state row, so by producing rank; each state lists the ranks it is handed to. Replay and
// conv rows live on earlier ranks too (their ranks follow from the cuts).
//
// Complexity: O(V + C_M / B + k log k) beyond ingestion for k trajectories of V segments,
// plus O(log(total cost) C log(C_M / B)) for the search and O(B + w) per receive; memory
// O(V + C_M / B) (the legal cuts) plus the output, no per-row array (the microbatch of a 1M-token
// path at B = 64 has 16k legal cuts). Cancellation: the functions poll `cancel` (cancel.h; may
// be null) once per segment, block of legal cuts, search step and receive, and throw Cancelled
// when it fires.
#ifndef HARTS_CP_SPLIT_H_
#define HARTS_CP_SPLIT_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"
#include "harts/rollout_batch.h"
#include "harts/segment_forest.h"

namespace harts {

inline constexpr int64_t kMaxCpSize = 1024;
inline constexpr int64_t kMaxCpCost = int64_t{1} << 20;
// The most compact rows one CP microbatch may hold (cp_size x capacity, step_plan.h).
inline constexpr int64_t kMaxCpRows = int64_t{1} << 62;

struct CpSplitOptions {
  int64_t cp_size = 1;      // C
  int64_t chunk_size = 64;  // B
  int64_t conv_width = 4;   // w
  int64_t linear_cost = 8192;
  int64_t attention_cost = 1;
};

// Throws InvalidArgument naming the option: cp_size outside [1, kMaxCpSize], chunk_size
// (ValidateChunkSize), conv_width (ValidateConvWidth), linear_cost or attention_cost outside
// [0, kMaxCpCost], or both 0 (field "linear_cost").
void ValidateCpSplitOptions(const CpSplitOptions& options);

struct CpSplit {
  int64_t cp_size = 0, chunk_size = 0, conv_width = 0, linear_cost = 0, attention_cost = 0;
  int64_t num_rows = 0;    // C_M
  int64_t total_cost = 0;  // sum of the row costs
  int64_t max_cost = 0;    // the largest rank cost (the minimum over legal splits)

  // Per rank r in [0, C).
  std::vector<int64_t> rank_row_offsets;  // [C + 1] the cuts: rank r holds [offsets[r], offsets[r + 1])
  std::vector<int64_t> rank_cost;         // [C]
  std::vector<int32_t> receive_offsets;   // [C + 1] CSR: receives of rank r, by predecessor row
  std::vector<int32_t> send_offsets;      // [C + 1] CSR: states produced by rank r

  // Per receive i (rank receive_rank[i] enters rows below predecessor row receive_row[i]).
  std::vector<int32_t> receive_rank;
  std::vector<int32_t> receive_row;             // u, on an earlier rank
  std::vector<int32_t> receive_anchor;          // a = a(pos(u) + 1)
  std::vector<int32_t> receive_state;           // the state S_a, -1 for the zero state (a = 0)
  std::vector<int32_t> receive_replay_offsets;  // [R + 1] CSR into replay_rows
  std::vector<int32_t> replay_rows;             // rows at positions [a, pos(u) + 1), in order
  std::vector<int32_t> receive_conv_context;    // [R * (w - 1)] positions [a - w + 1, a), -1 below 0
  std::vector<int32_t> receive_entry_offsets;   // [R + 1] CSR into entry_rows
  std::vector<int32_t> entry_rows;              // rows of the rank whose predecessor is u, ascending

  // Per state k (states in increasing state row, hence by producing rank).
  std::vector<int32_t> state_row;               // the row after which S_position holds
  std::vector<int32_t> state_position;          // a multiple of B, >= B
  std::vector<int32_t> state_rank;              // the producing rank (holds state_row)
  std::vector<int32_t> state_consumer_offsets;  // [P + 1] CSR into state_consumer_rank
  std::vector<int32_t> state_consumer_rank;     // ranks receiving the state, ascending

  int64_t num_receives() const { return static_cast<int64_t>(receive_rank.size()); }
  int64_t num_states() const { return static_cast<int64_t>(state_row.size()); }
};

// Splits the microbatch of `forest` (a forest from BuildSegmentForest: preorder ids, row_begin
// along the preorder, topology filled; non-empty). Options validated here. Errors: as
// ValidateCpSplitOptions; ResourceExhausted "attention_cost" for a total cost over 2^62;
// Cancelled.
CpSplit SplitForest(const SegmentForest& forest, const CpSplitOptions& options, CancelToken* cancel = nullptr);

// Splits the microbatch of trajectories ids[0, k) of `batch` (every trajectory when ids is
// null); its rows are numbered as PlanMicrobatch numbers them (call_layout.h). Errors: as
// SplitForest, and InvalidArgument "trajectories" (empty, out of range, repeated).
CpSplit PlanCpSplit(const RolloutBatch& batch, const int32_t* ids, int64_t k, const CpSplitOptions& options,
                    CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_CP_SPLIT_H_
