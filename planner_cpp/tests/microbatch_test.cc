// Equation (10) deltas against recomputed C(M): SharedAmount, InsertionDelta and
// RemovalDelta (with and without an excluded member) on every subset of small random
// batches.
#include "harts/microbatch.h"

#include <random>

#include "check.h"
#include "planner_test_util.h"

namespace harts {
namespace {

void CheckDeltas(const std::vector<testing::Traj>& trajs) {
  auto batch = testing::MakeBatch(trajs);
  const PlanContext ctx(*batch, 1 << 30);
  const int n = static_cast<int>(ctx.size());
  for (int mask = 1; mask < (1 << n); ++mask) {
    std::vector<int32_t> m;
    for (int r = 0; r < n; ++r)
      if (mask >> r & 1) m.push_back(r);
    const int64_t w = GroupWork(ctx, m);
    // C(M) of ranks equals SubsetWork of the trajectory indices.
    std::vector<int32_t> ids;
    for (int32_t r : m) ids.push_back(batch->order()[r]);
    CHECK_EQ(w, batch->SubsetWork(ids.data(), ids.size()));
    for (int r = 0; r < n; ++r) {
      std::vector<int32_t> other = m;
      if (mask >> r & 1) {
        EraseSorted(other, r);
        CHECK_EQ(RemovalDelta(ctx, m, r), w - (other.empty() ? 0 : GroupWork(ctx, other)));
      } else {
        InsertSorted(other, r);
        CHECK_EQ(InsertionDelta(ctx, m, r), GroupWork(ctx, other) - w);
        // Insertion into m minus one member x.
        for (int32_t x : m) {
          std::vector<int32_t> without = m;
          EraseSorted(without, x);
          std::vector<int32_t> with = without;
          InsertSorted(with, r);
          CHECK_EQ(InsertionDelta(ctx, m, r, x),
                   GroupWork(ctx, with) - (without.empty() ? 0 : GroupWork(ctx, without)));
        }
      }
    }
  }
}

// CopyPolled copies a grouping exactly; ReleasePolled empties one; a cancelled token stops a
// release with the grouping still destructible.
void TestPolledCopyAndRelease() {
  Grouping g;
  for (int32_t k = 0; k < 3000; ++k) {
    g.groups.push_back({k, k + 3000});
    g.work.push_back(k);
  }
  Grouping copy;
  copy.groups.push_back({7});
  copy.work.push_back(1);
  CancelToken quiet;
  CopyPolled(g, &copy, &quiet);
  CHECK(copy.groups == g.groups && copy.work == g.work);
  ReleasePolled(&copy, &quiet);
  CHECK(copy.groups.empty() && copy.work.empty());
  CancelToken stop;
  stop.Cancel();
  bool stopped = false;
  try {
    ReleasePolled(&g, &stop);
  } catch (const Cancelled&) {
    stopped = true;
  }
  CHECK(stopped);
}

}  // namespace
}  // namespace harts

int main() {
  harts::TestPolledCopyAndRelease();
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 7);
    harts::CheckDeltas(harts::testing::RandomTrajectories(rng, n, 6, 3, 0.2));
  }
  return 0;
}
