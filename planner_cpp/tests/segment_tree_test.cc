// segment_tree.h and RolloutBatch::FromSegmentTree against the token path: for random token
// batches, the batch built from their exported segment tree equals the ingested batch array
// for array and gives byte-identical step and call plans; non-canonical trees (ids in any
// order, unary segments nobody ends at) equal the batch of tokens spelling them; the length
// and position forms build the same topology; and every malformed tree is refused with an
// error naming its field.
#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "harts/call_layout.h"
#include "harts/errors.h"
#include "harts/rollout_batch.h"
#include "harts/segment_tree.h"
#include "harts/step_plan.h"
#include "planner_test_util.h"

namespace harts {
namespace {

using testing::ExpectError;
using testing::ExportTree;
using testing::Tree;

void CheckSameForest(const SegmentForest& a, const SegmentForest& b) {
  CHECK(a.start == b.start && a.end == b.end && a.parent == b.parent);
  CHECK(a.subtree_end == b.subtree_end && a.owner == b.owner && a.row_begin == b.row_begin);
  CHECK(a.multiplicity == b.multiplicity && a.child_offsets == b.child_offsets && a.children == b.children);
  CHECK(a.end_offsets == b.end_offsets && a.ending == b.ending && a.roots == b.roots);
  CHECK(a.item_segment == b.item_segment);
  CHECK_EQ(a.num_rows, b.num_rows);
}

void CheckSameBatch(const RolloutBatch& a, const RolloutBatch& b) {
  CHECK_EQ(a.num_trajectories(), b.num_trajectories());
  CHECK_EQ(a.semantic_tokens(), b.semantic_tokens());
  CHECK_EQ(a.compact_tokens(), b.compact_tokens());
  CHECK(a.offsets() == b.offsets() && a.lengths() == b.lengths() && a.tree_ids() == b.tree_ids());
  CHECK(a.order() == b.order() && a.rank() == b.rank() && a.adjacent_lcp() == b.adjacent_lcp());
  CHECK(a.segment_root() == b.segment_root() && a.component() == b.component());
  CheckSameForest(a.forest(), b.forest());
  // Lazily built rows of b equal the eager rows of a.
  CHECK(a.row_of_position() == b.row_of_position() && a.multiplicity() == b.multiplicity());
  CHECK(a.row_parent() == b.row_parent() && a.row_depth() == b.row_depth() && a.row_segment() == b.row_segment());
  for (int64_t i = 0; i < a.num_trajectories(); ++i)
    for (int64_t j = 0; j < a.num_trajectories(); ++j) CHECK_EQ(a.Lcp(i, j), b.Lcp(i, j));
}

void CheckSamePlans(const RolloutBatch& a, const RolloutBatch& b, std::mt19937& rng) {
  int64_t longest = 0;
  for (int64_t l : a.lengths()) longest = std::max(longest, l);
  PlannerOptions o;
  o.dp_size = 1 + rng() % 2;
  o.capacity = longest + static_cast<int64_t>(rng() % (2 * longest + 1));
  if (a.num_trajectories() >= o.dp_size) {
    bool a_failed = false, b_failed = false;
    StepPlan pa, pb;
    try {
      pa = PlanStep(a, o);
    } catch (const FailedPrecondition&) {
      a_failed = true;
    }
    try {
      pb = PlanStep(b, o);
    } catch (const FailedPrecondition&) {
      b_failed = true;
    }
    CHECK_EQ(a_failed, b_failed);
    if (!a_failed) {
      CHECK(pa.member_offsets == pb.member_offsets && pa.members == pb.members && pa.work == pb.work);
      CHECK(pa.replica == pb.replica && pa.slot == pb.slot && pa.objective == pb.objective);
      CHECK_EQ(pa.source, pb.source);
      CHECK_EQ(pa.candidates.size(), pb.candidates.size());
    }
  }
  const int64_t chunk = 1 + rng() % 5;
  const MicrobatchCallPlan ca = PlanMicrobatch(a, nullptr, 0, chunk, 3);
  const MicrobatchCallPlan cb = PlanMicrobatch(b, nullptr, 0, chunk, 3);
  CheckSameForest(ca.forest, cb.forest);
  CHECK(ca.plan.sequence_round == cb.plan.sequence_round && ca.plan.chain == cb.plan.chain);
  CHECK(ca.layout.gather_index == cb.layout.gather_index && ca.row_to_global == cb.row_to_global);
  CHECK(ca.semantic_to_physical == cb.semantic_to_physical);
}

void RoundTripRandomBatches() {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 20);
    auto trajs = testing::RandomTrajectories(rng, n, 10, 3, trial % 4 == 0 ? 0.5 : 0.1);
    auto a = testing::MakeBatch(trajs);
    const Tree t = ExportTree(*a);
    auto b = RolloutBatch::FromSegmentTree(t.view(), nullptr, 0);
    CheckSameBatch(*a, *b);
    CheckSamePlans(*a, *b, rng);
  }
}

// Tokens spelling a tree: segment v holds (its rank among its siblings) + 1, then zeros;
// trajectory i follows the root path of trajectory_end[i].
std::vector<testing::Traj> Spell(const Tree& t) {
  const int64_t n = static_cast<int64_t>(t.parent.size());
  std::vector<int32_t> sibling_rank(n, 0);
  std::vector<int32_t> count(n + 1, 0);  // index parent + 1
  for (int64_t v = 0; v < n; ++v) sibling_rank[v] = count[t.parent[v] + 1]++;
  std::vector<testing::Traj> out;
  for (int32_t e : t.trajectory_end) {
    std::vector<int32_t> path;
    for (int32_t v = e; v >= 0; v = t.parent[v]) path.push_back(v);
    testing::Traj traj;
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      traj.push_back(sibling_rank[*it] + 1);
      traj.insert(traj.end(), t.length[*it] - 1, 0);
    }
    out.push_back(traj);
  }
  return out;
}

// A random tree with ids in any order and unary segments without ends.
Tree RandomTree(std::mt19937& rng) {
  const int v_count = 1 + static_cast<int>(rng() % 14);
  std::vector<int32_t> perm(v_count);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  Tree t;
  t.parent.assign(v_count, -1);
  t.length.resize(v_count);
  for (int k = 0; k < v_count; ++k) {  // perm[k]'s parent is some perm[j], j < k, or none
    const int j = static_cast<int>(rng() % (k + 1)) - 1;
    if (k > 0 && j >= 0 && rng() % 5) t.parent[perm[k]] = perm[j];
    t.length[perm[k]] = 1 + static_cast<int32_t>(rng() % 4);
  }
  std::vector<char> has_child(v_count, 0);
  for (int32_t p : t.parent)
    if (p >= 0) has_child[p] = 1;
  for (int v = 0; v < v_count; ++v)
    if (!has_child[v] || rng() % 4 == 0) t.trajectory_end.push_back(v);
  const int extra = static_cast<int>(rng() % 3);
  for (int k = 0; k < extra; ++k) t.trajectory_end.push_back(t.trajectory_end[rng() % t.trajectory_end.size()]);
  std::shuffle(t.trajectory_end.begin(), t.trajectory_end.end(), rng);
  return t;
}

// Random trees with ids in any order and unary segments without ends.
void NonCanonicalTrees() {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const Tree t = RandomTree(rng);
    auto a = testing::MakeBatch(Spell(t));
    auto b = RolloutBatch::FromSegmentTree(t.view(), nullptr, 0);
    CheckSameBatch(*a, *b);
    CheckSamePlans(*a, *b, rng);
  }
}

void CheckSameTopology(const SegmentForest& a, const SegmentForest& b) {
  CHECK(a.start == b.start && a.end == b.end && a.parent == b.parent && a.roots == b.roots);
  CHECK(a.child_offsets == b.child_offsets && a.children == b.children && a.row_begin == b.row_begin);
  CHECK_EQ(a.num_rows, b.num_rows);
}

// The two forms of segment_tree.h build the same topology: the length form of a batch's
// exported tree reproduces its canonical forest's topology, and the position form of any
// tree (ids in any order, unary segments) equals its length form, preorder included.
void BothFormsAgree() {
  std::mt19937 rng(23);
  for (int trial = 0; trial < 300; ++trial) {
    auto batch = testing::MakeBatch(testing::RandomTrajectories(rng, 1 + static_cast<int>(rng() % 20), 10, 3, 0.3));
    CheckSameTopology(SegmentForestFromTree(ExportTree(*batch).view()), batch->forest());

    const Tree t = RandomTree(rng);
    std::vector<int32_t> tree_order, forest_order;
    const SegmentForest from_tree = SegmentForestFromTree(t.view(), &tree_order);
    const int64_t v_count = static_cast<int64_t>(t.parent.size());
    const SegmentForest from_arrays = SegmentForestFromArrays(
        {t.parent.data(), v_count, from_tree.start.data(), v_count, from_tree.end.data(), v_count}, &forest_order);
    CheckSameTopology(from_tree, from_arrays);
    CHECK(tree_order == forest_order);
    for (int64_t v = 0; v < v_count; ++v) CHECK_EQ(from_tree.end[v] - from_tree.start[v], t.length[v]);
    // Rows follow the preorder.
    int64_t row = 0;
    for (int32_t v : tree_order) {
      CHECK_EQ(from_tree.row_begin[v], row);
      row += t.length[v];
    }
  }
}

void Errors() {
  auto build = [](Tree t) { return [t] { RolloutBatch::FromSegmentTree(t.view(), nullptr, 0); }; };
  ExpectError<InvalidArgument>(build({{}, {}, {0}}), "parent");
  ExpectError<InvalidArgument>(build({{-1}, {1}, {}}), "trajectory_end");
  ExpectError<InvalidArgument>(build({{-1, 5}, {1, 1}, {1}}), "parent[1]");  // dangling
  ExpectError<InvalidArgument>(build({{-1, -2}, {1, 1}, {1}}), "parent[1]");
  ExpectError<InvalidArgument>(build({{-1, 1}, {1, 1}, {0}}), "parent[1]");        // self loop
  ExpectError<InvalidArgument>(build({{-1, 2, 1}, {1, 1, 1}, {0}}), "parent[1]");  // 1 <-> 2 cycle
  ExpectError<InvalidArgument>(build({{-1, 0}, {1, 0}, {1}}), "length[1]");
  ExpectError<InvalidArgument>(build({{-1, 0}, {1, 1}, {2}}), "trajectory_end[0]");
  ExpectError<InvalidArgument>(build({{-1, 0}, {1, 1}, {-1}}), "trajectory_end[0]");
  ExpectError<InvalidArgument>(build({{-1, 0, 0}, {1, 1, 1}, {1}}), "trajectory_end");  // leaf 2 ends nothing
  ExpectError<InvalidArgument>(build({{-1, 0}, {1, 1, 1}, {1}}), "length");             // sizes differ
  ExpectError<InvalidArgument>(build({{-1, 0}, {1}, {1}}), "length");
  // Too many semantic tokens: two trajectories of 2^31 - 2 tokens each.
  const int32_t big = 1 << 30;
  ExpectError<ResourceExhausted>(build({{-1, 0}, {big, big - 2}, {1, 1}}), "trajectory_end[1]");
  Tree ok{{-1, 0}, {2, 3}, {1}};
  const int64_t bad_ids[] = {-4};
  ExpectError<InvalidArgument>([&] { RolloutBatch::FromSegmentTree(ok.view(), bad_ids, 1); }, "tree_ids[0]");
  ExpectError<InvalidArgument>([&] { RolloutBatch::FromSegmentTree(ok.view(), bad_ids, 2); }, "tree_ids");
  auto b = RolloutBatch::FromSegmentTree(ok.view(), nullptr, 0);
  CHECK_EQ(b->semantic_tokens(), 5);
  CHECK_EQ(b->compact_tokens(), 5);
  CHECK_EQ(b->forest().size(), 1);  // the unary root without an end merges with its child
}

}  // namespace
}  // namespace harts

int main() {
  harts::RoundTripRandomBatches();
  harts::NonCanonicalTrees();
  harts::BothFormsAgree();
  harts::Errors();
  std::printf("segment_tree_test: OK\n");
  return 0;
}
