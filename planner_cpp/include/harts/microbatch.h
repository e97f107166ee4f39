// Microbatch groupings and their exact compact work (Section 3.2, Equations 5, 6 and 10).
//
// Glossary
//   rank r        position of a trajectory in the batch's stable lexicographic order;
//                 every planner module works on ranks and converts to trajectory
//                 indices only when it returns a plan.
//   len(r)        |x| of the trajectory of rank r.
//   microbatch M  a non-empty set of ranks, stored sorted ascending.
//   w(M) = C(M)   compact work of M (Eq. 5): |x_1| + sum_{i>=2} (|x_i| - LCP(x_{i-1}, x_i))
//                 over M's members in rank order.
//   cuts          a contiguous partition of ranks [0, N) into K intervals, given as
//                 cuts[0] = 0 < cuts[1] < ... < cuts[K] = N; microbatch k is
//                 [cuts[k], cuts[k+1]) and its work is W(cuts[k], cuts[k+1]).
//   grouping      K microbatches (any membership, contiguous or not) with their works.
//   capacity T    the most compact tokens one microbatch may hold.
//
// Equation (10) for ranks: inserting rank r between its neighbours p < r < q of M adds
//   dC = len(r) - LCP(p, r) - LCP(r, q) + LCP(p, q) = len(r) - max(LCP(p, r), LCP(r, q)),
// because LCP(p, q) = min(LCP(p, r), LCP(r, q)) for lexicographically ordered p < r < q.
// A missing neighbour contributes LCP 0. We call max(LCP(p, r), LCP(r, q)) the shared
// amount of r in M; removing r from M saves exactly dC.
#ifndef HARTS_MICROBATCH_H_
#define HARTS_MICROBATCH_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"
#include "harts/rollout_batch.h"

namespace harts {

// Read-only planning view of a batch at a fixed capacity. Cheap to copy (one vector).
class PlanContext {
 public:
  // Precondition: capacity >= 1. Does not check trajectory lengths (see PlanStep).
  PlanContext(const RolloutBatch& batch, int64_t capacity);

  const RolloutBatch& batch() const { return *batch_; }
  int64_t size() const { return n_; }
  int64_t capacity() const { return capacity_; }
  // len(r), |x| of rank r. O(1).
  int64_t Length(int64_t r) const { return len_[r]; }
  // LCP of ranks a, b (len(a) when a == b). O(1).
  int64_t Lcp(int64_t a, int64_t b) const { return batch_->RankLcp(a, b); }
  // Adjacent LCP L_t = LCP(rank t - 1, rank t), for 1 <= t < N.
  int64_t AdjacentLcp(int64_t t) const { return batch_->adjacent_lcp()[t]; }
  // W(lo, hi): compact work of ranks [lo, hi), 0 <= lo < hi <= N. O(1).
  int64_t Work(int64_t lo, int64_t hi) const { return batch_->IntervalWork(lo, hi); }

 private:
  const RolloutBatch* batch_;
  int64_t n_;
  int64_t capacity_;
  std::vector<int64_t> len_;  // INVARIANT: len_[r] = lengths()[order()[r]]
};

// Shared amount max(LCP(p, r), LCP(r, q)) of rank r against the sorted members of `m`,
// where p / q are the members just below / above r, skipping `exclude` (pass -1 for
// none) and r itself. O(log |m|).
int64_t SharedAmount(const PlanContext& ctx, const std::vector<int32_t>& m, int32_t r, int32_t exclude = -1);

// Work added by inserting rank r (not in m) into m, Eq. (10); with `exclude`, into
// m \ {exclude}. O(log |m|).
inline int64_t InsertionDelta(const PlanContext& ctx, const std::vector<int32_t>& m, int32_t r, int32_t exclude = -1) {
  return ctx.Length(r) - SharedAmount(ctx, m, r, exclude);
}

// Work saved by removing rank r (a member) from m. O(log |m|).
inline int64_t RemovalDelta(const PlanContext& ctx, const std::vector<int32_t>& m, int32_t r) {
  return ctx.Length(r) - SharedAmount(ctx, m, r, r);
}

// C(M) of sorted, distinct ranks (Eq. 5). O(|m|).
int64_t GroupWork(const PlanContext& ctx, const std::vector<int32_t>& m);

// Inserts r into sorted m / erases r from sorted m (r must be present). O(|m|).
void InsertSorted(std::vector<int32_t>& m, int32_t r);
void EraseSorted(std::vector<int32_t>& m, int32_t r);

struct Grouping {
  // INVARIANT: every group is non-empty and sorted ascending; the groups partition the
  // ranks [0, N); work[k] = GroupWork(groups[k]).
  std::vector<std::vector<int32_t>> groups;
  std::vector<int64_t> work;

  int64_t size() const { return static_cast<int64_t>(groups.size()); }
  int64_t TotalWork() const;
  int64_t MaxWork() const;
};

// Empties *g, freeing its groups in blocks of kPollBlock with a poll of `cancel` (may be null)
// before each: a grouping of millions of groups is dropped without a long unpolled stretch.
void ReleasePolled(Grouping* g, CancelToken* cancel);

// *to = from, group by group, polling `cancel` (may be null) every kPollBlock groups.
void CopyPolled(const Grouping& from, Grouping* to, CancelToken* cancel);

// The grouping of a contiguous partition. Precondition: cuts as in the glossary.
Grouping GroupingFromCuts(const PlanContext& ctx, const std::vector<int32_t>& cuts);

// Total and maximum interval work of a contiguous partition. O(K).
int64_t CutsTotalWork(const PlanContext& ctx, const std::vector<int32_t>& cuts);
int64_t CutsMaxWork(const PlanContext& ctx, const std::vector<int32_t>& cuts);

}  // namespace harts

#endif  // HARTS_MICROBATCH_H_
