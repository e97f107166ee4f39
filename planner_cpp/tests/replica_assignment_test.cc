// Replica assignment and slot construction: schedule validity, J against a naive
// evaluation, and the slot-critical sum against brute force over all slot groupings.
#include "harts/replica_assignment.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <random>

#include "check.h"

namespace harts {
namespace {

// Minimum over all ways to split `work` into blocks of d of the sum of block maxima.
int64_t BruteSlotCritical(std::vector<int64_t> work, int64_t d) {
  int64_t best = std::numeric_limits<int64_t>::max();
  std::vector<int> used(work.size(), 0);
  std::function<void(int64_t)> rec = [&](int64_t acc) {
    size_t first = 0;
    while (first < work.size() && used[first]) ++first;
    if (first == work.size()) {
      best = std::min(best, acc);
      return;
    }
    // Choose d - 1 partners for `first` among the unused ones after it.
    std::vector<size_t> block = {first};
    used[first] = 1;
    std::function<void(size_t)> pick = [&](size_t from) {
      if (static_cast<int64_t>(block.size()) == d) {
        int64_t mx = 0;
        for (size_t i : block) mx = std::max(mx, work[i]);
        rec(acc + mx);
        return;
      }
      for (size_t i = from; i < work.size(); ++i) {
        if (used[i]) continue;
        used[i] = 1;
        block.push_back(i);
        pick(i + 1);
        block.pop_back();
        used[i] = 0;
      }
    };
    pick(first + 1);
    used[first] = 0;
  };
  rec(0);
  return best;
}

}  // namespace
}  // namespace harts

int main() {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 500; ++trial) {
    const int64_t d = 1 + rng() % 3;
    const int64_t slots = 1 + rng() % (d == 1 ? 6 : 3);
    std::vector<int64_t> work(d * slots);
    for (auto& w : work) w = 1 + rng() % 20;
    const harts::Schedule s = harts::AssignReplicas(work, d);
    // Every (replica, slot) pair exactly once.
    std::vector<int> seen(d * slots, 0);
    for (size_t m = 0; m < work.size(); ++m) {
      CHECK(s.replica[m] >= 0 && s.replica[m] < d && s.slot[m] >= 0 && s.slot[m] < slots);
      ++seen[s.slot[m] * d + s.replica[m]];
    }
    for (int c : seen) CHECK_EQ(c, 1);
    // Naive J.
    int64_t total = 0, critical = 0, max_rep = 0;
    for (int64_t w : work) total += w;
    for (int64_t j = 0; j < slots; ++j) {
      int64_t mx = 0;
      for (size_t m = 0; m < work.size(); ++m)
        if (s.slot[m] == j) mx = std::max(mx, work[m]);
      critical += mx;
    }
    for (int64_t r = 0; r < d; ++r) {
      int64_t sum = 0;
      for (size_t m = 0; m < work.size(); ++m)
        if (s.replica[m] == r) sum += work[m];
      max_rep = std::max(max_rep, sum);
    }
    CHECK_EQ(s.objective.total_work, total);
    CHECK_EQ(s.objective.slot_critical_work, critical);
    CHECK_EQ(s.objective.max_replica_work, max_rep);
    CHECK(s.objective == harts::EvaluateSchedule(work, s.replica, s.slot, d));
    CHECK_EQ(critical, harts::BruteSlotCritical(work, d));
  }
  return 0;
}
