// RolloutBatch against naive oracles: every batch of up to 4 trajectories of length
// 1..3 over a 2-letter alphabet (exhaustive), plus random larger batches; and the
// input-validation errors.
#include "harts/rollout_batch.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "check.h"
#include "harts/errors.h"

namespace harts {
namespace {

using testing::ExpectError;

using Traj = std::vector<int32_t>;

int64_t NaiveLcp(const Traj& a, const Traj& b) {
  int64_t l = 0;
  while (l < static_cast<int64_t>(std::min(a.size(), b.size())) && a[l] == b[l]) ++l;
  return l;
}

void CheckBatch(const std::vector<Traj>& trajs) {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets = {0};
  for (const Traj& t : trajs) {
    tokens.insert(tokens.end(), t.begin(), t.end());
    offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
  const int64_t n = static_cast<int64_t>(trajs.size());
  auto b = RolloutBatch::Ingest(tokens.data(), tokens.size(), offsets.data(), offsets.size(), nullptr, 0);

  // Order: stable lexicographic.
  std::vector<int32_t> order(n);
  for (int32_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
    return std::lexicographical_compare(trajs[x].begin(), trajs[x].end(), trajs[y].begin(), trajs[y].end());
  });
  CHECK(b->order() == order);
  for (int64_t r = 1; r < n; ++r) CHECK_EQ(b->adjacent_lcp()[r], NaiveLcp(trajs[order[r - 1]], trajs[order[r]]));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) CHECK_EQ(b->Lcp(i, j), NaiveLcp(trajs[i], trajs[j]));

  // Compact trie: one row per distinct prefix.
  std::map<Traj, int32_t> row_of_prefix;
  std::map<Traj, int64_t> count_of_prefix;
  for (int64_t i = 0; i < n; ++i) {
    for (size_t p = 0; p < trajs[i].size(); ++p) {
      Traj prefix(trajs[i].begin(), trajs[i].begin() + p + 1);
      const int32_t row = b->row_of_position()[offsets[i] + p];
      auto it = row_of_prefix.find(prefix);
      if (it == row_of_prefix.end())
        row_of_prefix[prefix] = row;
      else
        CHECK_EQ(it->second, row);
      ++count_of_prefix[prefix];
      CHECK_EQ(b->row_depth()[row], static_cast<int32_t>(p));
      CHECK_EQ(b->row_parent()[row], p == 0 ? -1 : b->row_of_position()[offsets[i] + p - 1]);
    }
  }
  CHECK_EQ(b->compact_tokens(), static_cast<int64_t>(row_of_prefix.size()));
  std::set<int32_t> rows;
  for (const auto& [prefix, row] : row_of_prefix) {
    rows.insert(row);
    CHECK_EQ(b->multiplicity()[row], static_cast<int32_t>(count_of_prefix[prefix]));
  }
  CHECK_EQ(static_cast<int64_t>(rows.size()), b->compact_tokens());

  // Interval work = number of distinct prefixes of the interval.
  for (int64_t lo = 0; lo < n; ++lo)
    for (int64_t hi = lo + 1; hi <= n; ++hi) {
      std::set<Traj> prefixes;
      for (int64_t r = lo; r < hi; ++r)
        for (size_t p = 1; p <= trajs[order[r]].size(); ++p)
          prefixes.insert(Traj(trajs[order[r]].begin(), trajs[order[r]].begin() + p));
      CHECK_EQ(b->IntervalWork(lo, hi), static_cast<int64_t>(prefixes.size()));
    }

  // Segments: a prefix node ends a segment iff it does not have exactly one child
  // prefix or some trajectory ends there.
  std::map<Traj, std::set<int32_t>> next_tokens;
  std::set<Traj> ends;
  for (const Traj& t : trajs) {
    ends.insert(t);
    for (size_t p = 1; p < t.size(); ++p) next_tokens[Traj(t.begin(), t.begin() + p)].insert(t[p]);
  }
  const SegmentForest& f = b->forest();
  int64_t num_ends = 0;
  for (const auto& [prefix, row] : row_of_prefix) {
    const bool is_end = next_tokens[prefix].size() != 1 || ends.count(prefix) > 0;
    const int32_t v = b->row_segment()[row];
    num_ends += is_end;
    CHECK_EQ(is_end, static_cast<int64_t>(prefix.size()) == f.end[v]);
    CHECK(f.start[v] < static_cast<int32_t>(prefix.size()) && static_cast<int32_t>(prefix.size()) <= f.end[v]);
    CHECK_EQ(row - f.row_begin[v], static_cast<int64_t>(prefix.size()) - 1 - f.start[v]);
    if (f.start[v] > 0)
      CHECK_EQ(f.parent[v], b->row_segment()[row_of_prefix[Traj(prefix.begin(), prefix.begin() + f.start[v])]]);
    else
      CHECK_EQ(f.parent[v], -1);
  }
  CHECK_EQ(num_ends, f.size());
  int64_t total_ending = 0;
  for (int64_t v = 0; v < f.size(); ++v) {
    CHECK(f.subtree_end[v] > v);
    for (int64_t c = f.child_offsets[v]; c < f.child_offsets[v + 1]; ++c) CHECK_EQ(f.parent[f.children[c]], v);
    for (int64_t e = f.end_offsets[v]; e < f.end_offsets[v + 1]; ++e) {
      CHECK_EQ(static_cast<int64_t>(trajs[f.ending[e]].size()), static_cast<int64_t>(f.end[v]));
      ++total_ending;
    }
  }
  CHECK_EQ(total_ending, n);
}

void ExhaustiveSmall() {
  std::vector<Traj> all;
  for (int len = 1; len <= 3; ++len)
    for (int bits = 0; bits < (1 << len); ++bits) {
      Traj t;
      for (int p = 0; p < len; ++p) t.push_back((bits >> p) & 1);
      all.push_back(t);
    }
  const int a = static_cast<int>(all.size());  // 14 distinct trajectories
  int batches = 0;
  for (int x = 0; x < a; ++x) {
    CheckBatch({all[x]});
    for (int y = 0; y < a; ++y) {
      CheckBatch({all[x], all[y]});
      for (int z = 0; z < a; ++z) {
        CheckBatch({all[x], all[y], all[z]});
        batches += 3;
        if ((x + y + z) % 3 == 0)
          for (int w = 0; w < a; ++w) CheckBatch({all[x], all[y], all[z], all[w]});
      }
    }
  }
  CHECK(batches > 0);
}

void RandomLarger() {
  std::mt19937 rng(7);
  for (int iter = 0; iter < 300; ++iter) {
    const int n = 1 + rng() % 12;
    std::vector<Traj> trajs;
    for (int i = 0; i < n; ++i) {
      Traj t;
      if (!trajs.empty() && rng() % 2) {  // share a prefix of an earlier trajectory
        const Traj& base = trajs[rng() % trajs.size()];
        t.assign(base.begin(), base.begin() + rng() % (base.size() + 1));
      }
      const int extra = (t.empty() ? 1 : 0) + rng() % 6;
      for (int k = 0; k < extra; ++k) t.push_back(rng() % 3);
      trajs.push_back(t);
    }
    CheckBatch(trajs);
  }
}

void Errors() {
  const std::vector<int32_t> tok = {1, 2, 3};
  const std::vector<int32_t> neg = {1, -2, 3};
  const std::vector<int64_t> good = {0, 1, 3};
  const std::vector<int64_t> empty = {0, 1, 1, 3};
  const std::vector<int64_t> start = {1, 3};
  const std::vector<int64_t> short_end = {0, 1, 2};
  const std::vector<int64_t> one = {0};
  const std::vector<int64_t> trees_bad = {0, -1};
  ExpectError<InvalidArgument>([&] { RolloutBatch::Ingest(tok.data(), 3, one.data(), 1, nullptr, 0); }, "offsets");
  ExpectError<InvalidArgument>([&] { RolloutBatch::Ingest(tok.data(), 3, empty.data(), 4, nullptr, 0); }, "offsets[2]");
  ExpectError<InvalidArgument>([&] { RolloutBatch::Ingest(tok.data(), 3, start.data(), 2, nullptr, 0); }, "offsets[0]");
  ExpectError<InvalidArgument>([&] { RolloutBatch::Ingest(tok.data(), 3, short_end.data(), 3, nullptr, 0); },
                               "offsets[2]");
  ExpectError<InvalidArgument>([&] { RolloutBatch::Ingest(neg.data(), 3, good.data(), 3, nullptr, 0); }, "tokens[1]");
  ExpectError<InvalidArgument>([&] { RolloutBatch::Ingest(tok.data(), 3, good.data(), 3, trees_bad.data(), 2); },
                               "tree_ids[1]");
  ExpectError<InvalidArgument>([&] { RolloutBatch::Ingest(tok.data(), 3, good.data(), 3, trees_bad.data(), 1); },
                               "tree_ids");
  auto b = RolloutBatch::Ingest(tok.data(), 3, good.data(), 3, nullptr, 0);
  const int32_t repeated[] = {0, 0};
  const int32_t out_of_range[] = {0, 5};
  ExpectError<InvalidArgument>([&] { b->SubsetWork(repeated, 2); }, "trajectories");
  ExpectError<InvalidArgument>([&] { b->SubsetWork(out_of_range, 2); }, "trajectories[1]");
}

}  // namespace
}  // namespace harts

int main() {
  harts::ExhaustiveSmall();
  harts::RandomLarger();
  harts::Errors();
  std::printf("rollout_batch_test: OK\n");
  return 0;
}
