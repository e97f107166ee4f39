// Cooperative cancellation (cancel.h) through every long entry point of ingestion, Algorithm 1,
// the layout and the cost model: the token's own contract; a cancelled token stops each entry
// point with Cancelled("cancelled"); an expired deadline with Cancelled("deadline") (at once where
// the entry point checks the clock at a phase boundary, within kClockStride polls elsewhere); a
// token that never fires changes no plan. Cancellation from another thread while a plan runs is
// tested from Python (tests/planner/test_cancel.py), where the GIL release is checked too.
#include "harts/cancel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "harts/call_layout.h"
#include "harts/lex_order.h"
#include "harts/min_call.h"
#include "harts/plan_cost.h"
#include "harts/rmq.h"
#include "harts/rollout_batch.h"
#include "harts/segment_forest.h"
#include "harts/segment_tree.h"
#include "planner_test_util.h"

namespace harts {
namespace {

using testing::ExpectError;

void TestTokenContract() {
  CancelToken token;
  for (int i = 0; i < 1000; ++i) token.Poll();  // no deadline, not cancelled
  token.Check();
  Poll(nullptr);
  Check(nullptr);
  CHECK(!token.cancel_requested());
  token.SetDeadlineAfter(std::chrono::hours(1));
  for (int i = 0; i < 1000; ++i) token.Poll();
  token.Cancel();
  CHECK(token.cancel_requested());
  try {
    token.Poll();
    CHECK(false);
  } catch (const Cancelled& e) {
    CHECK_EQ(e.field(), std::string("cancelled"));
    CHECK(!e.deadline_exceeded());
    CHECK(dynamic_cast<const Error*>(&e) != nullptr);
  }
  CancelToken late;
  late.SetDeadline(CancelToken::Clock::now() - std::chrono::seconds(1));
  ExpectError<Cancelled>([&] { late.Check(); }, "deadline");
  // Poll reads the clock once every kClockStride calls: the expired deadline fires within them.
  CancelToken stride;
  stride.SetDeadline(CancelToken::Clock::now() - std::chrono::seconds(1));
  int polls = 0;
  try {
    for (; polls <= static_cast<int>(CancelToken::kClockStride); ++polls) stride.Poll();
    CHECK(false);
  } catch (const Cancelled& e) {
    CHECK(e.deadline_exceeded());
  }
  CHECK(polls < static_cast<int>(CancelToken::kClockStride));
  // ForEachBlock visits every index once and polls before each block.
  std::vector<int> seen(3 * kPollBlock + 5, 0);
  ForEachBlock(0, static_cast<int64_t>(seen.size()), nullptr, [&](int64_t i) { ++seen[i]; });
  for (int s : seen) CHECK_EQ(s, 1);
  CancelToken stop;
  stop.Cancel();
  ExpectError<Cancelled>([&] { ForEachBlock(0, 1, &stop, [](int64_t) {}); }, "cancelled");
  ForEachBlock(0, 0, &stop, [](int64_t) { CHECK(false); });  // an empty range never polls
}

struct Inputs {
  std::vector<testing::Traj> trajs;
  std::vector<int32_t> tokens;
  std::vector<int64_t> offsets;
  std::unique_ptr<RolloutBatch> batch;
  std::vector<int32_t> parent, length, ends;
  SegmentTreeView tree;
  SegmentForestView forest_view;
  SegmentForest forest;
};

// n random trajectories and their batch, tree and (position-form) forest.
std::unique_ptr<Inputs> MakeInputs(int n, int seed) {
  auto in = std::make_unique<Inputs>();
  std::mt19937 rng(seed);
  in->trajs = testing::RandomTrajectories(rng, n, 60, 3, 0.1);
  in->offsets = {0};
  for (const auto& t : in->trajs) {
    in->tokens.insert(in->tokens.end(), t.begin(), t.end());
    in->offsets.push_back(static_cast<int64_t>(in->tokens.size()));
  }
  in->batch =
      RolloutBatch::Ingest(in->tokens.data(), in->tokens.size(), in->offsets.data(), in->offsets.size(), nullptr, 0);
  const SegmentForest& f = in->batch->forest();
  in->parent = f.parent;
  for (int64_t v = 0; v < f.size(); ++v) in->length.push_back(f.end[v] - f.start[v]);
  in->ends.resize(n);
  for (int64_t r = 0; r < n; ++r) in->ends[in->batch->order()[r]] = f.item_segment[r];
  in->tree = {in->parent.data(), f.size(), in->length.data(), f.size(), in->ends.data(), n};
  in->forest_view = {f.parent.data(), f.size(), f.start.data(), f.size(), f.end.data(), f.size()};
  in->forest = SegmentForestFromArrays(in->forest_view);
  return in;
}

// Every long entry point, run with `token`.
std::vector<std::pair<std::string, std::function<void(CancelToken*)>>> EntryPoints(const Inputs& in) {
  const RolloutBatch& b = *in.batch;
  const TrajectoryView view{in.tokens.data(), in.offsets.data(), static_cast<int64_t>(in.trajs.size())};
  const int64_t n = b.num_trajectories();
  std::vector<int64_t> lengths(n);
  for (int64_t r = 0; r < n; ++r) lengths[r] = b.lengths()[b.order()[r]];
  const std::vector<int32_t> ids = {0, static_cast<int32_t>(n - 1)};
  const SegmentForest& f = in.forest;
  return {
      {"ValidateTrajectories",
       [&in](CancelToken* t) {
         ValidateTrajectories(in.tokens.data(), in.tokens.size(), in.offsets.data(), in.offsets.size(), nullptr, 0, t);
       }},
      {"LexicographicOrder", [view](CancelToken* t) { LexicographicOrder(view, t); }},
      {"AdjacentLcp", [view, &b](CancelToken* t) { AdjacentLcp(view, b.order(), t); }},
      {"SparseTableRmq", [&b](CancelToken* t) { SparseTableRmq(b.adjacent_lcp(), t); }},
      {"BuildSegmentForest",
       [&b, lengths](CancelToken* t) {
         BuildSegmentForest(b.order().data(), lengths.data(), b.adjacent_lcp().data(), b.num_trajectories(), t);
       }},
      {"Ingest",
       [&in](CancelToken* t) {
         RolloutBatch::Ingest(in.tokens.data(), in.tokens.size(), in.offsets.data(), in.offsets.size(), nullptr, 0, t);
       }},
      {"SegmentForestFromTree", [&in](CancelToken* t) { SegmentForestFromTree(in.tree, nullptr, t); }},
      {"SegmentForestFromArrays", [&in](CancelToken* t) { SegmentForestFromArrays(in.forest_view, nullptr, t); }},
      {"FromSegmentTree", [&in](CancelToken* t) { RolloutBatch::FromSegmentTree(in.tree, nullptr, 0, t); }},
      {"ComputeMinCallCounts", [&f](CancelToken* t) { ComputeMinCallCounts(f, 4, t); }},
      {"RecoverContinuations", [&f](CancelToken* t) { RecoverContinuations(f, 4, ComputeMinCallCounts(f, 4), t); }},
      {"AssignSequences",
       [&f](CancelToken* t) {
         MinCallCounts c = ComputeMinCallCounts(f, 4);
         MinCallRecovery r = RecoverContinuations(f, 4, c);
         AssignSequences(f, 4, std::move(c), std::move(r), t);
       }},
      {"PlanMinCalls", [&f](CancelToken* t) { PlanMinCalls(f, 4, t); }},
      {"BuildCallLayout", [&f](CancelToken* t) { BuildCallLayout(f, PlanMinCalls(f, 4), 4, t); }},
      {"PlanSegmentForest", [&f](CancelToken* t) { PlanSegmentForest(f, 4, 4, t); }},
      {"PlanMicrobatch", [&b](CancelToken* t) { PlanMicrobatch(b, nullptr, 0, 4, 4, t); }},
      {"PlanMicrobatch(ids)", [&b, ids](CancelToken* t) { PlanMicrobatch(b, ids.data(), 2, 4, 4, t); }},
      {"TreeCallShape", [&in](CancelToken* t) { TreeCallShape(in.tree, nullptr, 0, 4, 4, nullptr, t); }},
      {"BatchCallShape", [&b](CancelToken* t) { BatchCallShape(b, nullptr, 0, 4, 4, t); }},
      {"TreePartitionCallShape", [&in](CancelToken* t) { TreePartitionCallShape(in.tree, 4, 4, t); }},
  };
}

void TestCancelledTokenStopsEveryEntryPoint() {
  const auto in = MakeInputs(50, 1);
  for (const auto& [name, run] : EntryPoints(*in)) {
    CancelToken token;
    token.Cancel();
    try {
      run(&token);
      std::fprintf(stderr, "%s ignored a cancelled token\n", name.c_str());
      CHECK(false);
    } catch (const Cancelled& e) {
      CHECK_EQ(e.field(), std::string("cancelled"));
    }
    run(nullptr);  // and runs without one
  }
}

// An expired deadline stops every entry point: on a batch large enough that each polls more than
// kClockStride times (or checks the clock at a phase boundary).
void TestExpiredDeadlineStopsEveryEntryPoint() {
  const auto in = MakeInputs(3000, 2);
  for (const auto& [name, run] : EntryPoints(*in)) {
    CancelToken token;
    token.SetDeadline(CancelToken::Clock::now() - std::chrono::milliseconds(1));
    try {
      run(&token);
      std::fprintf(stderr, "%s ignored an expired deadline\n", name.c_str());
      CHECK(false);
    } catch (const Cancelled& e) {
      CHECK(e.deadline_exceeded());
    }
  }
}

// A token that never fires (no deadline, or a distant one) gives the same plans as none.
void TestQuietTokenChangesNothing() {
  const auto in = MakeInputs(200, 3);
  CancelToken quiet;
  quiet.SetDeadlineAfter(std::chrono::hours(1));
  const auto batch = RolloutBatch::FromSegmentTree(in->tree, nullptr, 0, &quiet);
  const auto plain = RolloutBatch::FromSegmentTree(in->tree, nullptr, 0);
  CHECK(batch->order() == plain->order() && batch->adjacent_lcp() == plain->adjacent_lcp());
  const auto ingested = RolloutBatch::Ingest(in->tokens.data(), in->tokens.size(), in->offsets.data(),
                                             in->offsets.size(), nullptr, 0, &quiet);
  CHECK(ingested->row_of_position() == in->batch->row_of_position());
  const std::vector<int32_t> ids = {3, 1, 4, 15, 9, 2, 6};
  const MicrobatchCallPlan a = PlanMicrobatch(*batch, ids.data(), 7, 8, 3, &quiet);
  const MicrobatchCallPlan b = PlanMicrobatch(*plain, ids.data(), 7, 8, 3);
  CHECK(a.layout.gather_index == b.layout.gather_index && a.layout.cu_seqlens == b.layout.cu_seqlens);
  CHECK(a.plan.chain == b.plan.chain && a.row_to_global == b.row_to_global);
  CHECK(a.semantic_to_physical == b.semantic_to_physical && a.layout.conv_context == b.layout.conv_context);
  const MicrobatchCallPlan c = PlanSegmentForest(in->forest, 5, 2, &quiet);
  const MicrobatchCallPlan d = PlanSegmentForest(in->forest, 5, 2);
  CHECK(c.layout.gather_index == d.layout.gather_index && c.plan.t_pre == d.plan.t_pre);
}

// StableSortPolled is std::stable_sort (ties included) on either side of the chunk size, and a
// cancelled token stops it with every element still present.
void TestStableSortPolled() {
  std::mt19937 rng(5);
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{100}, kPollChunk - 1, kPollChunk, kPollChunk + 1,
                          3 * kPollChunk + 17, 9 * kPollChunk}) {
    std::vector<int32_t> keys(n);
    for (int32_t& k : keys) k = static_cast<int32_t>(rng() % 50);  // many ties
    std::vector<int32_t> expect(n), got(n);
    std::iota(expect.begin(), expect.end(), 0);
    std::iota(got.begin(), got.end(), 0);
    const auto by_key = [&](int32_t a, int32_t b) { return keys[a] > keys[b]; };
    std::stable_sort(expect.begin(), expect.end(), by_key);
    CancelToken quiet;
    StableSortPolled(&got, by_key, &quiet);
    CHECK(got == expect);
    if (n > 0) {
      CancelToken stop;
      stop.Cancel();
      std::vector<int32_t> stopped(n);
      std::iota(stopped.begin(), stopped.end(), 0);
      ExpectError<Cancelled>([&] { StableSortPolled(&stopped, by_key, &stop); }, "cancelled");
      std::sort(stopped.begin(), stopped.end());
      for (int64_t i = 0; i < n; ++i) CHECK_EQ(stopped[i], static_cast<int32_t>(i));
    }
  }
}

// Disposable: a normal exit destroys here; an exception unwinding the scope hands the object to
// a background thread (destroyed soon after, not before the exception is caught).
struct Probe {
  explicit Probe(std::atomic<int>* destroyed) : destroyed(destroyed) {}
  ~Probe() { destroyed->fetch_add(1); }
  std::atomic<int>* destroyed;
};

void TestDisposable() {
  std::atomic<int> destroyed{0};
  {
    Disposable<Probe> p(&destroyed);
  }
  CHECK_EQ(destroyed.load(), 1);
  try {
    Disposable<Probe> p(&destroyed);
    throw Cancelled("cancelled", "stop");
  } catch (const Cancelled&) {
  }
  for (int i = 0; i < 2000 && destroyed.load() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK_EQ(destroyed.load(), 2);
}

}  // namespace
}  // namespace harts

int main() {
  harts::TestStableSortPolled();
  harts::TestDisposable();
  harts::TestTokenContract();
  harts::TestCancelledTokenStopsEveryEntryPoint();
  harts::TestExpiredDeadlineStopsEveryEntryPoint();
  harts::TestQuietTokenChangesNothing();
  std::printf("cancel_test: OK\n");
  return 0;
}
