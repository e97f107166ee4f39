// The compact physical layout of one microbatch and the index arrays a runtime needs to run
// its linear-attention rounds without re-planning (Section 4.2 of the paper, "Compact
// physical ordering" and "KDA state reuse and causal convolution").
//
// Glossary (see min_call.h for segments, sequences, rounds and state slots)
//   row            a compact row of the microbatch: one unique token prefix of its
//                  trajectories, numbered as the forest's rows (row_begin, lexicographic
//                  preorder for a forest from BuildSegmentForest).
//   physical row   the row's place in the physical order shared by every layer: the own
//                  (non-replay) rows of a sequence are contiguous and in position order, the
//                  sequences of a round are adjacent and in sequence order, rounds in order.
//   packed input   round r's varlen call input: for each of its sequences, its replay rows
//                  (ancestor rows at positions [b_q, s_head)) followed by its own rows.
//                  cu_seqlens counts both; gather_index names the physical row each packed
//                  row reads (a replay row reads its ancestor's physical row).
//   chunk index    a sequence starts at the chunk boundary b_q, so S_p with p a multiple of
//                  B is its chunk boundary (p - b_q) / B.
//   conv context   for a causal convolution of width w, the w - 1 true-ancestor rows before
//                  a sequence (oldest first, -1 where the position would be negative), never
//                  an adjacent packed sequence. `packed` context precedes the first packed
//                  row (positions [b_q - w + 1, b_q)); `own` context precedes the first own
//                  row (positions [s_head - w + 1, s_head)), for a runtime that convolves
//                  only its own rows and gathers replay rows after the convolution.
//
// Limits: every round's packed rows must fit int32 (cu_seqlens); ResourceExhausted otherwise.
// PlanMicrobatch and PlanSegmentForest also refuse, before laying anything out, a plan whose
// allocations (CallPlanBytes of plan_cost.h, an upper bound) exceed MaxPlanBytes():
// ResourceExhausted naming "trajectories" (the microbatch) or "end" (a bare forest's rows).
//
// Cancellation: every function here takes a trailing `cancel` (cancel.h; may be null), polls it
// once per segment and sequence and once per block of rows, and throws Cancelled when it fires.
#ifndef HARTS_CALL_LAYOUT_H_
#define HARTS_CALL_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"
#include "harts/min_call.h"
#include "harts/rollout_batch.h"
#include "harts/segment_forest.h"

namespace harts {

inline constexpr int64_t kMaxConvWidth = 1024;

// Throws InvalidArgument("conv_width", "must be in [1, kMaxConvWidth], got ...") unless
// 1 <= conv_width <= kMaxConvWidth.
void ValidateConvWidth(int64_t conv_width);

struct CallLayout {
  int32_t conv_width = 0;

  // Physical order, C = forest.num_rows entries each.
  std::vector<int32_t> physical_to_row;  // row at each physical row
  std::vector<int32_t> row_to_physical;  // inverse permutation
  std::vector<int32_t> position_ids;     // absolute trajectory position of each physical row

  std::vector<int32_t> segment_physical_begin;  // [V] first physical row of each segment
  std::vector<int32_t> sequence_offsets;        // [Q + 1] own rows of q: [offsets[q], offsets[q+1])
  std::vector<int32_t> round_offsets;           // [K + 1] physical rows of round r

  // Packed inputs of all rounds, concatenated; round r is [packed_offsets[r], packed_offsets[r+1]).
  std::vector<int64_t> packed_offsets;     // [K + 1]
  std::vector<int32_t> gather_index;       // physical row read by each packed row
  std::vector<int32_t> packed_output_row;  // physical row written, -1 for a replay row
  // cu_seqlens of round r (n_r + 1 entries starting at 0, counting replay rows) is
  //   cu_seqlens[cu_offsets[r], cu_offsets[r + 1]), where cu_offsets[r] = plan.round_offsets[r] + r.
  std::vector<int32_t> cu_offsets;  // [K + 1]
  std::vector<int32_t> cu_seqlens;  // [Q + K]

  // Per state request (sorted by sequence, then position; one per slot).
  std::vector<int32_t> request_sequence;
  std::vector<int32_t> request_position;
  std::vector<int32_t> request_chunk;  // chunk index in the producer's packed sequence
  std::vector<int32_t> request_slot;
  // Per sequence: s_head - b_q, the replay rows at the start of its packed input.
  std::vector<int32_t> sequence_replay_length;

  // [Q * (w - 1)] row-major per sequence, oldest first.
  std::vector<int32_t> conv_context;      // before the first packed row
  std::vector<int32_t> own_conv_context;  // before the first own row
};

// Builds the layout of `plan` over `forest`. O(C + R + Q * w) time and space.
CallLayout BuildCallLayout(const SegmentForest& forest, const MinCallPlan& plan, int64_t conv_width,
                           CancelToken* cancel = nullptr);

// A complete plan for one microbatch: its segment forest, the min-call plan, the layout, and
// the links back to the batch.
struct MicrobatchCallPlan {
  SegmentForest forest;
  MinCallPlan plan;
  CallLayout layout;
  // Links to the batch (empty for a plan built from a bare segment forest).
  std::vector<int32_t> trajectories;          // [k] trajectory ids, in the caller's order
  std::vector<int32_t> row_to_global;         // [C] batch compact row of each microbatch row
  std::vector<int32_t> physical_to_global;    // [C] batch compact row of each physical row
  std::vector<int64_t> semantic_offsets;      // [k + 1] prefix sums of the trajectories' lengths
  std::vector<int32_t> semantic_to_physical;  // physical row of position p of trajectories[j]
                                              // at semantic_offsets[j] + p
};

// Plans the microbatch made of trajectories ids[0, k) of `batch` (all of them when
// ids == nullptr). Errors: InvalidArgument "trajectories" (empty, out of range, repeated),
// "chunk_size", "conv_width"; ResourceExhausted for int32 overflow of packed rows ("chunk_size")
// and for a plan over MaxPlanBytes() ("trajectories"); Cancelled.
// O(k log k + C + R + S_M + |V| * w) for the microbatch's C rows, R replay rows and S_M semantic
// positions, beyond the batch's own index: nothing of size O(batch) is read or built (in
// particular not the batch's per-row arrays, which a batch from FromSegmentTree builds lazily).
MicrobatchCallPlan PlanMicrobatch(const RolloutBatch& batch, const int32_t* ids, int64_t k, int64_t chunk_size,
                                  int64_t conv_width, CancelToken* cancel = nullptr);

// Plans a bare segment forest (a topology from segment_tree.h, e.g. SegmentForestFromArrays).
// Errors: InvalidArgument "chunk_size", "conv_width"; ResourceExhausted "chunk_size" when a
// round packs more than int32 rows, "end" for a plan over MaxPlanBytes(); Cancelled.
// O(|V| + C + R + |V| * w).
MicrobatchCallPlan PlanSegmentForest(SegmentForest forest, int64_t chunk_size, int64_t conv_width,
                                     CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_CALL_LAYOUT_H_
