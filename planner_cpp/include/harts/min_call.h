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

#include "harts/cancel.h"
#include "harts/segment_forest.h"

namespace harts {

inline constexpr int64_t kMaxChunkSize = int64_t{1} << 20;

// Throws InvalidArgument("chunk_size", "must be in [1, kMaxChunkSize], got ...") unless
// 1 <= chunk_size <= kMaxChunkSize.
void ValidateChunkSize(int64_t chunk_size);

// The segments of `forest`, every parent before its children: the ids themselves when every
// parent id is smaller than its child's (a preorder numbering, as BuildSegmentForest gives),
// otherwise breadth first from the roots. Precondition: acyclic, topology filled. O(|V|).
std::vector<int32_t> ParentsFirstOrder(const SegmentForest& forest, CancelToken* cancel = nullptr);

// a(p) = B * floor(p / B) for p >= 0.
inline int64_t Anchor(int64_t p, int64_t chunk_size) { return p - p % chunk_size; }

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

// Algorithm 1 in three phases; PlanMinCalls composes them. Each phase visits every segment
// and edge a constant number of times, parents first or children first, without recursion.
// Preconditions of all three: chunk_size validated (ValidateChunkSize); the forest non-empty
// and acyclic with its topology filled (start, end, parent, child CSR, roots: a forest from
// BuildSegmentForest or segment_tree.h); each phase's input made by the phase before it from
// the same forest and chunk size. Each phase takes a trailing `cancel` (cancel.h; may be null),
// polls it once per segment and throws Cancelled when it fires (nothing is returned then).

// Phase 1, counting (Algorithm 1, lines 1-7): T_pre and T_in of every segment, children
// before parents (Equations 12-14). O(|V| + |E|) time, O(|V|) space.
struct MinCallCounts {
  std::vector<int32_t> t_pre;  // [V]
  std::vector<int32_t> t_in;   // [V]
};
MinCallCounts ComputeMinCallCounts(const SegmentForest& forest, int64_t chunk_size, CancelToken* cancel = nullptr);

// Phase 2, recovery of the direct continuations (lines 8-21). Parents first, a segment v
// receives (ready, budget K_round, round r) from its parent (a root: ready, T_pre(root),
// round 0); an internal v with same = ready and e_v < a_v + B picks as direct continuation
// the first child o in child order with H[o] <= K_round (H = T_pre if same, else T_in) that
// leaves no other child over the side budget K_side = K_round - [not same]. o inherits
// (same, K_round, r); every other child heads a new sequence with (ready, K_side, r + [not
// same]). A sequence's chain is its head followed by direct continuations down to a leaf.
// O(|V| + |E|) time, O(|V|) space. Throws std::logic_error if no child qualifies, which
// counts from phase 1 rule out.
struct MinCallRecovery {
  int32_t num_calls = 0;              // rounds: max over roots of T_pre(root)
  std::vector<int32_t> direct_child;  // [V] the chosen direct continuation, -1 for a leaf
  std::vector<int32_t> round;         // [V] round of the sequence whose chain holds v
};
MinCallRecovery RecoverContinuations(const SegmentForest& forest, int64_t chunk_size, const MinCallCounts& counts,
                                     CancelToken* cancel = nullptr);

// Phase 3, sequences and state slots (line 22 and the state handoffs). The heads (the roots
// and every child that is not its parent's direct continuation) become the sequences,
// numbered by (round, head id), each with its chain, anchor b_q = a(s_head) and replay
// [b_q, s_head). A head with b_q > 0 consumes S_{b_q}, returned by the sequence that outputs
// the segment P holding position b_q - 1 of its path (then b_q = a(e_P)). All consumers of
// one P need that same state, so there is one slot per producing segment, numbered by
// (producer, position). The counts and the recovery move into the plan. O(|V|) time and
// space.
MinCallPlan AssignSequences(const SegmentForest& forest, int64_t chunk_size, MinCallCounts counts,
                            MinCallRecovery recovery, CancelToken* cancel = nullptr);

// Algorithm 1: AssignSequences(RecoverContinuations(ComputeMinCallCounts(...))). The plan
// takes the first child in child order that fits its continuation budget and covers every
// child over the side budget, and launches side branches in the earliest legal round.
// Deterministic. O(|V| + |E|) time, O(|V|) space, no recursion. Preconditions as above.
MinCallPlan PlanMinCalls(const SegmentForest& forest, int64_t chunk_size, CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_MIN_CALL_H_
