// Minimum-call planning for chunkwise linear attention (Section 3.3, Equations 11-15 and
// Algorithm 1 of the paper).
//
// Glossary
//   B            chunk size of the linear-attention backend, 1 <= B <= kMaxChunkSize.
//   a(p)         resume anchor of position p: B * floor(p / B) (Equation 2). Positions are
//                absolute 0-based positions in a trajectory.
//   segment v    [s_v, e_v) of a segment forest (segment_forest.h); a_v = a(s_v) is its entry
//                anchor, b_v = a(e_v) its exit anchor. S_p is the recurrent state at
//                position p (before the token at p) on the path through v.
//   same chunk   e_v < a_v + B (Equation 11, strict): v creates no new boundary state.
//   T_pre(v)     minimum rounds for the subtree of v when S_{a_v} exists before the round in
//                which v runs (Equations 12, 14).
//   T_in(v)      minimum rounds when v is entered as its parent's direct continuation, so its
//                entry state only exists inside the current call (Equations 12, 13).
//   sequence q   one packed input of a call: a chain of segments v_1 -> v_2 -> ... where each
//                v_{i+1} is the direct continuation of v_i (the first is the head, the last a
//                leaf). It starts from S_{b_q}, b_q = a(s_head), replays [b_q, s_head) (rows
//                of ancestors: state updates, no outputs), then outputs its own rows.
//   round        one packed varlen call; rounds are numbered 0, 1, ... (the paper's Call 1,
//                Call 2, ...). A state produced in round r is usable from round r + 1 on.
//   state slot   one boundary state S_b that some later sequence starts from. It is returned
//                by exactly one producer sequence (the one that outputs the row at position
//                b - 1 on the path) and may be consumed by several sequences.
//   R            mandatory replay (Equation 15): sum over internal v of
//                (|ch(v)| - 1) * (e_v mod B); it does not depend on the direct choices.
//
// The planner solves every tree of the forest separately (each root starts from the zero
// state in round 0) and merges their sequences by round; the call count is the maximum over
// the trees. Unary segments (a trajectory ends where another continues) leave T_pre/T_in
// unchanged: contracting v with its only child gives the same values.
#ifndef HARTS_MIN_CALL_H_
#define HARTS_MIN_CALL_H_

#include <cstdint>
#include <vector>

#include "harts/segment_forest.h"

namespace harts {

inline constexpr int64_t kMaxChunkSize = int64_t{1} << 20;

// Throws InvalidArgument("chunk_size") unless 1 <= chunk_size <= kMaxChunkSize.
void ValidateChunkSize(int64_t chunk_size);

// a(p) = B * floor(p / B) for p >= 0.
inline int64_t Anchor(int64_t p, int64_t chunk_size) { return p - p % chunk_size; }

// Builds a segment forest from per-segment arrays (the "already compacted segment tree" input
// of the sidecar). Segment ids are kept; children are ordered by increasing id (this fixes
// the child order of Algorithm 1); compact rows are numbered in DFS preorder, so segment v
// holds rows [row_begin_v, row_begin_v + e_v - s_v). Only the topology fields (start, end,
// parent, child CSR, roots, row_begin, num_rows) are filled; the trajectory fields are empty.
// Preconditions (InvalidArgument naming "parent[i]", "start[i]" or "end[i]"): n >= 1;
// -1 <= parent[v] < n, no cycles; 0 <= start[v] < end[v]; a root starts at 0; a child starts
// where its parent ends. ResourceExhausted when the rows or positions overflow int32.
// O(n) time and space.
SegmentForest SegmentForestFromArrays(const int32_t* parent, const int32_t* start, const int32_t* end, int64_t n);

// T_pre and T_in of every segment (Equations 12-14). O(|V| + |E|).
struct MinCallCounts {
  std::vector<int32_t> t_pre;
  std::vector<int32_t> t_in;
};
MinCallCounts ComputeMinCallCounts(const SegmentForest& forest, int64_t chunk_size);

// Mandatory replay R of Equation (15). O(|V|).
int64_t MandatoryReplay(const SegmentForest& forest, int64_t chunk_size);

// The recovered plan. Sequences are numbered by (round, head segment id); for a forest from
// BuildSegmentForest head ids are in lexicographic preorder, so this order is deterministic
// and follows the trie. All ranges are half-open.
struct MinCallPlan {
  int64_t chunk_size = 0;
  int32_t num_calls = 0;      // rounds: max over trees of T_pre(root)
  int64_t replay_tokens = 0;  // R (Equation 15) = sum over sequences of s_head - b
  int64_t own_tokens = 0;     // sum of segment lengths (= rows of the forest)

  // Per segment v.
  std::vector<int32_t> t_pre, t_in;
  std::vector<int32_t> direct_child;      // the chosen direct continuation, -1 for a leaf
  std::vector<int32_t> segment_sequence;  // the sequence that outputs v's rows

  // Rounds: the sequences of round r are [round_offsets[r], round_offsets[r + 1]).
  std::vector<int32_t> round_offsets;  // num_calls + 1

  // Per sequence q.
  std::vector<int32_t> sequence_round;
  std::vector<int32_t> chain_offsets;    // CSR: chain of q = chain[chain_offsets[q], ...[q+1])
  std::vector<int32_t> chain;            // segment ids, head first (size |V|)
  std::vector<int32_t> sequence_anchor;  // b_q = a(s_head): position of the initial state
  std::vector<int32_t> sequence_start;   // s_head: replay is [b_q, s_head)
  std::vector<int32_t> sequence_end;     // e of the chain's leaf
  std::vector<int32_t> sequence_slot;    // consumed state slot, -1 = zero state (b_q = 0)
  std::vector<int32_t> request_offsets;  // CSR: states q must return, by increasing position
  std::vector<int32_t> request_slot;     //   request_slot[request_offsets[q], ...[q+1])

  // Per state slot k: S_{slot_position[k]} returned by sequence slot_producer[k] (whose own
  // rows contain position slot_position[k] - 1). Slots are numbered by (producer, position).
  std::vector<int32_t> slot_producer;
  std::vector<int32_t> slot_position;
  std::vector<int32_t> slot_segment;  // the producer's segment holding position - 1

  int64_t num_sequences() const { return static_cast<int64_t>(sequence_round.size()); }
  int64_t num_slots() const { return static_cast<int64_t>(slot_producer.size()); }
};

// Algorithm 1: the counting pass, then recovery (first child in child order that fits its
// continuation budget and covers every child over the side budget; side branches in the
// earliest legal round). Deterministic. O(|V| + |E|) time, O(|V|) space, no recursion.
// Precondition: chunk_size validated; forest non-empty.
MinCallPlan PlanMinCalls(const SegmentForest& forest, int64_t chunk_size);

}  // namespace harts

#endif  // HARTS_MIN_CALL_H_
