// PlanStep end to end: the guarantees on random batches (exact and heuristic search,
// D not dividing N, T barely above the longest trajectory, identical trajectories),
// determinism, selection against the exact candidates, and the error cases.
#include "harts/step_plan.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <random>
#include <string>
#include <thread>

#include "check.h"
#include "harts/contiguous_dp.h"
#include "harts/errors.h"
#include "planner_test_util.h"

namespace harts {
namespace {

void CheckPlan(const RolloutBatch& batch, const StepPlan& p, int64_t d, int64_t cap) {
  const int64_t n = batch.num_trajectories();
  const int64_t k = p.num_microbatches();
  CHECK(k > 0 && k % d == 0);
  CHECK_EQ(static_cast<int64_t>(p.member_offsets.size()), k + 1);
  CHECK_EQ(static_cast<int64_t>(p.members.size()), n);
  std::vector<int> seen(n, 0), per_replica(d, 0), pair(k, 0);
  int64_t total = 0;
  for (int64_t m = 0; m < k; ++m) {
    CHECK(p.member_offsets[m] < p.member_offsets[m + 1]);
    std::vector<int32_t> ids(p.members.begin() + p.member_offsets[m], p.members.begin() + p.member_offsets[m + 1]);
    for (int32_t i : ids) ++seen[i];
    CHECK_EQ(p.work[m], batch.SubsetWork(ids.data(), ids.size()));
    CHECK(p.work[m] <= cap);
    CHECK(p.replica[m] >= 0 && p.replica[m] < d);
    CHECK(p.slot[m] >= 0 && p.slot[m] < k / d);
    ++per_replica[p.replica[m]];
    ++pair[p.slot[m] * d + p.replica[m]];
    total += p.work[m];
    if (m > 0) CHECK(std::make_pair(p.slot[m - 1], p.replica[m - 1]) < std::make_pair(p.slot[m], p.replica[m]));
  }
  for (int s : seen) CHECK_EQ(s, 1);
  for (int c : per_replica) CHECK_EQ(c, k / d);
  for (int c : pair) CHECK_EQ(c, 1);
  CHECK_EQ(p.objective.total_work, total);
  CHECK(p.objective == EvaluateSchedule(p.work, p.replica, p.slot, d));
  CHECK(total >= p.compact_tokens);
}

bool SamePlan(const StepPlan& a, const StepPlan& b) {
  return a.members == b.members && a.member_offsets == b.member_offsets && a.replica == b.replica && a.slot == b.slot &&
         a.work == b.work && a.source == b.source && a.objective == b.objective;
}

// Cancellation: a cancelled or expired token stops PlanStep with Cancelled before any work; a
// null token and a token never fired give the same plan; deadlines and Cancel() at many
// points inside the plan either stop it (Cancelled, with the right field) or let it finish
// with the same plan. Bounds on how late it stops are generous (seconds, not milliseconds).
void CheckCancellation() {
  std::mt19937 rng(41);
  auto trajs = testing::RandomTrajectories(rng, 2000, 40, 4, 0.05);
  auto batch = testing::MakeBatch(trajs);
  PlannerOptions o;
  o.dp_size = 4;
  o.capacity = 400;
  const StepPlan reference = PlanStep(*batch, o);
  {
    CancelToken never;
    CHECK(SamePlan(PlanStep(*batch, o, &never), reference));
    CHECK(SamePlan(PlanStep(*batch, o, nullptr), reference));
  }
  {
    CancelToken token;
    token.Cancel();
    testing::ExpectError<Cancelled>([&] { PlanStep(*batch, o, &token); }, "cancelled");
    CancelToken expired;
    expired.SetDeadlineAfter(std::chrono::milliseconds(-1));
    testing::ExpectError<Cancelled>([&] { PlanStep(*batch, o, &expired); }, "deadline");
  }
  using Clock = std::chrono::steady_clock;
  int stopped = 0, finished = 0;
  for (int64_t us = 0; us <= int64_t{1} << 27 && finished == 0; us = us == 0 ? 50 : us * 2) {
    // A deadline `us` microseconds in.
    CancelToken token;
    token.SetDeadlineAfter(std::chrono::microseconds(us));
    const Clock::time_point start = Clock::now();
    try {
      CHECK(SamePlan(PlanStep(*batch, o, &token), reference));
      ++finished;
    } catch (const Cancelled& e) {
      CHECK(e.deadline_exceeded());
      const double late = std::chrono::duration<double>(Clock::now() - start).count() - us * 1e-6;
      CHECK(late < 2.0);
      ++stopped;
    }
    // Cancel() from another thread `us` microseconds in.
    CancelToken other;
    std::thread canceller([&] {
      std::this_thread::sleep_for(std::chrono::microseconds(us));
      other.Cancel();
    });
    try {
      CHECK(SamePlan(PlanStep(*batch, o, &other), reference));
    } catch (const Cancelled& e) {
      CHECK(!e.deadline_exceeded());
      CHECK_EQ(e.field(), std::string("cancelled"));
    }
    canceller.join();
  }
  CHECK(stopped >= 1 && finished == 1);
}

}  // namespace
}  // namespace harts

int main() {
  harts::CheckCancellation();
  using namespace harts;
  std::mt19937 rng(17);
  int planned = 0, infeasible = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 24);
    auto trajs = testing::RandomTrajectories(rng, n, 12, 3, trial % 5 == 0 ? 0.6 : 0.1);
    auto batch = testing::MakeBatch(trajs);
    int64_t longest = 0;
    for (auto& t : trajs) longest = std::max<int64_t>(longest, t.size());
    PlannerOptions o;
    o.dp_size = 1 + rng() % 4;
    o.capacity = longest + (trial % 3 == 0 ? 0 : static_cast<int64_t>(rng() % 30));
    o.exact_threshold = trial % 2 == 0 ? 512 : 0;  // exact or heuristic search
    o.max_sampled_k = 2 + rng() % 6;
    try {
      const StepPlan p = PlanStep(*batch, o);
      CheckPlan(*batch, p, o.dp_size, o.capacity);
      const StepPlan again = PlanStep(*batch, o);
      CHECK(again.members == p.members && again.replica == p.replica && again.slot == p.slot);
      CHECK_EQ(p.search_mode, std::string(o.exact_threshold >= n ? "exact" : "heuristic"));
      CHECK(p.selected >= 0 && p.selected < static_cast<int64_t>(p.candidates.size()));
      for (const CandidateSummary& c : p.candidates) CHECK(!(c.objective < p.objective));
      {
        // Selection (step 5): the least (J with the microbatch cost, K, order). A cost changes
        // only which candidate wins.
        PlannerOptions costed = o;
        costed.microbatch_cost = static_cast<int64_t>(rng() % (o.capacity + 1));
        const StepPlan q = PlanStep(*batch, costed);
        CheckPlan(*batch, q, o.dp_size, o.capacity);
        CHECK_EQ(q.candidates.size(), p.candidates.size());
        auto key = [&](const StepPlan& plan, size_t i, int64_t cost) {
          const CandidateSummary& c = plan.candidates[i];
          const int64_t slots = c.k / o.dp_size;
          return std::make_tuple(c.objective.total_work + cost * c.k, c.objective.slot_critical_work + cost * slots,
                                 c.objective.max_replica_work + cost * slots, c.k, i);
        };
        for (const StepPlan* plan : {&p, &q}) {
          const int64_t cost = plan == &p ? 0 : costed.microbatch_cost;
          size_t best = 0;
          for (size_t i = 1; i < plan->candidates.size(); ++i)
            if (key(*plan, i, cost) < key(*plan, best, cost)) best = i;
          CHECK_EQ(plan->selected, static_cast<int64_t>(best));
        }
      }
      {
        // The selected total is at most every exact contiguous candidate's, in exact search
        // (its base candidates) and in heuristic search (the contiguous-optimum candidate).
        const PlanContext ctx(*batch, o.capacity);
        std::vector<int64_t> ks;
        for (int64_t k = p.k_min; k <= p.k_max; k += o.dp_size) ks.push_back(k);
        for (const ContiguousResult& r : ExactContiguousPartitions(ctx, ks))
          if (r.feasible) CHECK(p.objective.total_work <= r.total_work);
      }
      PlannerOptions paper = o;
      paper.component_greedy = false;
      try {
        const StepPlan q = PlanStep(*batch, paper);
        CheckPlan(*batch, q, o.dp_size, o.capacity);
        CHECK(!(q.objective < p.objective));  // the extension only adds a candidate
      } catch (const FailedPrecondition&) {
      }
      ++planned;
    } catch (const FailedPrecondition& e) {
      CHECK(e.field() == "dp_size" || e.field() == "capacity");
      ++infeasible;
    }
  }
  CHECK(planned > 300);

  // Errors.
  auto batch = testing::MakeBatch({{1, 2, 3}, {1, 2, 4, 5, 6}, {7}});
  PlannerOptions o;
  o.capacity = 4;
  testing::ExpectError<InvalidArgument>([&] { PlanStep(*batch, o); }, "trajectories[1]");
  o.capacity = 5;
  o.dp_size = 4;
  testing::ExpectError<FailedPrecondition>([&] { PlanStep(*batch, o); }, "dp_size");
  o.dp_size = 0;
  testing::ExpectError<InvalidArgument>([&] { PlanStep(*batch, o); }, "dp_size");
  o.dp_size = 2;
  o.microbatch_cost = -1;
  testing::ExpectError<InvalidArgument>([&] { PlanStep(*batch, o); }, "microbatch_cost");
  o.microbatch_cost = 6;  // > T = 5
  testing::ExpectError<InvalidArgument>([&] { PlanStep(*batch, o); }, "microbatch_cost");
  o.microbatch_cost = 5;
  CheckPlan(*batch, PlanStep(*batch, o), 2, 5);
  o.microbatch_cost = 0;
  o.search = "fast";
  testing::ExpectError<InvalidArgument>([&] { PlanStep(*batch, o); }, "search");
  // Three disjoint trajectories of 5 tokens at T = 5, D = 2: K must be 4 > N = 3.
  auto three = testing::MakeBatch({{1, 1, 1, 1, 1}, {2, 2, 2, 2, 2}, {3, 3, 3, 3, 3}});
  o = PlannerOptions();
  o.capacity = 5;
  o.dp_size = 2;
  testing::ExpectError<FailedPrecondition>([&] { PlanStep(*three, o); }, "capacity");
  o.capacity = 10;
  CheckPlan(*three, PlanStep(*three, o), 2, 10);
  (void)infeasible;
  return 0;
}
