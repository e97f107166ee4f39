// Cost before work: the rows, memory and sizes a plan will need, computed from the request alone
// (segment lengths, trajectory counts, options) without planning, so that a caller (the sidecar)
// can refuse what it cannot afford before it starts, and the planner itself can refuse an
// allocation it cannot afford instead of running out of memory.
//
// Glossary (min_call.h, call_layout.h)
//   call shape   the sizes of one call plan's arrays: k trajectories, S_M semantic positions, V
//                segments of the microbatch's forest, C compact rows, R replay rows (Equation 15),
//                Q sequences, the trees (roots), the longest root-to-leaf path in segments
//                (height), and the longest replay walk of a sequence.
//   exact        a shape whose C, R, V, Q, roots, S_M and height are the plan's own. Then the
//                rounds K <= height and the state slots P <= Q - roots are bounds (T_pre of a
//                segment never exceeds its height; every slot has a non-root consumer).
//   bound        a shape whose every size is an upper bound (a token batch not yet ingested:
//                C <= S_M, V <= 2k, R <= (k - 1) * min(B - 1, longest - 1), ...).
//
// Shapes of one call plan (PlanMicrobatch of ids[0, k), all trajectories when ids is null;
// PlanSegmentForest):
//   TreeCallShape    a length-form tree (segment_tree.h): validates the tree and the ids, then
//                    walks each trajectory up to the first segment already seen. Exact.
//                    O(V + N + k) time and space.
//   BatchCallShape   an ingested RolloutBatch: the microbatch's ranks and adjacent LCPs, as
//                    PlanMicrobatch reads them, through one stack pass that counts the nodes
//                    BuildSegmentForest would make. Exact. O(k log k); nothing of size O(batch).
//   ForestCallShape  a segment forest as PlanSegmentForest plans it (ids kept, unary segments
//                    kept). Exact. O(V).
//   TokenCallShape   trajectory lengths only (offsets of a token batch). Bound. O(N + k).
// The exact shapes agree with each other and with the plan (tested).
//
// Bytes (upper bounds; each counts every allocation of the step, freed or not, so it also
// bounds the step's peak):
//   CallPlanBytes    PlanMicrobatch / PlanSegmentForest: `retained`, the returned plan's
//                    arrays, and `scratch`, everything else it allocates. A caller that keeps
//                    several plans peaks below the sum of their retained bytes plus the largest
//                    scratch.
//   TreeIngestBytes  RolloutBatch::FromSegmentTree (the per-row arrays not included).
//   TokenIngestBytes RolloutBatch::Ingest, the per-row arrays included.
//   RowArraysBytes   the per-row arrays a FromSegmentTree batch builds on first use.
//   StepPlanBytes    PlanStep (step_plan.h), from N, the batch's segments and the options: a
//                    bound calibrated on the current step planner (tested against it on random
//                    batches over the options that size its candidates: max_sampled_k, the
//                    windows, the search mode), not derived from its code.
// Every formula is a sum of per-element sizes; arithmetic saturates at kMaxCost so that no
// request can overflow it.
//
// The backstop. PlanMicrobatch and PlanSegmentForest compute CallPlanBytes of the forest they
// are about to plan and throw ResourceExhausted when it exceeds MaxPlanBytes() (process-wide,
// default kDefaultMaxPlanBytes, set by SetMaxPlanBytes), before laying out a single row; a
// RolloutBatch refuses its per-row arrays (RowArraysBytes) the same way (rollout_batch.h).
#ifndef HARTS_PLAN_COST_H_
#define HARTS_PLAN_COST_H_

#include <cstdint>

#include "harts/cancel.h"
#include "harts/rollout_batch.h"
#include "harts/segment_forest.h"
#include "harts/segment_tree.h"
#include "harts/step_plan.h"

namespace harts {

// Saturation value of every cost (2^62): far above any machine, far below int64 overflow.
inline constexpr int64_t kMaxCost = int64_t{1} << 62;
// Default of MaxPlanBytes(): 16 GiB.
inline constexpr int64_t kDefaultMaxPlanBytes = int64_t{16} << 30;

// The most bytes one call plan may allocate (CallPlanBytes, retained + scratch). Thread-safe.
int64_t MaxPlanBytes();
// Sets MaxPlanBytes(); throws InvalidArgument("max_plan_bytes") unless bytes >= 1. Returns the
// previous value. Thread-safe; plans already past their check are not affected.
int64_t SetMaxPlanBytes(int64_t bytes);

struct CallShape {
  int64_t trajectories = 0;                  // k
  int64_t semantic_tokens = 0;               // S_M: semantic_to_physical entries
  int64_t segments = 0;                      // V of the microbatch's forest
  int64_t rows = 0;                          // C
  int64_t replay_rows = 0;                   // R
  int64_t sequences = 0;                     // Q (= leaves of the forest)
  int64_t roots = 0;                         // trees of the microbatch
  int64_t height = 0;                        // most segments on one root-to-leaf path; rounds K <= height
  int64_t state_slots = 0;                   // a bound on P (Q - roots for an exact shape)
  int64_t longest_walk = 0;                  // max over sequences of s_head - max(0, b_q - w + 1) (a bound)
  bool exact = false;                        // C, R, V, Q, roots, S_M, height are the plan's own
  bool batch_links = true;                   // PlanMicrobatch (forest built, links to the batch); false for
                                             // PlanSegmentForest
  int64_t rounds() const { return height; }  // a bound on K
  int64_t packed_rows() const { return rows + replay_rows; }  // C + R
};

// Throws InvalidArgument naming "trajectories[j]" for an id outside [0, n) and "trajectories" for
// a repeated one or an empty list (ids non-null, k == 0), as PlanMicrobatch does. O(n + k).
void CheckMicrobatchIds(const int32_t* ids, int64_t k, int64_t n);

// Validates `tree` (segment_tree.h; errors as SegmentForestFromTree) and the ids
// (CheckMicrobatchIds), then the exact shape of the call plan of ids[0, k) (all trajectories when
// ids is null). `canonical_segments`, when non-null, receives the segments of the whole batch's
// canonical forest (RolloutBatch::forest().size()). O(V + N + k).
CallShape TreeCallShape(const SegmentTreeView& tree, const int32_t* ids, int64_t k, int64_t chunk_size,
                        int64_t conv_width, int64_t* canonical_segments = nullptr, CancelToken* cancel = nullptr);
// The exact shape of PlanMicrobatch(batch, ids, k, ...). Errors as PlanMicrobatch's for the ids.
// O(k log k).
CallShape BatchCallShape(const RolloutBatch& batch, const int32_t* ids, int64_t k, int64_t chunk_size,
                         int64_t conv_width, CancelToken* cancel = nullptr);
// The exact shape of the plan of `forest` (PlanSegmentForest; trajectories and semantic_tokens
// are 0, batch_links false). Preconditions as PlanMinCalls. O(V).
CallShape ForestCallShape(const SegmentForest& forest, int64_t chunk_size, int64_t conv_width);
// Checks the offsets of a token batch (InvalidArgument / ResourceExhausted as
// ValidateTrajectories, without reading the tokens) and the ids, then a bound on the shape of
// the call plan of ids[0, k). O(N + k).
CallShape TokenCallShape(int64_t num_tokens, const int64_t* offsets, int64_t num_offsets, const int32_t* ids, int64_t k,
                         int64_t chunk_size, int64_t conv_width);

struct CallBytes {
  int64_t retained = 0;  // the arrays of the returned MicrobatchCallPlan
  int64_t scratch = 0;   // every other allocation of the call
  int64_t total() const;
};
// Upper bound on the allocations of PlanMicrobatch / PlanSegmentForest for `shape` (a bound
// shape gives a bound). `chunk_size` and `conv_width` valid. O(1).
CallBytes CallPlanBytes(const CallShape& shape, int64_t chunk_size, int64_t conv_width);

// Throws ResourceExhausted(field, ...) when CallPlanBytes(shape).total() > MaxPlanBytes(); the
// message gives the bytes, rows and replay rows needed and the limit. O(1).
void CheckCallPlanBudget(const CallShape& shape, int64_t chunk_size, int64_t conv_width, const char* field);

// Upper bounds on ingestion. V input segments, N trajectories, S semantic tokens, C compact rows
// (a bound: C <= S), V' the canonical forest's segments (a bound: V' <= 2N). O(1).
int64_t TreeIngestBytes(int64_t segments, int64_t trajectories, int64_t canonical_segments);
int64_t TokenIngestBytes(int64_t trajectories, int64_t semantic_tokens, int64_t compact_rows,
                         int64_t canonical_segments);
int64_t RowArraysBytes(int64_t semantic_tokens, int64_t compact_rows);

// Upper bound on the allocations of PlanStep(batch, options) for a batch of N trajectories whose
// forest has V' segments (options validated as ValidatePlannerOptions). O(1).
int64_t StepPlanBytes(int64_t trajectories, int64_t canonical_segments, const PlannerOptions& options);

// Sums over the call plans of any partition of a batch into microbatches (PlanStep's call
// plans): C <= S, R <= sum over forks u of (trajectories through u - 1) * (e_u mod B), V <= 2N,
// Q <= N, ... ; exact is false, batch_links true. From a validated tree; O(V + N).
CallShape TreePartitionCallShape(const SegmentTreeView& tree, int64_t chunk_size, int64_t conv_width,
                                 CancelToken* cancel = nullptr);
// The same for an ingested batch (its forest). O(V').
CallShape BatchPartitionCallShape(const RolloutBatch& batch, int64_t chunk_size, int64_t conv_width);
// Upper bound on the retained bytes of the call plans of a partition into at most `plans`
// microbatches whose shapes sum to `sum` (CallPlanBytes is affine in the sizes: its constant
// part is counted once per plan). O(1).
int64_t PartitionRetainedBytes(const CallShape& sum, int64_t plans, int64_t chunk_size, int64_t conv_width);

}  // namespace harts

#endif  // HARTS_PLAN_COST_H_
