// The step planner: microbatch membership, DP-replica assignment and slot schedule for
// one training step (Section 3.2 of the paper, all of it).
//
// Inputs: an ingested RolloutBatch, the DP degree D, the microbatch capacity T in compact
// tokens per rank and the context-parallel degree C (cp_size, default 1). Output: a StepPlan in
// which every trajectory belongs to exactly one non-empty microbatch of at most C x T compact
// tokens (T when C = 1), K mod D = 0, each replica runs
// exactly K / D microbatches, one per slot, and the plan is the best candidate found
// under J of Equation (4) (see replica_assignment.h).
//
// Candidate search (defaults are the paper's parameters):
//   1. natural partition P0 (natural_partition.h) and its count K0;
//      the K range of Equations (7)-(8) (candidate_range.h).
//   2. base candidates:
//        N <= exact_threshold (N0 = 512): the exact contiguous DP (Eq. 9) for every K of
//          the range (contiguous_dp.h); these are never modified;
//        otherwise: up to max_sampled_k (Q_max = 32) sampled K values, each reached by
//          merge/split evolution of P0 (evolution.h).
//   3. the trie-aware greedy candidate: 4 orders x 2 policies, small-microbatch
//      elimination, singleton-split alignment to D, preselected by (K, total work)
//      (greedy.h); kept in the comparison whatever its K.
//   4. refinement (refine = true). The greedy candidate is refined by sparse repair
//      (sparse_repair.h: moves, then swaps, within repair_window H = 8, at most
//      repair_iterations = 4 updates). For N > N0, at most max_anchors (B_ref = 3) anchors
//      are refined, counting the greedy candidate as the first; the others are base
//      candidates: the one with the lowest total work, then the remaining one whose K is
//      closest to the greedy K (K0 without a greedy candidate; ties to the smaller K).
//      A contiguous anchor gets boundary refinement first (refinement.h: window
//      refine_window H = 8, refine_sweeps = 2) and then sparse repair. Refined plans are
//      added as new candidates; the originals stay.
//   +  extension (component_greedy = true, not in the paper): the component-greedy candidate
//      of greedy.h (per-tree greedy partitions packed best-fit decreasing), sparse-repaired
//      like the greedy candidate, outside the anchor budget. It only adds a candidate, so
//      it can never worsen J; component_greedy = false gives the paper's candidate set.
//   +  extension (contiguous_optimum = true, heuristic search only): the least-total-work
//      contiguous partition over every K of the range (contiguous_optimum.h, exact), boundary-
//      refined, and its sparse repair. So the plan's total work is never above the exact
//      contiguous-partition optimum over the range, which sampled evolution may miss; exact
//      search (N <= N0) covers every K of the range already.
//   5. every candidate gets the replica/slot schedule of AssignReplicas; the plan with
//      the lexicographically smallest J wins; ties to the fewer microbatches (each microbatch
//      costs a fixed time beside its work, a sizable part of a GPU microbatch's time:
//      benchmarks/README.md), then to the earlier candidate in the order above
//      (base in ascending K, greedy, component greedy, refined, contiguous optimum).
//      Extension (microbatch_cost = c > 0): candidates are compared by J_c, J with every
//      microbatch's work counted c tokens more: (total + c K, slot-critical + c K / D,
//      max replica + c K / D); the plan still reports its J. c is the fixed time of a
//      microbatch over the time of one compact token (benchmarks/train_eval.py's microbatches
//      section fits both).
// The plan is deterministic: no randomness, every tie broken by a fixed rule.
//
// Context parallelism (cp_size = C > 1): a microbatch is run by C ranks together, each
// holding a contiguous range of about T of its compact rows (cp_split.h splits it). The planner
// then packs exactly as above with the capacity C x T in place of T (every step of the search,
// the K range of Eq. (7)-(8) included); StepPlan.capacity stays T and StepPlan.cp_size is C. A
// rollout tree larger than C x T is split between microbatches as any tree larger than T is
// (its shared prefix computed once per microbatch); a single trajectory (a path) longer than
// C x T is refused. C = 1 gives exactly the plans (and errors) of a planner without CP.
//
// Errors:
//   InvalidArgument     dp_size < 1, capacity < 1, a bad option (field = its name: cp_size
//                       outside [1, kMaxCpSize] of cp_split.h, or capacity x cp_size over
//                       2^62, field "cp_size"), or a trajectory longer than C x T (field
//                       "trajectories[i]", i its index; the message names T and C).
//   FailedPrecondition  N < D (field "dp_size"); K_min > D * floor(N / D), i.e. the batch
//                       needs more microbatches than it has trajectories (field
//                       "capacity"); or no candidate reached a feasible grouping with K a
//                       multiple of D (field "capacity"); the message says why.
//   ResourceExhausted   search = "exact" on a batch whose DP table would exceed
//                       kMaxExactCells cells (field "search").
//   Cancelled           `cancel` was cancelled (field "cancelled") or its deadline passed
//                       (field "deadline"); see below.
//
// Complexity (N trajectories, K microbatches): O(K0 log N) natural partition; exact DP as
// in contiguous_dp.h; O(K0 log K0 + Q_max K) evolution; O(N log N) per greedy plan on any
// tree shape (placement_index.h; at most GreedyStepBudget(N) index steps, greedy.h); O(N H log)
// per repaired anchor plus O(|A| + |B|) H^2 log per update; O(N log S) contiguous optimum;
// O(K log K) per schedule. On one core the planning time grows near-linearly with the trajectory
// count up to about 100k trajectories on every preset (benchmarks/planner_scale.py; the numbers
// are in benchmarks/README.md, "Planner scale").
//
// Cancellation: PlanStep polls `cancel` (cancel.h) in every phase's loops and checks it
// between phases; a cancelled or expired token stops it within milliseconds by throwing
// Cancelled (field "cancelled" or "deadline"). nullptr: never cancelled.
#ifndef HARTS_STEP_PLAN_H_
#define HARTS_STEP_PLAN_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "harts/cancel.h"
#include "harts/replica_assignment.h"
#include "harts/rollout_batch.h"

namespace harts {

inline constexpr int64_t kMaxExactCells = int64_t{1} << 23;

struct PlannerOptions {
  int64_t dp_size = 1;            // D
  int64_t capacity = 65536;       // T, compact tokens per microbatch
  int64_t exact_threshold = 512;  // N0: exact DP when N <= N0 (search = "auto")
  int64_t max_sampled_k = 32;     // Q_max, >= 2
  int64_t refine_window = 8;      // H of boundary refinement
  int64_t refine_sweeps = 2;
  int64_t max_anchors = 3;    // B_ref
  int64_t repair_window = 8;  // H of sparse repair
  int64_t repair_iterations = 4;
  bool greedy = true;              // run the trie-aware greedy path
  bool refine = true;              // boundary refinement and sparse repair
  bool component_greedy = true;    // extension: per-tree greedy candidate (not in the paper)
  bool contiguous_optimum = true;  // extension: least-work contiguous partition over the range
  std::string search = "auto";     // "auto" | "exact" | "heuristic"
  // Extension: a fixed cost of every microbatch in compact-token units, in [0, capacity]; see
  // step 5 above. 0 = the paper's selection (with the tie rule).
  int64_t microbatch_cost = 0;
  // Context-parallel degree C in [1, kMaxCpSize]: microbatches of up to C x capacity compact rows.
  int64_t cp_size = 1;
};

struct CandidateSummary {
  std::string source;  // "exact", "evolved", "greedy:<order>/<policy>", "... +repair", ...
  int64_t k = 0;
  Objective objective;
};

struct StepPlan {
  int64_t dp_size = 0;
  int64_t capacity = 0;  // T per rank: a microbatch holds at most cp_size x capacity compact rows
  int64_t cp_size = 1;   // C
  int64_t num_trajectories = 0;
  // Microbatch m, ordered by (slot, replica): members are the trajectory indices
  // members[member_offsets[m], member_offsets[m + 1]) in lexicographic order.
  std::vector<int64_t> member_offsets;       // K + 1
  std::vector<int32_t> members;              // N
  std::vector<int64_t> work;                 // K, compact work w(M)
  std::vector<int32_t> replica;              // K
  std::vector<int32_t> slot;                 // K
  Objective objective;                       // J (Eq. 4)
  std::string source;                        // source of the selected candidate
  std::string search_mode;                   // "exact" or "heuristic"
  int64_t natural_k = 0;                     // K0
  int64_t k_min = 0, k_max = 0;              // Eq. (7)-(8)
  int64_t compact_tokens = 0;                // G = C(X), a lower bound on objective.total_work
  std::vector<CandidateSummary> candidates;  // in generation order
  int64_t selected = -1;                     // index into candidates
  double planning_seconds = 0;
  std::vector<std::pair<std::string, double>> phase_seconds;

  int64_t num_microbatches() const { return static_cast<int64_t>(work.size()); }
};

// Validates options (InvalidArgument naming the option).
void ValidatePlannerOptions(const PlannerOptions& options);

// Throws InvalidArgument("trajectories[i]", ...) for the first trajectory i longer than
// cp_size x capacity (the message names T, and C when C > 1). Precondition: capacity >= 1,
// 1 <= cp_size and capacity x cp_size fits int64 (ValidatePlannerOptions). O(N).
void CheckTrajectoriesFit(const RolloutBatch& batch, int64_t capacity, int64_t cp_size = 1);

StepPlan PlanStep(const RolloutBatch& batch, const PlannerOptions& options, CancelToken* cancel = nullptr);

}  // namespace harts

#endif  // HARTS_STEP_PLAN_H_
