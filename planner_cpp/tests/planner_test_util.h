// Shared helpers of the step-planner C++ tests: random rollout-like batches and a
// checker of grouping invariants.
#ifndef HARTS_TESTS_PLANNER_TEST_UTIL_H_
#define HARTS_TESTS_PLANNER_TEST_UTIL_H_

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "check.h"
#include "harts/microbatch.h"
#include "harts/rollout_batch.h"
#include "harts/segment_tree.h"

namespace harts::testing {

using Traj = std::vector<int32_t>;

inline std::unique_ptr<RolloutBatch> MakeBatch(const std::vector<Traj>& trajs) {
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets = {0};
  for (const Traj& t : trajs) {
    tokens.insert(tokens.end(), t.begin(), t.end());
    offsets.push_back(static_cast<int64_t>(tokens.size()));
  }
  return RolloutBatch::Ingest(tokens.data(), tokens.size(), offsets.data(), offsets.size(), nullptr, 0);
}

// n trajectories: each either a fresh random sequence or a random prefix of an earlier
// one extended by a random suffix (so prefixes are shared at random depths); with
// probability `dup` an exact copy of an earlier trajectory.
inline std::vector<Traj> RandomTrajectories(std::mt19937& rng, int n, int max_len, int alphabet, double dup = 0.1) {
  std::vector<Traj> out;
  std::uniform_real_distribution<double> u(0, 1);
  for (int i = 0; i < n; ++i) {
    Traj t;
    if (!out.empty() && u(rng) < dup) {
      t = out[rng() % out.size()];
    } else {
      if (!out.empty() && u(rng) < 0.7) {
        const Traj& base = out[rng() % out.size()];
        t.assign(base.begin(), base.begin() + rng() % base.size());
      }
      const int extra = 1 + static_cast<int>(rng() % max_len);
      for (int j = 0; j < extra && static_cast<int>(t.size()) < max_len; ++j)
        t.push_back(static_cast<int32_t>(rng() % alphabet));
      if (t.empty()) t.push_back(static_cast<int32_t>(rng() % alphabet));
    }
    out.push_back(t);
  }
  return out;
}

// The same trajectories behind a common prefix of `prefix` tokens (a shared system prompt:
// every adjacent LCP is then >= prefix, so the batch is one component at floor 0).
inline std::vector<Traj> WithCommonPrefix(const std::vector<Traj>& trajs, int prefix, int32_t token = 7) {
  std::vector<Traj> out;
  for (const Traj& t : trajs) {
    Traj u(prefix, token);
    u.insert(u.end(), t.begin(), t.end());
    out.push_back(std::move(u));
  }
  return out;
}

// The same trajectories, each behind one of `prompts` distinct system prompts (chosen at
// random): a two-level trie, whose top level splits into `prompts` large parts.
inline std::vector<Traj> WithPrompts(const std::vector<Traj>& trajs, int prompts, std::mt19937& rng) {
  std::vector<Traj> out;
  for (const Traj& t : trajs) {
    const int p = static_cast<int>(rng() % prompts);
    Traj u = {100 + p, 100 + p, 100 + p};
    u.insert(u.end(), t.begin(), t.end());
    out.push_back(std::move(u));
  }
  return out;
}

// Checks that `g` partitions [0, N) into non-empty sorted groups of exact work <= cap.
inline void CheckGrouping(const PlanContext& ctx, const Grouping& g) {
  std::vector<int> seen(ctx.size(), 0);
  CHECK_EQ(g.groups.size(), g.work.size());
  for (size_t k = 0; k < g.groups.size(); ++k) {
    CHECK(!g.groups[k].empty());
    CHECK(std::is_sorted(g.groups[k].begin(), g.groups[k].end()));
    for (int32_t r : g.groups[k]) ++seen[r];
    CHECK_EQ(g.work[k], GroupWork(ctx, g.groups[k]));
    CHECK(g.work[k] <= ctx.capacity());
  }
  for (int s : seen) CHECK_EQ(s, 1);
}

// A segment tree in the length form (segment_tree.h) and its view.
struct Tree {
  std::vector<int32_t> parent, length, trajectory_end;
  SegmentTreeView view() const {
    SegmentTreeView v;
    v.parent = parent.data();
    v.num_segments = static_cast<int64_t>(parent.size());
    v.length = length.data();
    v.num_lengths = static_cast<int64_t>(length.size());
    v.trajectory_end = trajectory_end.data();
    v.num_trajectories = static_cast<int64_t>(trajectory_end.size());
    return v;
  }
};

// The tree of a batch's own segment forest.
inline Tree ExportTree(const RolloutBatch& b) {
  const SegmentForest& f = b.forest();
  Tree t;
  t.parent = f.parent;
  for (int64_t v = 0; v < f.size(); ++v) t.length.push_back(f.end[v] - f.start[v]);
  t.trajectory_end.resize(b.num_trajectories());
  for (int64_t r = 0; r < b.num_trajectories(); ++r) t.trajectory_end[b.order()[r]] = f.item_segment[r];
  return t;
}

// A forest of `trees` bushy, deep rollout trees in the length form: each tree grows by `forks`
// new segments (1-`max_len` tokens), each under the tree's newest segment with probability
// `deepen` (long chains that fork along the way) or else under a uniformly chosen earlier one
// (forks at every level, as a random recursive tree). Every leaf ends a trajectory, and each
// internal segment does with probability 0.1.
inline Tree BushyForest(std::mt19937& rng, int trees, int forks, double deepen = 0.5, int max_len = 4) {
  Tree t;
  std::uniform_real_distribution<double> u(0, 1);
  for (int i = 0; i < trees; ++i) {
    const int32_t root = static_cast<int32_t>(t.parent.size());
    t.parent.push_back(-1);
    t.length.push_back(1 + static_cast<int32_t>(rng() % max_len));
    for (int f = 0; f < forks; ++f) {
      const int32_t newest = static_cast<int32_t>(t.parent.size()) - 1;
      const int32_t at = u(rng) < deepen ? newest : root + static_cast<int32_t>(rng() % (newest - root + 1));
      t.parent.push_back(at);
      t.length.push_back(1 + static_cast<int32_t>(rng() % max_len));
    }
  }
  std::vector<char> internal(t.parent.size(), 0);
  for (int32_t p : t.parent)
    if (p >= 0) internal[p] = 1;
  for (size_t v = 0; v < t.parent.size(); ++v)
    if (!internal[v] || u(rng) < 0.1) t.trajectory_end.push_back(static_cast<int32_t>(v));
  return t;
}

// The trajectories of a length-form tree as tokens: segment v's tokens are all v + 1, so siblings
// start differently (and their lexicographic order is their id order, as the tree's).
inline std::vector<Traj> TreeTrajectories(const Tree& t) {
  std::vector<Traj> out;
  for (int32_t e : t.trajectory_end) {
    std::vector<int32_t> path;
    for (int32_t v = e; v >= 0; v = t.parent[v]) path.push_back(v);
    Traj traj;
    for (size_t i = path.size(); i-- > 0;) traj.insert(traj.end(), t.length[path[i]], path[i] + 1);
    out.push_back(std::move(traj));
  }
  return out;
}

inline std::unique_ptr<RolloutBatch> MakeTreeBatch(const Tree& t) {
  return RolloutBatch::FromSegmentTree(t.view(), nullptr, 0);
}

}  // namespace harts::testing

#endif  // HARTS_TESTS_PLANNER_TEST_UTIL_H_
