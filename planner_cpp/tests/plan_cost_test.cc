// plan_cost.h against the planner itself: on random token batches, random non-canonical segment
// trees and bare forests, every exact call shape (tree, batch, forest) equals the shape of the
// plan actually made, the token bound is never below it, and every byte bound is never below the
// bytes the planner really allocates (a counting operator new, alloc_meter.h). Also: the
// partition bounds over random partitions, the step planner's bound over its options, the
// backstop (MaxPlanBytes) refusing a 2^31 - 1 token segment before allocating it, saturation,
// and the errors of the id and offset checks. Prints how tight the byte bounds are.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "alloc_meter.h"
#include "check.h"
#include "harts/call_layout.h"
#include "harts/errors.h"
#include "harts/plan_cost.h"
#include "harts/rollout_batch.h"
#include "harts/segment_tree.h"
#include "harts/step_plan.h"
#include "planner_test_util.h"

namespace harts {
namespace {

using testing::AllocMeter;
using testing::ExpectError;
using testing::ExportTree;
using testing::Tree;

// A random length-form tree, not canonical: ids in any order (a parent's id may exceed its
// child's), several roots, unary segments nobody ends at, trajectories ending inside paths and
// repeated ends.
Tree RandomTree(std::mt19937& rng, int v_count, int max_len) {
  Tree t;
  std::vector<int32_t> perm(v_count);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  t.parent.assign(v_count, -1);
  t.length.resize(v_count);
  std::vector<int> children(v_count, 0);
  for (int i = 1; i < v_count; ++i)
    if (rng() % 6 != 0) ++children[t.parent[perm[i]] = perm[rng() % i]];
  for (int v = 0; v < v_count; ++v) t.length[v] = 1 + static_cast<int32_t>(rng() % max_len);
  for (int v = 0; v < v_count; ++v) {
    if (children[v] == 0 || rng() % 3 == 0) t.trajectory_end.push_back(v);
    if (rng() % 8 == 0) t.trajectory_end.push_back(v);  // an identical trajectory
  }
  if (t.trajectory_end.empty()) t.trajectory_end.push_back(perm.back());
  std::shuffle(t.trajectory_end.begin(), t.trajectory_end.end(), rng);
  return t;
}

// The sizes of a real plan, as a CallShape (height and longest walk measured on it).
struct PlanSizes {
  CallShape shape;
  int64_t calls = 0, slots = 0;
};

PlanSizes SizesOf(const MicrobatchCallPlan& m) {
  PlanSizes p;
  CallShape& s = p.shape;
  const SegmentForest& f = m.forest;
  s.trajectories = static_cast<int64_t>(m.trajectories.size());
  s.semantic_tokens = static_cast<int64_t>(m.semantic_to_physical.size());
  s.segments = f.size();
  s.rows = f.num_rows;
  s.replay_rows = m.plan.replay_tokens;
  s.sequences = m.plan.num_sequences();
  s.roots = static_cast<int64_t>(f.roots.size());
  std::vector<int64_t> depth(f.size(), 0);
  for (const int32_t v : ParentsFirstOrder(f)) {
    depth[v] = (f.parent[v] < 0 ? 0 : depth[f.parent[v]]) + 1;
    s.height = std::max(s.height, depth[v]);
  }
  const int64_t ctx = m.layout.conv_width - 1;
  for (int64_t q = 0; q < s.sequences; ++q)
    s.longest_walk = std::max<int64_t>(
        s.longest_walk, m.plan.sequence_start[q] - std::max<int64_t>(0, m.plan.sequence_anchor[q] - ctx));
  p.calls = m.plan.num_calls;
  p.slots = m.plan.num_slots();
  return p;
}

void CheckExact(const CallShape& e, const PlanSizes& p) {
  const CallShape& s = p.shape;
  CHECK(e.exact);
  CHECK_EQ(e.trajectories, s.trajectories);
  CHECK_EQ(e.semantic_tokens, s.semantic_tokens);
  CHECK_EQ(e.segments, s.segments);
  CHECK_EQ(e.rows, s.rows);
  CHECK_EQ(e.replay_rows, s.replay_rows);
  CHECK_EQ(e.sequences, s.sequences);
  CHECK_EQ(e.roots, s.roots);
  CHECK_EQ(e.height, s.height);
  CHECK_EQ(e.state_slots, s.sequences - s.roots);
  CHECK(p.calls <= e.rounds());
  CHECK(p.slots <= e.state_slots);
  CHECK(s.longest_walk <= e.longest_walk);
}

void CheckBound(const CallShape& b, const PlanSizes& p) {
  const CallShape& s = p.shape;
  CHECK_EQ(b.trajectories, s.trajectories);
  CHECK_EQ(b.semantic_tokens, s.semantic_tokens);
  CHECK(s.segments <= b.segments && s.rows <= b.rows && s.replay_rows <= b.replay_rows);
  CHECK(s.sequences <= b.sequences && s.roots <= b.roots && p.calls <= b.rounds() && p.slots <= b.state_slots);
  CHECK(s.longest_walk <= b.longest_walk);
}

// Tightness of the byte bounds: the largest and smallest estimate / measured seen.
struct Tightness {
  const char* name;
  double worst = 0, best = 1e300;
  int64_t samples = 0;
  void Add(int64_t estimate, int64_t measured) {
    CHECK(measured <= estimate);
    if (measured < (int64_t{1} << 16)) return;  // small plans are all constants
    const double ratio = static_cast<double>(estimate) / static_cast<double>(measured);
    worst = std::max(worst, ratio);
    best = std::min(best, ratio);
    ++samples;
  }
  void Print() const {
    if (samples)
      std::printf("%-34s estimate / measured in [%.3f, %.3f] over %ld plans >= 64 KiB\n", name, best, worst,
                  static_cast<long>(samples));
  }
};

Tightness call_total{"call plan bytes (total)"}, call_retained{"call plan bytes (retained)"};
Tightness token_total{"call plan bytes (token bound)"}, tree_ingest{"tree ingest bytes"};
Tightness token_ingest{"token ingest bytes"}, row_arrays{"row array bytes"};
Tightness partition{"partition retained bytes"}, step_bytes{"step plan bytes"};

// Plans ids of `batch`, checks the shapes against the plan and the bytes against the allocations.
void CheckMicrobatch(const RolloutBatch& batch, const Tree& tree, const std::vector<int32_t>* ids, int64_t chunk,
                     int64_t conv, bool canonical_tree) {
  const int32_t* p = ids ? ids->data() : nullptr;
  const int64_t k = ids ? static_cast<int64_t>(ids->size()) : 0;
  PlanSizes sizes;
  int64_t peak, retained;
  {
    AllocMeter meter;
    const MicrobatchCallPlan m = PlanMicrobatch(batch, p, k, chunk, conv);
    retained = meter.live();
    peak = meter.peak();
    sizes = SizesOf(m);
  }
  const CallShape from_batch = BatchCallShape(batch, p, k, chunk, conv);
  int64_t canonical = -1;
  const CallShape from_tree = TreeCallShape(tree.view(), p, k, chunk, conv, &canonical);
  CheckExact(from_batch, sizes);
  CheckExact(from_tree, sizes);
  CHECK_EQ(canonical, batch.forest().size());
  if (canonical_tree) CHECK_EQ(canonical, tree.view().num_segments);
  const CallBytes bytes = CallPlanBytes(from_batch, chunk, conv);
  call_total.Add(bytes.total(), peak);
  call_retained.Add(bytes.retained, retained);
  // A token bound from the offsets of the batch.
  const CallShape bound = TokenCallShape(batch.semantic_tokens(), batch.offsets().data(),
                                         static_cast<int64_t>(batch.offsets().size()), p, k, chunk, conv);
  CHECK(!bound.exact);
  CheckBound(bound, sizes);
  token_total.Add(CallPlanBytes(bound, chunk, conv).total(), peak);
}

void TestShapesOfTokenBatches() {
  std::mt19937 rng(17);
  for (int iter = 0; iter < 250; ++iter) {
    const int n = 1 + static_cast<int>(rng() % 40);
    const int max_len = 1 + static_cast<int>(rng() % (iter % 4 == 0 ? 300 : 20));
    const auto trajs = testing::RandomTrajectories(rng, n, max_len, 2 + static_cast<int>(rng() % 4), 0.15);
    const auto batch = testing::MakeBatch(trajs);
    const Tree tree = ExportTree(*batch);
    const int64_t chunks[] = {1, 2, 3, 4, 7, 16, 64};
    const int64_t convs[] = {1, 2, 4, 9};
    const int64_t chunk = chunks[rng() % 7], conv = convs[rng() % 4];
    CheckMicrobatch(*batch, tree, nullptr, chunk, conv, true);
    for (int s = 0; s < 3; ++s) {
      std::vector<int32_t> ids(n);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      ids.resize(1 + rng() % n);
      CheckMicrobatch(*batch, tree, &ids, chunk, conv, true);
    }
  }
}

void TestShapesOfSegmentTrees() {
  std::mt19937 rng(29);
  for (int iter = 0; iter < 200; ++iter) {
    const Tree tree = RandomTree(rng, 1 + static_cast<int>(rng() % 30), iter % 5 == 0 ? 500 : 12);
    const auto batch = RolloutBatch::FromSegmentTree(tree.view(), nullptr, 0);
    const int n = static_cast<int>(tree.trajectory_end.size());
    const int64_t chunk = 1 + rng() % 40, conv = 1 + rng() % 6;
    CheckMicrobatch(*batch, tree, nullptr, chunk, conv, false);
    std::vector<int32_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(1 + rng() % n);
    CheckMicrobatch(*batch, tree, &ids, chunk, conv, false);
    CHECK(!batch->rows_built());  // call planning never builds the per-row arrays
  }
}

// Bare forests (position form, ids kept, unary segments kept): ForestCallShape is exact.
void TestShapesOfBareForests() {
  std::mt19937 rng(31);
  for (int iter = 0; iter < 200; ++iter) {
    const Tree tree = RandomTree(rng, 1 + static_cast<int>(rng() % 30), iter % 5 == 0 ? 300 : 10);
    const SegmentForest topology = SegmentForestFromTree(tree.view());
    const SegmentForestView view{topology.parent.data(), topology.size(),     topology.start.data(),
                                 topology.size(),        topology.end.data(), topology.size()};
    const int64_t chunk = 1 + rng() % 40, conv = 1 + rng() % 6;
    SegmentForest forest = SegmentForestFromArrays(view);
    const CallShape shape = ForestCallShape(forest, chunk, conv);
    PlanSizes sizes;
    int64_t peak, retained;
    {
      AllocMeter meter;  // the forest exists already: it is the caller's
      const MicrobatchCallPlan m = PlanSegmentForest(std::move(forest), chunk, conv);
      retained = meter.live();
      peak = meter.peak();
      sizes = SizesOf(m);
    }
    CheckExact(shape, sizes);
    CHECK(!shape.batch_links);
    const CallBytes bytes = CallPlanBytes(shape, chunk, conv);
    call_total.Add(bytes.total(), peak);
    call_retained.Add(bytes.retained, retained);
  }
}

void TestIngestBytes() {
  std::mt19937 rng(37);
  for (int iter = 0; iter < 200; ++iter) {
    const int n = 1 + static_cast<int>(rng() % (iter % 10 == 0 ? 3000 : 60));
    const auto trajs = testing::RandomTrajectories(rng, n, 1 + static_cast<int>(rng() % 200), 3, 0.1);
    std::vector<int32_t> tokens;
    std::vector<int64_t> offsets = {0};
    for (const auto& t : trajs) {
      tokens.insert(tokens.end(), t.begin(), t.end());
      offsets.push_back(static_cast<int64_t>(tokens.size()));
    }
    int64_t peak;
    std::unique_ptr<RolloutBatch> batch;
    {
      AllocMeter meter;
      batch = RolloutBatch::Ingest(tokens.data(), tokens.size(), offsets.data(), offsets.size(), nullptr, 0);
      peak = meter.peak();
    }
    const int64_t s = batch->semantic_tokens(), c = batch->compact_tokens(), vc = batch->forest().size();
    token_ingest.Add(TokenIngestBytes(n, s, c, vc), peak);
    CHECK(peak <= TokenIngestBytes(n, s, s, 2 * n));  // the bounds before ingestion
    const Tree tree = ExportTree(*batch);
    std::unique_ptr<RolloutBatch> from_tree;
    {
      AllocMeter meter;
      from_tree = RolloutBatch::FromSegmentTree(tree.view(), nullptr, 0);
      peak = meter.peak();
    }
    tree_ingest.Add(TreeIngestBytes(tree.view().num_segments, n, vc), peak);
    CHECK(peak <= TreeIngestBytes(tree.view().num_segments, n, 2 * n));
    {
      AllocMeter meter;
      CHECK(!from_tree->rows_built());
      from_tree->row_of_position();
      CHECK(from_tree->rows_built());
      row_arrays.Add(RowArraysBytes(s, c), meter.peak());
    }
  }
}

// The call plans of random partitions of a batch stay within the partition shape and bytes.
void TestPartitionBounds() {
  std::mt19937 rng(41);
  for (int iter = 0; iter < 150; ++iter) {
    const int n = 1 + static_cast<int>(rng() % 50);
    const auto trajs = testing::RandomTrajectories(rng, n, 1 + static_cast<int>(rng() % 100), 3, 0.1);
    const auto batch = testing::MakeBatch(trajs);
    const Tree tree = ExportTree(*batch);
    const int64_t chunk = 1 + rng() % 30, conv = 1 + rng() % 5;
    std::vector<int32_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    const int parts = 1 + static_cast<int>(rng() % n);
    std::vector<std::vector<int32_t>> groups(parts);
    for (int j = 0; j < n; ++j) groups[j < parts ? j : rng() % parts].push_back(ids[j]);
    CallShape sum;
    int64_t calls = 0, slots = 0, retained;
    {
      AllocMeter meter;
      std::vector<MicrobatchCallPlan> plans;
      for (const auto& g : groups)
        plans.push_back(PlanMicrobatch(*batch, g.data(), static_cast<int64_t>(g.size()), chunk, conv));
      retained = meter.live();
      for (const MicrobatchCallPlan& m : plans) {
        const PlanSizes p = SizesOf(m);
        sum.rows += p.shape.rows;
        sum.replay_rows += p.shape.replay_rows;
        sum.segments += p.shape.segments;
        sum.sequences += p.shape.sequences;
        sum.roots += p.shape.roots;
        sum.semantic_tokens += p.shape.semantic_tokens;
        sum.longest_walk = std::max(sum.longest_walk, p.shape.longest_walk);
        calls += p.calls;
        slots += p.slots;
      }
    }
    const CallShape from_tree = TreePartitionCallShape(tree.view(), chunk, conv);
    const CallShape from_batch = BatchPartitionCallShape(*batch, chunk, conv);
    for (const CallShape& b : {from_tree, from_batch}) {
      CHECK(!b.exact && b.batch_links);
      CHECK_EQ(b.trajectories, n);
      CHECK_EQ(b.semantic_tokens, sum.semantic_tokens);
      CHECK(sum.rows <= b.rows && sum.replay_rows <= b.replay_rows && sum.segments <= b.segments);
      CHECK(sum.sequences <= b.sequences && sum.roots <= b.roots && calls <= b.rounds() && slots <= b.state_slots);
      CHECK(sum.longest_walk <= b.longest_walk);
    }
    CHECK_EQ(from_tree.replay_rows, from_batch.replay_rows);
    partition.Add(PartitionRetainedBytes(from_batch, parts, chunk, conv), retained);
  }
}

void TestStepPlanBytes() {
  std::mt19937 rng(43);
  for (int iter = 0; iter < 60; ++iter) {
    const int n = 2 + static_cast<int>(rng() % (iter % 6 == 0 ? 2000 : 500));
    const auto trajs = testing::RandomTrajectories(rng, n, 1 + static_cast<int>(rng() % 80), 4, 0.1);
    const auto batch = testing::MakeBatch(trajs);
    int64_t longest = 0;
    for (const auto& t : trajs) longest = std::max<int64_t>(longest, static_cast<int64_t>(t.size()));
    PlannerOptions o;
    o.dp_size = 1 + rng() % 3;
    o.capacity = longest * (1 + rng() % 6);
    const int64_t sampled[] = {2, 32, 200, 100000};
    o.max_sampled_k = sampled[rng() % 4];
    o.refine_window = o.repair_window = 1 + rng() % 64;
    o.max_anchors = 1 + rng() % 8;
    const char* modes[] = {"auto", "heuristic", "exact"};
    o.search = modes[rng() % 3];
    if (o.search == "exact" && n > 400) o.search = "auto";
    int64_t peak;
    {
      AllocMeter meter;
      try {
        PlanStep(*batch, o);
      } catch (const Error&) {  // infeasible: the bound still holds for what was allocated
      }
      peak = meter.peak();
    }
    step_bytes.Add(StepPlanBytes(n, batch->forest().size(), o), peak);
  }
}

// The backstop: a 26-byte request's tree, one segment of 2^31 - 1 tokens, is refused before its
// plan allocates anything of its size; a small limit refuses small plans, naming the field.
void TestBackstop() {
  Tree huge;
  huge.parent = {-1};
  huge.length = {std::numeric_limits<int32_t>::max()};
  huge.trajectory_end = {0};
  const auto batch = RolloutBatch::FromSegmentTree(huge.view(), nullptr, 0);
  const CallShape shape = TreeCallShape(huge.view(), nullptr, 0, 64, 4);
  CHECK_EQ(shape.rows, std::numeric_limits<int32_t>::max());
  CHECK(CallPlanBytes(shape, 64, 4).total() > MaxPlanBytes());
  {
    AllocMeter meter;
    ExpectError<ResourceExhausted>([&] { PlanMicrobatch(*batch, nullptr, 0, 64, 4); }, "trajectories");
    CHECK(meter.peak() < (int64_t{1} << 20));
  }
  {
    AllocMeter meter;  // the per-row arrays (4 S + 16 C bytes = 40 GB) are refused the same way
    ExpectError<ResourceExhausted>([&] { batch->row_of_position(); }, "length");
    CHECK(!batch->rows_built());
    CHECK(meter.peak() < (int64_t{1} << 20));
  }
  const auto small = testing::MakeBatch({{1, 2, 3}, {1, 2, 4}});
  const int64_t previous = SetMaxPlanBytes(80);
  const std::vector<int32_t> tokens = {1, 2, 3, 1, 2, 4};
  const std::vector<int64_t> offsets = {0, 3, 6};
  ExpectError<ResourceExhausted>([&] { RolloutBatch::Ingest(tokens.data(), 6, offsets.data(), 3, nullptr, 0); },
                                 "tokens");
  CHECK_EQ(previous, kDefaultMaxPlanBytes);
  ExpectError<ResourceExhausted>([&] { PlanMicrobatch(*small, nullptr, 0, 64, 4); }, "trajectories");
  const SegmentForest f = SegmentForestFromTree(ExportTree(*small).view());
  ExpectError<ResourceExhausted>([&] { PlanSegmentForest(f, 64, 4); }, "end");
  CHECK_EQ(SetMaxPlanBytes(previous), 80);
  PlanMicrobatch(*small, nullptr, 0, 64, 4);  // fits again
  ExpectError<InvalidArgument>([] { SetMaxPlanBytes(0); }, "max_plan_bytes");
  CHECK_EQ(MaxPlanBytes(), kDefaultMaxPlanBytes);
}

// No request can overflow a cost: the largest shapes saturate at kMaxCost.
void TestSaturation() {
  CallShape s;
  s.trajectories = s.semantic_tokens = s.segments = s.rows = s.replay_rows = kMaxCost;
  s.sequences = s.roots = s.height = s.state_slots = s.longest_walk = kMaxCost;
  const CallBytes b = CallPlanBytes(s, kMaxChunkSize, 1024);
  CHECK_EQ(b.total(), kMaxCost);
  CHECK_EQ(TreeIngestBytes(kMaxCost, kMaxCost, kMaxCost), kMaxCost);
  CHECK_EQ(TokenIngestBytes(kMaxCost, kMaxCost, kMaxCost, kMaxCost), kMaxCost);
  PlannerOptions o;
  o.max_sampled_k = std::numeric_limits<int64_t>::max();
  CHECK_EQ(StepPlanBytes(kMaxCost, kMaxCost, o), kMaxCost);
  CHECK_EQ(PartitionRetainedBytes(s, kMaxCost, kMaxChunkSize, 1024), kMaxCost);
}

void TestErrors() {
  const auto batch = testing::MakeBatch({{1, 2, 3}, {1, 2, 4}, {5}});
  const Tree tree = ExportTree(*batch);
  const std::vector<int32_t> out = {0, 3}, negative = {-1}, repeated = {1, 1};
  for (const auto* ids : {&out, &negative}) {
    const std::string field = ids == &out ? "trajectories[1]" : "trajectories[0]";
    ExpectError<InvalidArgument>([&] { BatchCallShape(*batch, ids->data(), ids->size(), 64, 4); }, field);
    ExpectError<InvalidArgument>([&] { TreeCallShape(tree.view(), ids->data(), ids->size(), 64, 4); }, field);
    ExpectError<InvalidArgument>([&] { CheckMicrobatchIds(ids->data(), ids->size(), 3); }, field);
  }
  ExpectError<InvalidArgument>([&] { TreeCallShape(tree.view(), repeated.data(), 2, 64, 4); }, "trajectories");
  ExpectError<InvalidArgument>([&] { BatchCallShape(*batch, repeated.data(), 2, 64, 4); }, "trajectories");
  ExpectError<InvalidArgument>([&] { TreeCallShape(tree.view(), repeated.data(), 0, 64, 4); }, "trajectories");
  ExpectError<InvalidArgument>([&] { TreeCallShape(tree.view(), nullptr, 0, 0, 4); }, "chunk_size");
  ExpectError<InvalidArgument>([&] { BatchCallShape(*batch, nullptr, 0, 64, 0); }, "conv_width");
  Tree cyclic = tree;
  cyclic.parent[0] = 1;
  cyclic.parent[1] = 0;
  ExpectError<InvalidArgument>([&] { TreeCallShape(cyclic.view(), nullptr, 0, 64, 4); }, "parent[0]");
  // Token shapes check the offsets as ValidateTrajectories does.
  const std::vector<int64_t> good = {0, 3, 6, 7}, empty = {0, 3, 3, 7}, short_end = {0, 3, 6, 6};
  TokenCallShape(7, good.data(), 4, nullptr, 0, 64, 4);
  ExpectError<InvalidArgument>([&] { TokenCallShape(7, empty.data(), 4, nullptr, 0, 64, 4); }, "offsets[2]");
  ExpectError<InvalidArgument>([&] { TokenCallShape(7, short_end.data(), 4, nullptr, 0, 64, 4); }, "offsets[3]");
  ExpectError<InvalidArgument>([&] { TokenCallShape(7, good.data(), 1, nullptr, 0, 64, 4); }, "offsets");
  ExpectError<InvalidArgument>([&] { TokenCallShape(7, good.data(), 4, out.data(), 2, 64, 4); }, "trajectories[1]");
  const std::vector<int64_t> too_many = {0, int64_t{1} << 31};
  ExpectError<ResourceExhausted>([&] { TokenCallShape(int64_t{1} << 31, too_many.data(), 2, nullptr, 0, 64, 4); },
                                 "tokens");
}

}  // namespace
}  // namespace harts

int main() {
  harts::TestErrors();
  harts::TestSaturation();
  harts::TestBackstop();
  harts::TestShapesOfTokenBatches();
  harts::TestShapesOfSegmentTrees();
  harts::TestShapesOfBareForests();
  harts::TestIngestBytes();
  harts::TestPartitionBounds();
  harts::TestStepPlanBytes();
  for (const auto* t : {&harts::call_total, &harts::call_retained, &harts::token_total, &harts::tree_ingest,
                        &harts::token_ingest, &harts::row_arrays, &harts::partition, &harts::step_bytes})
    t->Print();
  std::printf("plan_cost_test: OK\n");
  return 0;
}
