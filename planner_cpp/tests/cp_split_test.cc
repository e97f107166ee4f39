// The context-parallel split (cp_split.h) against a brute-force oracle on small random
// microbatches: every row on exactly one rank, interior cuts on the chunk grid, the largest rank
// cost equal to the best over every legal split, every entering row received with the state,
// replay and conv rows of its path from earlier ranks; plus cp_size in PlanStep and the errors.
#include "harts/cp_split.h"

#include <algorithm>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "harts/errors.h"
#include "harts/segment_tree.h"
#include "harts/step_plan.h"
#include "planner_test_util.h"

namespace harts {
namespace {

using testing::ExpectError;
using testing::MakeBatch;
using testing::RandomTrajectories;
using testing::Traj;

// Per row of a forest (computed independently of the split): position and path predecessor.
struct Rows {
  std::vector<int64_t> pos;
  std::vector<int64_t> pred;  // -1 for a root row
};

Rows RowsOf(const SegmentForest& f) {
  Rows r;
  r.pos.assign(f.num_rows, -1);
  r.pred.assign(f.num_rows, -1);
  for (int32_t v = 0; v < f.size(); ++v)
    for (int64_t p = f.start[v]; p < f.end[v]; ++p) {
      const int64_t x = f.row_begin[v] + (p - f.start[v]);
      r.pos[x] = p;
      if (p > f.start[v])
        r.pred[x] = x - 1;
      else if (f.parent[v] >= 0)
        r.pred[x] = f.row_begin[f.parent[v]] + (f.end[f.parent[v]] - f.start[f.parent[v]]) - 1;
    }
  return r;
}

// Row at position q on the path ending at row x (q <= pos(x)); -1 for q < 0.
int64_t AncestorAt(const Rows& rows, int64_t x, int64_t q) {
  if (q < 0) return -1;
  while (rows.pos[x] > q) x = rows.pred[x];
  return x;
}

int64_t RowCost(const CpSplitOptions& o, int64_t pos) { return o.linear_cost + o.attention_cost * (pos + 1); }

// The least largest-rank cost over every split into C ranges with legal interior cuts.
int64_t BruteForceBest(const Rows& rows, const CpSplitOptions& o) {
  const int64_t n = static_cast<int64_t>(rows.pos.size());
  std::vector<int64_t> prefix(n + 1, 0), legal;
  for (int64_t x = 0; x < n; ++x) prefix[x + 1] = prefix[x] + RowCost(o, rows.pos[x]);
  for (int64_t x = 1; x < n; ++x)
    if (rows.pos[x] % o.chunk_size == 0) legal.push_back(x);
  int64_t best = prefix[n];
  std::vector<int64_t> cut;
  std::function<void(size_t, int64_t)> go = [&](size_t from, int64_t left) {
    if (left == 0) {
      int64_t worst = 0, prev = 0;
      for (int64_t c : cut) {
        worst = std::max(worst, prefix[c] - prefix[prev]);
        prev = c;
      }
      best = std::min(best, std::max(worst, prefix[n] - prefix[prev]));
      return;
    }
    go(from, left - 1);  // an empty rank (cut repeated or at the end)
    for (size_t i = from; i < legal.size(); ++i) {
      cut.push_back(legal[i]);
      go(i + 1, left - 1);
      cut.pop_back();
    }
  };
  go(0, o.cp_size - 1);
  return best;
}

void CheckSplit(const SegmentForest& f, const CpSplitOptions& o, const CpSplit& s, bool brute_force) {
  const Rows rows = RowsOf(f);
  const int64_t n = f.num_rows, c = o.cp_size, b = o.chunk_size, ctx = o.conv_width - 1;
  CHECK_EQ(s.num_rows, n);
  CHECK_EQ(static_cast<int64_t>(s.rank_row_offsets.size()), c + 1);
  CHECK_EQ(s.rank_row_offsets.front(), 0);
  CHECK_EQ(s.rank_row_offsets.back(), n);
  std::vector<int32_t> rank(n, -1);
  int64_t total = 0, worst = 0;
  for (int64_t r = 0; r < c; ++r) {
    const int64_t lo = s.rank_row_offsets[r], hi = s.rank_row_offsets[r + 1];
    CHECK(lo <= hi);
    if (lo > 0 && lo < n) CHECK_EQ(rows.pos[lo] % b, 0);  // the chunk grid
    int64_t cost = 0;
    for (int64_t x = lo; x < hi; ++x) {
      CHECK_EQ(rank[x], -1);
      rank[x] = static_cast<int32_t>(r);
      cost += RowCost(o, rows.pos[x]);
    }
    CHECK_EQ(s.rank_cost[r], cost);
    total += cost;
    worst = std::max(worst, cost);
  }
  for (int64_t x = 0; x < n; ++x) CHECK(rank[x] >= 0);  // every row on exactly one rank
  CHECK_EQ(s.total_cost, total);
  CHECK_EQ(s.max_cost, worst);
  if (brute_force) CHECK_EQ(s.max_cost, BruteForceBest(rows, o));

  // Every entering row (predecessor on another rank) is in exactly one receive of its rank.
  std::vector<int> entered(n, 0);
  CHECK_EQ(static_cast<int64_t>(s.receive_offsets.size()), c + 1);
  for (int64_t r = 0; r < c; ++r)
    for (int32_t i = s.receive_offsets[r]; i < s.receive_offsets[r + 1]; ++i) {
      CHECK_EQ(s.receive_rank[i], r);
      const int64_t u = s.receive_row[i];
      CHECK(rank[u] < r);
      const int64_t sp = rows.pos[u] + 1, a = sp - sp % b;
      CHECK_EQ(static_cast<int64_t>(s.receive_anchor[i]), a);
      for (int32_t j = s.receive_entry_offsets[i]; j < s.receive_entry_offsets[i + 1]; ++j) {
        const int64_t x = s.entry_rows[j];
        CHECK_EQ(rank[x], r);
        CHECK_EQ(rows.pred[x], u);
        ++entered[x];
      }
      // Replay rows: positions [a, pos(u) + 1) of u's path; conv context before a.
      CHECK_EQ(static_cast<int64_t>(s.receive_replay_offsets[i + 1] - s.receive_replay_offsets[i]), sp - a);
      for (int64_t p = a; p < sp; ++p) {
        const int64_t row = s.replay_rows[s.receive_replay_offsets[i] + (p - a)];
        CHECK_EQ(row, AncestorAt(rows, u, p));
        CHECK(rank[row] < r);
      }
      for (int64_t j = 0; j < ctx; ++j) {
        const int64_t row = s.receive_conv_context[i * ctx + j];
        CHECK_EQ(row, AncestorAt(rows, u, a - ctx + j));
        if (row >= 0) CHECK(rank[row] < r);
      }
      // The state S_a: produced by an earlier rank, after the row at position a - 1.
      const int32_t k = s.receive_state[i];
      if (a == 0) {
        CHECK_EQ(k, -1);
      } else {
        CHECK(k >= 0 && k < s.num_states());
        CHECK_EQ(static_cast<int64_t>(s.state_row[k]), AncestorAt(rows, u, a - 1));
        CHECK_EQ(static_cast<int64_t>(s.state_position[k]), a);
        CHECK_EQ(s.state_rank[k], rank[s.state_row[k]]);
        CHECK(s.state_rank[k] < r);
        const auto* lo = s.state_consumer_rank.data() + s.state_consumer_offsets[k];
        const auto* hi = s.state_consumer_rank.data() + s.state_consumer_offsets[k + 1];
        CHECK(std::binary_search(lo, hi, static_cast<int32_t>(r)));
      }
    }
  for (int64_t x = 0; x < n; ++x) {
    const bool enters = rows.pred[x] >= 0 && rank[rows.pred[x]] < rank[x];
    CHECK_EQ(entered[x], enters ? 1 : 0);
  }
  // States: increasing rows, grouped by producing rank; each has a consumer.
  for (int64_t k = 0; k < s.num_states(); ++k) {
    if (k > 0) CHECK(s.state_row[k - 1] < s.state_row[k]);
    CHECK(s.state_position[k] % b == 0 && s.state_position[k] >= b);
    CHECK(s.state_consumer_offsets[k] < s.state_consumer_offsets[k + 1]);
    CHECK(s.send_offsets[s.state_rank[k]] <= k && k < s.send_offsets[s.state_rank[k] + 1]);
  }
  CHECK_EQ(static_cast<int64_t>(s.send_offsets.back()), s.num_states());
}

SegmentForest ForestOf(const RolloutBatch& batch) {
  const int64_t n = batch.num_trajectories();
  std::vector<int32_t> ids(n), lcp(n, 0);
  std::vector<int64_t> lengths(n);
  for (int64_t j = 0; j < n; ++j) {
    ids[j] = batch.order()[j];
    lengths[j] = batch.lengths()[ids[j]];
    if (j > 0) lcp[j] = static_cast<int32_t>(batch.RankLcp(j - 1, j));
  }
  return BuildSegmentForest(ids.data(), lengths.data(), lcp.data(), n);
}

void TestOnePath() {
  // 10 rows, B = 4: legal cuts before rows 4 and 8; unit costs: {4 | 6} beats {8 | 2}.
  Traj t;
  for (int i = 0; i < 10; ++i) t.push_back(i + 1);
  auto batch = MakeBatch({t});
  CpSplitOptions o;
  o.cp_size = 2;
  o.chunk_size = 4;
  o.conv_width = 3;
  o.linear_cost = 1;
  o.attention_cost = 0;
  const CpSplit s = PlanCpSplit(*batch, nullptr, 0, o);
  CHECK(s.rank_row_offsets == (std::vector<int64_t>{0, 4, 10}));
  CHECK_EQ(s.max_cost, 6);
  CHECK_EQ(s.num_receives(), 1);
  CHECK_EQ(s.receive_rank[0], 1);
  CHECK_EQ(s.receive_row[0], 3);
  CHECK_EQ(s.receive_anchor[0], 4);
  CHECK(s.entry_rows == std::vector<int32_t>{4});
  CHECK(s.replay_rows.empty());
  CHECK(s.receive_conv_context == (std::vector<int32_t>{2, 3}));
  CHECK(s.state_row == std::vector<int32_t>{3});
  CHECK(s.state_rank == std::vector<int32_t>{0});
  CHECK(s.send_offsets == (std::vector<int32_t>{0, 1, 1}));
  // Attention cost moves the cut left: rows 8, 9 cost the most.
  o.linear_cost = 0;
  o.attention_cost = 1;
  const CpSplit q = PlanCpSplit(*batch, nullptr, 0, o);
  CHECK(q.rank_row_offsets == (std::vector<int64_t>{0, 8, 10}));  // 36 | 19 beats 10 | 45
  CHECK_EQ(q.max_cost, 36);
  CheckSplit(ForestOf(*batch), o, q, true);
}

void TestForkOnAnEarlierRank() {
  // A prompt of 6 rows (rows 0-5) and two children of 3 rows (rows 6-8 and 9-11), unit costs.
  auto batch = MakeBatch({{1, 2, 3, 4, 5, 6, 7, 8, 9}, {1, 2, 3, 4, 5, 6, 10, 11, 12}});
  CpSplitOptions o;
  o.cp_size = 2;
  o.chunk_size = 2;
  o.conv_width = 2;
  o.linear_cost = 1;
  o.attention_cost = 0;
  const CpSplit s = PlanCpSplit(*batch, nullptr, 0, o);
  CheckSplit(ForestOf(*batch), o, s, true);
  CHECK(s.rank_row_offsets == (std::vector<int64_t>{0, 6, 12}));  // 6 | 6: the fork point
  // Rank 1 holds both children: one receive (predecessor row 5), anchor 6, no replay.
  CHECK_EQ(s.num_receives(), 1);
  CHECK(s.entry_rows == (std::vector<int32_t>{6, 9}));
  CHECK_EQ(s.receive_anchor[0], 6);
  // B = 4: the fork at position 6 is off the grid; legal cuts are rows 4, 8 and 11 (positions 4,
  // 8, 8). 8 | 4 is best: rank 1 continues the first child from S_8 (a grid cut) and starts the
  // second child from S_4 of the prompt (rank 0), replaying prompt rows 4 and 5.
  o.chunk_size = 4;
  const CpSplit t = PlanCpSplit(*batch, nullptr, 0, o);
  CheckSplit(ForestOf(*batch), o, t, true);
  CHECK(t.rank_row_offsets == (std::vector<int64_t>{0, 8, 12}));
  CHECK(t.receive_row == (std::vector<int32_t>{5, 7}));
  CHECK(t.receive_anchor == (std::vector<int32_t>{4, 8}));
  CHECK(t.replay_rows == (std::vector<int32_t>{4, 5}));
  CHECK(t.entry_rows == (std::vector<int32_t>{9, 8}));
  CHECK(t.state_row == (std::vector<int32_t>{3, 7}));
  CHECK(t.receive_state == (std::vector<int32_t>{0, 1}));
}

void TestRandomAgainstBruteForce() {
  std::mt19937 rng(35);
  for (int iter = 0; iter < 400; ++iter) {
    const int n = 1 + static_cast<int>(rng() % 6);
    auto trajs = RandomTrajectories(rng, n, 12, 3);
    auto batch = MakeBatch(trajs);
    CpSplitOptions o;
    o.cp_size = 1 + static_cast<int64_t>(rng() % 4);
    o.chunk_size = 1 + static_cast<int64_t>(rng() % 5);
    o.conv_width = 1 + static_cast<int64_t>(rng() % 4);
    o.linear_cost = static_cast<int64_t>(rng() % 20);
    o.attention_cost = static_cast<int64_t>(rng() % 3);
    if (o.linear_cost == 0 && o.attention_cost == 0) o.linear_cost = 1;
    const SegmentForest f = ForestOf(*batch);
    const CpSplit s = SplitForest(f, o);
    CheckSplit(f, o, s, f.num_rows <= 40);
    // Same input, same split; and through the batch API over a random subset.
    const CpSplit again = SplitForest(f, o);
    CHECK(again.rank_row_offsets == s.rank_row_offsets && again.receive_row == s.receive_row &&
          again.state_row == s.state_row && again.replay_rows == s.replay_rows);
    std::vector<int32_t> ids;
    for (int32_t i = 0; i < n; ++i)
      if (rng() % 2) ids.push_back(i);
    if (ids.empty()) continue;
    const CpSplit sub = PlanCpSplit(*batch, ids.data(), static_cast<int64_t>(ids.size()), o);
    CHECK(sub.num_rows <= s.num_rows);
  }
}

void TestLargeSplitIsBalanced() {
  // A bushy tree of a few thousand rows: the bound of the header holds.
  std::mt19937 rng(7);
  auto batch = MakeBatch(RandomTrajectories(rng, 300, 200, 4));
  CpSplitOptions o;
  o.cp_size = 8;
  o.chunk_size = 16;
  const SegmentForest f = ForestOf(*batch);
  const CpSplit s = SplitForest(f, o);
  CheckSplit(f, o, s, false);
  const Rows rows = RowsOf(f);
  int64_t gap = 0, run = 0;  // the costliest run of rows between consecutive legal cuts
  for (int64_t x = 0; x < f.num_rows; ++x) {
    if (x > 0 && rows.pos[x] % o.chunk_size == 0) run = 0;
    run += RowCost(o, rows.pos[x]);
    gap = std::max(gap, run);
  }
  CHECK(s.max_cost <= (s.total_cost + o.cp_size - 1) / o.cp_size + gap);
}

void TestErrors() {
  auto batch = MakeBatch({{1, 2, 3}});
  auto split = [&](CpSplitOptions o) { return [&batch, o] { PlanCpSplit(*batch, nullptr, 0, o); }; };
  CpSplitOptions o;
  o.cp_size = 0;
  ExpectError<InvalidArgument>(split(o), "cp_size");
  o.cp_size = kMaxCpSize + 1;
  ExpectError<InvalidArgument>(split(o), "cp_size");
  o = CpSplitOptions{};
  o.chunk_size = 0;
  ExpectError<InvalidArgument>(split(o), "chunk_size");
  o = CpSplitOptions{};
  o.conv_width = 0;
  ExpectError<InvalidArgument>(split(o), "conv_width");
  o = CpSplitOptions{};
  o.linear_cost = 0;
  o.attention_cost = 0;
  ExpectError<InvalidArgument>(split(o), "linear_cost");
  o = CpSplitOptions{};
  o.attention_cost = kMaxCpCost + 1;
  ExpectError<InvalidArgument>(split(o), "attention_cost");
  // A total cost over 2^62: one path of 2^22 rows at attention_cost 2^20 (a bare forest, no tokens).
  const int32_t parent[] = {-1}, start[] = {0}, end[] = {1 << 22};
  const SegmentForest path = SegmentForestFromArrays({parent, 1, start, 1, end, 1});
  o = CpSplitOptions{};
  o.attention_cost = kMaxCpCost;
  ExpectError<ResourceExhausted>([&] { SplitForest(path, o); }, "attention_cost");
  o.attention_cost = 1;
  o.cp_size = 4;
  const CpSplit quarter = SplitForest(path, o);  // one path: cuts on the 64-row grid only
  for (int64_t x : quarter.rank_row_offsets) CHECK_EQ(x % 64, 0);
  CHECK_EQ(quarter.num_states(), 3);
  const int32_t bad[] = {5};
  ExpectError<InvalidArgument>([&] { PlanCpSplit(*batch, bad, 1, CpSplitOptions{}); }, "trajectories[0]");
}

void TestPlanStepCpSize() {
  std::mt19937 rng(3);
  auto trajs = RandomTrajectories(rng, 60, 40, 3);
  auto batch = MakeBatch(trajs);
  PlannerOptions o;
  o.dp_size = 2;
  o.capacity = 60;
  const StepPlan one = PlanStep(*batch, o);
  o.cp_size = 1;
  const StepPlan same = PlanStep(*batch, o);
  CHECK(one.members == same.members && one.work == same.work && one.replica == same.replica &&
        one.source == same.source);
  CHECK_EQ(one.cp_size, 1);
  // cp_size = 3 packs like capacity 3 T, and reports T and C.
  o.cp_size = 3;
  const StepPlan cp = PlanStep(*batch, o);
  PlannerOptions wide;
  wide.dp_size = 2;
  wide.capacity = 180;
  const StepPlan big = PlanStep(*batch, wide);
  CHECK(cp.members == big.members && cp.work == big.work && cp.objective.total_work == big.objective.total_work);
  CHECK_EQ(cp.capacity, 60);
  CHECK_EQ(cp.cp_size, 3);
  for (int64_t w : cp.work) CHECK(w <= 180);
  // A trajectory longer than C x T names the field and both numbers.
  auto long_batch = MakeBatch({Traj(200, 1), Traj(10, 2)});
  o.dp_size = 1;
  try {
    PlanStep(*long_batch, o);
    CHECK(false);
  } catch (const InvalidArgument& e) {
    CHECK_EQ(e.field(), std::string("trajectories[0]"));
    const std::string what = e.what();
    CHECK(what.find("C x T = 3 x 60 = 180") != std::string::npos);
  }
  o.cp_size = 0;
  ExpectError<InvalidArgument>([&] { PlanStep(*batch, o); }, "cp_size");
  o.cp_size = 4;
  o.capacity = kMaxCpRows / 2;
  ExpectError<InvalidArgument>([&] { PlanStep(*batch, o); }, "cp_size");
}

}  // namespace
}  // namespace harts

int main() {
  harts::TestOnePath();
  harts::TestForkOnAnEarlierRank();
  harts::TestRandomAgainstBruteForce();
  harts::TestLargeSplitIsBalanced();
  harts::TestErrors();
  harts::TestPlanStepCpSize();
  return 0;
}
