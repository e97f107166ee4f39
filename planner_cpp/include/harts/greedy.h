// Scale-independent trie-aware greedy (Section 3.2, Eq. 10).
//
// Builds groupings directly from the trajectories, without a fixed K. Each trajectory,
// taken in a processing order, goes into an existing microbatch that can hold it
// (work + dC <= T, dC by Eq. 10), chosen by a placement policy, or into a new one.
//
// Processing orders (GreedyOrder):
//   kLexAscending    ascending rank.
//   kLexDescending   descending rank.
//   kLengthDesc      descending |x|, ties by ascending rank.
//   kUniqueSuffix    descending u(x) = |x| - max(LCP(p_x, x), LCP(x, q_x)) with p_x, q_x the
//                    global lexicographic neighbours (rare branches first), ties by rank.
// Placement policies (GreedyPolicy):
//   kBestFit         the destination with the largest work after insertion.
//   kMaxShared       the destination with the largest shared amount |x| - dC; ties by the
//                    largest work after insertion.
// Remaining ties go to the lowest microbatch index (creation order).
//
// Post-processing of each plan (FinishGreedy):
//   1. small-microbatch elimination: microbatches are visited once in ascending work
//      (ties by index); a visited microbatch is dissolved when every member can move,
//      one at a time in rank order, into another surviving microbatch within capacity
//      (each to the destination with the smallest dC, ties by largest resulting work,
//      then lowest index); otherwise it is kept unchanged.
//   2. alignment to D: while K mod D != 0, split off as a new singleton microbatch the
//      member of a non-singleton microbatch whose removal increases work least (its
//      shared amount), ties by lowest rank. Fails when the next multiple of D exceeds N.
//
// RunGreedy runs all 4 x 2 plans and keeps the one with the fewest microbatches, then
// the least total work, then the first in (order, policy) enumeration order.
//
// Every destination search (placement and elimination) is exact but runs on a
// PlacementIndex (placement_index.h) instead of probing all K microbatches.
//
// Step budget. The index's cost depends on the tree's shape (placement_index.h): a processing
// order that spreads each microbatch over many subtrees of a bushy or deep trie makes every
// update and search touch many hierarchy nodes. So each plan of n ranks gets a budget of
// GreedyStepBudget(n) = kGreedyStepsPerRank * n + kGreedyStepsFloor index steps
// (PlacementIndex::steps, a count of elementary operations: deterministic, independent of the
// machine and of time):
//   * a placement that exhausts it is abandoned and its plan dropped (RunGreedy keeps the best
//     of the others; RunComponentGreedy falls back as described there);
//   * an elimination that exhausts it stops: the microbatch it was dissolving is restored and
//     every later one kept, so the grouping stays valid.
// The budget is 2.8x the most any whole-batch plan of the benchmarks' batches spends (swe-like
// steps of 2k-102k trajectories: 14 steps per rank; a per-tree plan spends at most 25 per rank,
// far below its floor-dominated budget), so it changes none of their plans; on bushy and deep
// tries it drops the orders that scatter microbatches over many subtrees (their plans have 3-8x
// the microbatches of the lexicographic ones) after 40 steps per rank instead of 60-150.
// Complexity: O(N) index steps per plan whatever the shape (each O(log N)), alignment
// O(N + D log N); O(N log N) per plan in all. Every long loop polls `cancel` (cancel.h) and throws
// Cancelled when it is set.
#ifndef HARTS_GREEDY_H_
#define HARTS_GREEDY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "harts/cancel.h"
#include "harts/microbatch.h"
#include "harts/placement_index.h"

namespace harts {

enum class GreedyOrder { kLexAscending = 0, kLexDescending = 1, kLengthDesc = 2, kUniqueSuffix = 3 };
// GreedyPolicy (kBestFit, kMaxShared) is defined in placement_index.h.

const char* GreedyOrderName(GreedyOrder order);
const char* GreedyPolicyName(GreedyPolicy policy);

// The processing order of ranks for `order`.
std::vector<int32_t> ProcessingOrder(const PlanContext& ctx, GreedyOrder order, CancelToken* cancel = nullptr);

// Index steps of one plan of `ranks` ranks ("Step budget" above: the per-rank rate is measured on
// the benchmarks' batches, not derived; the floor keeps small batches unbudgeted in effect).
inline constexpr int64_t kGreedyStepsPerRank = 40;
inline constexpr int64_t kGreedyStepsFloor = int64_t{1} << 16;
inline int64_t GreedyStepBudget(int64_t ranks) { return kGreedyStepsPerRank * ranks + kGreedyStepsFloor; }

// A plan's steps: `used` grows as placement and elimination run; null budgets are unlimited.
struct StepBudget {
  int64_t limit = 0;
  int64_t used = 0;
  bool exhausted() const { return used > limit; }
};

// Places every rank in `sequence` (distinct ranks, e.g. a permutation of [0, N)) by `policy`.
// With a budget: stops as soon as it is exhausted, returning the part placed so far (the caller
// drops it).
Grouping GreedyPlace(const PlanContext& ctx, const std::vector<int32_t>& sequence, GreedyPolicy policy,
                     CancelToken* cancel = nullptr, StepBudget* budget = nullptr);

// Steps 1 and 2 above, in place. EliminateSmallMicrobatches returns whether it dissolved a
// microbatch (with a budget it stops once the budget is exhausted, leaving a valid grouping);
// AlignToDp returns false when K cannot be aligned to dp_size.
bool EliminateSmallMicrobatches(const PlanContext& ctx, Grouping& g, CancelToken* cancel = nullptr,
                                StepBudget* budget = nullptr);
bool AlignToDp(const PlanContext& ctx, Grouping& g, int64_t dp_size, CancelToken* cancel = nullptr);

struct GreedyResult {
  bool feasible = false;
  Grouping grouping;
  std::string name;               // e.g. "lex-ascending/best-fit"
  int64_t plans_over_budget = 0;  // placements abandoned on the step budget
};

// With `least_work`, it also receives, of the 8 plans after elimination (before alignment), the one
// with the least total work (ties: fewer microbatches, then the first), or nothing when every
// placement went over budget or the batch has several components: what RunComponentGreedy keeps
// for a batch that is one component.
GreedyResult RunGreedy(const PlanContext& ctx, int64_t dp_size, CancelToken* cancel = nullptr,
                       std::optional<Grouping>* least_work = nullptr);

// Component greedy (an extension beyond the paper; PlannerOptions::component_greedy).
// The compact trie's connected components (rollout trees as recovered from shared tokens)
// are contiguous rank ranges that share no token, so the work of a microbatch is the sum
// of the works of its parts from each component. This candidate
//   1. keeps every component with W <= T whole;
//   2. partitions every larger component on its own: the 4 x 2 greedy plans above run on
//      the component's ranks only, each followed by small-microbatch elimination, and the
//      plan with the least work (then fewer pieces, then enumeration order) is kept;
//   3. packs the whole components and the pieces by best-fit decreasing work (ties by
//      first rank) into microbatches of capacity T (the fullest bin that fits);
//   4. eliminates small microbatches and aligns K to D as in FinishGreedy.
// Budgets: each plan of a component gets GreedyStepBudget(component ranks); a component whose 8
// placements all exhaust theirs is cut into contiguous pieces instead (its ranks in order, each
// piece extended while its work fits T). The final elimination gets GreedyStepBudget(N).
// Rationale: the global greedy lets trees interfere and contiguous candidates cannot pick
// the best subset of a large tree's branches; per-tree partitions fix both (on the
// swe-like preset they match CP-SAT's per-tree optimum).
// Complexity: the 8 plans of every large component as above, plus O(I log K) packing
// of I items (an ordered set of bins by work).
// `whole`: RunGreedy's `least_work` for the same batch and capacity (null: none); when the batch
// is one component larger than T, step 2 takes it instead of planning the component again (the
// same plans, so the same result).
GreedyResult RunComponentGreedy(const PlanContext& ctx, int64_t dp_size, CancelToken* cancel = nullptr,
                                const std::optional<Grouping>* whole = nullptr);

}  // namespace harts

#endif  // HARTS_GREEDY_H_
