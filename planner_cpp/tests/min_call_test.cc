// Minimum-call planner against a brute force over every choice of direct continuations
// (earliest-start scheduling) on random small forests; plan invariants; the paper's Figure 2
// and its boundary cases; unary-segment invariance; deep chains; input errors.
#include "harts/min_call.h"

#include <algorithm>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "harts/errors.h"
#include "harts/segment_tree.h"

namespace harts {
namespace {

using testing::ExpectError;

struct Tree {
  std::vector<int32_t> parent, start, end;
  SegmentForest Forest() const {
    return SegmentForestFromArrays({parent.data(), static_cast<int64_t>(parent.size()), start.data(),
                                    static_cast<int64_t>(start.size()), end.data(), static_cast<int64_t>(end.size())});
  }
};

// Random forest with parent[v] < v; lengths in [1, max_len].
Tree RandomTree(std::mt19937& rng, int n, int max_len, double new_root) {
  Tree t;
  for (int v = 0; v < n; ++v) {
    const bool root = v == 0 || std::uniform_real_distribution<>(0, 1)(rng) < new_root;
    const int32_t p = root ? -1 : std::uniform_int_distribution<int32_t>(0, v - 1)(rng);
    const int32_t s = root ? 0 : t.end[p];
    t.parent.push_back(p);
    t.start.push_back(s);
    t.end.push_back(s + std::uniform_int_distribution<int32_t>(1, max_len)(rng));
  }
  return t;
}

// Rounds (1-based) of every segment for fixed direct choices, scheduling each new sequence
// as early as its initial state allows. The producer of S_b is the sequence outputting the
// row at position b - 1 on the path (found by walking up position by position).
std::vector<int> EarliestRounds(const SegmentForest& f, const std::vector<int32_t>& direct, int64_t chunk) {
  const int64_t n = f.size();
  std::vector<int> round(n, 0);
  // parent < child in these trees, so increasing ids are parents-first.
  for (int64_t v = 0; v < n; ++v) {
    const int32_t p = f.parent[v];
    if (p >= 0 && direct[p] == v) {
      round[v] = round[p];
      continue;
    }
    const int64_t b = Anchor(f.start[v], chunk);
    if (b == 0) {
      round[v] = 1;
      continue;
    }
    int32_t w = p;
    while (b - 1 < f.start[w]) w = f.parent[w];
    round[v] = round[w] + 1;
  }
  return round;
}

int BruteForceCalls(const SegmentForest& f, int64_t chunk) {
  const int64_t n = f.size();
  std::vector<int32_t> internal;
  for (int64_t v = 0; v < n; ++v)
    if (f.num_children(v) > 0) internal.push_back(static_cast<int32_t>(v));
  std::vector<int64_t> pick(internal.size(), 0);
  std::vector<int32_t> direct(n, -1);
  int best = 1 << 30;
  for (;;) {
    for (size_t i = 0; i < internal.size(); ++i)
      direct[internal[i]] = f.children[f.child_offsets[internal[i]] + pick[i]];
    const std::vector<int> round = EarliestRounds(f, direct, chunk);
    best = std::min(best, *std::max_element(round.begin(), round.end()));
    size_t i = 0;
    while (i < internal.size() && ++pick[i] == f.num_children(internal[i])) pick[i++] = 0;
    if (i == internal.size()) break;
  }
  return best;
}

// Checks a plan's invariants independently of the planner's internals.
void CheckPlan(const SegmentForest& f, const MinCallPlan& p, int64_t chunk) {
  const int64_t n = f.size();
  const int64_t q_count = p.num_sequences();
  // Every segment in exactly one chain; chains follow direct_child and end at a leaf.
  std::vector<int> seen(n, 0);
  CHECK_EQ(static_cast<int64_t>(p.chain.size()), n);
  for (int64_t q = 0; q < q_count; ++q) {
    CHECK(p.chain_offsets[q] < p.chain_offsets[q + 1]);
    for (int32_t i = p.chain_offsets[q]; i < p.chain_offsets[q + 1]; ++i) {
      const int32_t v = p.chain[i];
      ++seen[v];
      CHECK_EQ(p.segment_sequence[v], static_cast<int32_t>(q));
      if (i + 1 < p.chain_offsets[q + 1]) {
        CHECK_EQ(p.direct_child[v], p.chain[i + 1]);
        CHECK_EQ(f.parent[p.chain[i + 1]], v);
      } else {
        CHECK_EQ(f.num_children(v), int64_t{0});
      }
    }
    const int32_t head = p.chain[p.chain_offsets[q]];
    CHECK(f.parent[head] < 0 || p.direct_child[f.parent[head]] != head);
    CHECK_EQ(p.sequence_start[q], f.start[head]);
    CHECK_EQ(static_cast<int64_t>(p.sequence_anchor[q]), Anchor(f.start[head], chunk));
    CHECK(q == 0 || p.sequence_round[q - 1] <= p.sequence_round[q]);
  }
  for (int64_t v = 0; v < n; ++v) CHECK_EQ(seen[v], 1);
  // One direct child per internal segment.
  for (int64_t v = 0; v < n; ++v) {
    if (f.num_children(v) == 0) {
      CHECK_EQ(p.direct_child[v], -1);
    } else {
      CHECK_EQ(f.parent[p.direct_child[v]], static_cast<int32_t>(v));
    }
  }
  // Initial states: produced at exactly the anchor, by the sequence outputting position b - 1
  // on the path, in an earlier round.
  for (int64_t q = 0; q < q_count; ++q) {
    const int32_t head = p.chain[p.chain_offsets[q]];
    const int32_t b = p.sequence_anchor[q];
    if (b == 0) {
      CHECK_EQ(p.sequence_slot[q], -1);
      continue;
    }
    const int32_t slot = p.sequence_slot[q];
    CHECK(slot >= 0 && slot < p.num_slots());
    CHECK_EQ(p.slot_position[slot], b);
    int32_t w = f.parent[head];
    while (b - 1 < f.start[w]) w = f.parent[w];
    CHECK_EQ(p.slot_segment[slot], w);
    CHECK_EQ(p.slot_producer[slot], p.segment_sequence[w]);
    const int32_t producer = p.slot_producer[slot];
    CHECK(p.sequence_round[producer] < p.sequence_round[q]);
    CHECK(p.sequence_anchor[producer] < b);
    bool requested = false;
    for (int32_t i = p.request_offsets[producer]; i < p.request_offsets[producer + 1]; ++i)
      requested |= p.request_slot[i] == slot;
    CHECK(requested);
  }
  // Replay: s_head mod B per sequence; R = Equation (15).
  int64_t replay = 0;
  for (int64_t q = 0; q < q_count; ++q) {
    CHECK_EQ(p.sequence_start[q] - p.sequence_anchor[q], static_cast<int32_t>(p.sequence_start[q] % chunk));
    replay += p.sequence_start[q] - p.sequence_anchor[q];
  }
  CHECK_EQ(replay, p.replay_tokens);
  CHECK_EQ(p.replay_tokens, MandatoryReplay(f, chunk));
  // Rounds: in [0, num_calls), every round non-empty, and equal to earliest-start scheduling
  // of the chosen continuations.
  for (int32_t r = 0; r < p.num_calls; ++r) CHECK(p.round_offsets[r] < p.round_offsets[r + 1]);
  CHECK_EQ(static_cast<int64_t>(p.round_offsets[p.num_calls]), q_count);
  bool parents_first = true;
  for (int64_t v = 0; v < n; ++v) parents_first &= f.parent[v] < v;
  if (parents_first) {
    const std::vector<int> round = EarliestRounds(f, p.direct_child, chunk);
    for (int64_t v = 0; v < n; ++v) CHECK_EQ(round[v], p.sequence_round[p.segment_sequence[v]] + 1);
  }
}

void TestBruteForce() {
  std::mt19937 rng(12345);
  int cases = 0;
  for (int iter = 0; iter < 6000; ++iter) {
    const int64_t chunk = std::uniform_int_distribution<int>(1, 6)(rng);
    const int n = std::uniform_int_distribution<int>(1, 11)(rng);
    const Tree t = RandomTree(rng, n, static_cast<int>(2 * chunk + 1), iter % 5 == 0 ? 0.2 : 0.0);
    const SegmentForest f = t.Forest();
    int64_t combos = 1;
    for (int64_t v = 0; v < f.size(); ++v) combos *= std::max<int64_t>(1, f.num_children(v));
    if (combos > 5000) continue;
    const MinCallPlan p = PlanMinCalls(f, chunk);
    CHECK_EQ(p.num_calls, BruteForceCalls(f, chunk));
    CheckPlan(f, p, chunk);
    ++cases;
  }
  CHECK(cases > 4000);
}

// The three phases run one by one: each phase's output has its documented properties, and
// their composition is PlanMinCalls.
void TestPhases() {
  std::mt19937 rng(2024);
  for (int iter = 0; iter < 2000; ++iter) {
    const int64_t chunk = std::uniform_int_distribution<int>(1, 6)(rng);
    const int n = std::uniform_int_distribution<int>(1, 30)(rng);
    const SegmentForest f = RandomTree(rng, n, static_cast<int>(2 * chunk + 1), iter % 3 == 0 ? 0.2 : 0.0).Forest();
    // Phase 1: leaves need one round; T_pre(v) <= T_in(v) (Equation 14 takes T_in or a
    // maximum that T_in's second term bounds); a parent needs at least each child's T_pre.
    const MinCallCounts counts = ComputeMinCallCounts(f, chunk);
    int32_t most = 0;
    for (int64_t v = 0; v < f.size(); ++v) {
      CHECK(counts.t_pre[v] >= 1 && counts.t_pre[v] <= counts.t_in[v]);
      if (f.num_children(v) == 0) CHECK(counts.t_pre[v] == 1 && counts.t_in[v] == 1);
      for (int64_t i = f.child_offsets[v]; i < f.child_offsets[v + 1]; ++i)
        CHECK(counts.t_pre[f.children[i]] <= counts.t_pre[v]);
      if (f.parent[v] < 0) most = std::max(most, counts.t_pre[v]);
    }
    // Phase 2: the call count is the roots' T_pre; a direct continuation stays in its
    // parent's round, a side branch runs in the same round or the next one.
    const MinCallRecovery rec = RecoverContinuations(f, chunk, counts);
    CHECK_EQ(rec.num_calls, most);
    for (int64_t v = 0; v < f.size(); ++v) {
      CHECK(rec.round[v] >= 0 && rec.round[v] < rec.num_calls);
      const int32_t p = f.parent[v];
      if (p < 0) {
        CHECK_EQ(rec.round[v], 0);
      } else if (rec.direct_child[p] == v) {
        CHECK_EQ(rec.round[v], rec.round[p]);
      } else {
        CHECK(rec.round[v] == rec.round[p] || rec.round[v] == rec.round[p] + 1);
      }
    }
    // Phase 3 keeps the recovery's choices and rounds.
    const MinCallPlan plan = AssignSequences(f, chunk, counts, rec);
    CHECK(plan.direct_child == rec.direct_child && plan.t_pre == counts.t_pre && plan.t_in == counts.t_in);
    for (int64_t v = 0; v < f.size(); ++v) CHECK_EQ(plan.sequence_round[plan.segment_sequence[v]], rec.round[v]);
    CheckPlan(f, plan, chunk);
    const MinCallPlan composed = PlanMinCalls(f, chunk);
    CHECK(composed.chain == plan.chain && composed.sequence_slot == plan.sequence_slot);
    CHECK(composed.request_slot == plan.request_slot && composed.slot_position == plan.slot_position);
  }
}

// Contracting a unary segment into its only child leaves the result unchanged.
void TestUnaryInvariance() {
  std::mt19937 rng(777);
  for (int iter = 0; iter < 3000; ++iter) {
    const int64_t chunk = std::uniform_int_distribution<int>(1, 6)(rng);
    const int size = std::uniform_int_distribution<int>(2, 14)(rng);
    const Tree t = RandomTree(rng, size, static_cast<int>(2 * chunk + 1), 0.0);
    const SegmentForest f = t.Forest();
    // Contract: a unary segment's child is merged into it (ids renumbered parents-first).
    const int64_t n = f.size();
    std::vector<int32_t> rep(n);
    for (int64_t v = 0; v < n; ++v) {
      const int32_t p = f.parent[v];
      rep[v] = (p >= 0 && f.num_children(p) == 1) ? rep[p] : static_cast<int32_t>(v);
    }
    std::vector<int32_t> id(n, -1);
    Tree c;
    for (int64_t v = 0; v < n; ++v) {
      if (rep[v] == v) {
        id[v] = static_cast<int32_t>(c.parent.size());
        c.parent.push_back(f.parent[v] < 0 ? -1 : id[rep[f.parent[v]]]);
        c.start.push_back(f.start[v]);
        c.end.push_back(f.end[v]);
      } else {
        c.end[id[rep[v]]] = f.end[v];
      }
    }
    const SegmentForest g = c.Forest();
    const MinCallPlan a = PlanMinCalls(f, chunk), b = PlanMinCalls(g, chunk);
    CHECK_EQ(a.num_calls, b.num_calls);
    CHECK_EQ(a.replay_tokens, b.replay_tokens);
    for (int64_t v = 0; v < n; ++v) {
      if (rep[v] != v) continue;
      // T_in and T_pre of the top segment of a unary run equal the contracted vertex's.
      CHECK_EQ(a.t_pre[v], b.t_pre[id[v]]);
      CHECK_EQ(a.t_in[v], b.t_in[id[v]]);
    }
    CheckPlan(f, a, chunk);
  }
}

// Figure 2: v0 = [0, B-1) forks into v1, v2; v1 = [B-1, B+1) forks into v3, v4.
void TestFigure2() {
  const int32_t B = 16;
  const Tree t{{-1, 0, 0, 1, 1}, {0, B - 1, B - 1, B + 1, B + 1}, {B - 1, B + 1, 2 * B, 3 * B, 2 * B + 3}};
  const SegmentForest f = t.Forest();
  const MinCallPlan p = PlanMinCalls(f, B);
  CHECK_EQ(p.num_calls, 2);
  CHECK_EQ(p.t_pre[0], 2);
  CHECK_EQ(p.direct_child[0], 1);
  CHECK_EQ(p.direct_child[1], 3);
  CHECK_EQ(p.num_sequences(), int64_t{3});
  // Round 0: v0 -> v1 -> v3 and v2 (replay [0, B-1)); round 1: v4 (replay [B, B+1)).
  CHECK_EQ(p.round_offsets[1], 2);
  CHECK_EQ(p.chain[p.chain_offsets[0]], 0);
  CHECK_EQ(p.chain_offsets[1] - p.chain_offsets[0], 3);
  CHECK_EQ(p.chain[p.chain_offsets[1]], 2);
  CHECK_EQ(p.sequence_anchor[1], 0);
  CHECK_EQ(p.sequence_slot[1], -1);  // zero state
  CHECK_EQ(p.chain[p.chain_offsets[2]], 4);
  CHECK_EQ(p.sequence_anchor[2], B);
  CHECK_EQ(p.slot_producer[p.sequence_slot[2]], 0);
  CHECK_EQ(p.replay_tokens, int64_t{(B - 1) + 1});
  CheckPlan(f, p, B);
}

// A root forking at p into two leaves: p = B-1 -> 1 call, p = B -> 2 calls with zero replay,
// p = B+1 -> 2 calls, replay 1. Nested forks inside one chunk stay in one call.
void TestBoundaryCases() {
  const int32_t B = 8;
  for (int32_t fork : {B - 1, B, B + 1, 2 * B, 1}) {
    const Tree t{{-1, 0, 0}, {0, fork, fork}, {fork, fork + 3, fork + 2 * B}};
    const SegmentForest f = t.Forest();
    const MinCallPlan p = PlanMinCalls(f, B);
    CHECK_EQ(p.num_calls, fork < B ? 1 : 2);
    CHECK_EQ(p.replay_tokens, int64_t{fork % B});
    CheckPlan(f, p, B);
  }
  // Nested forks at 2, 3, 5 inside chunk 0, and a second tree: still one call.
  const Tree nested{{-1, 0, 0, 1, 1, 3, 3, -1}, {0, 2, 2, 3, 3, 5, 5, 0}, {2, 3, 30, 5, 6, 40, 7, 50}};
  const SegmentForest f = nested.Forest();
  const MinCallPlan p = PlanMinCalls(f, B);
  CHECK_EQ(p.num_calls, 1);
  CHECK_EQ(p.replay_tokens, int64_t{2 + 3 + 5});
  CheckPlan(f, p, B);
  // The same nested forks behind a chunk crossing: all side branches wait one call.
  const Tree late{{-1, 0, 0, 1, 1}, {0, B + 2, B + 2, B + 3, B + 3}, {B + 2, B + 3, B + 9, B + 5, B + 6}};
  const MinCallPlan q = PlanMinCalls(late.Forest(), B);
  CHECK_EQ(q.num_calls, 2);
  CheckPlan(late.Forest(), q, B);
}

void TestDeepChain() {
  // 10^6 segments, each forking a short leaf: no recursion anywhere.
  const int n = 1000000;
  Tree t;
  t.parent.reserve(n);
  int32_t spine = -1, pos = 0;
  for (int i = 0; i < n / 2; ++i) {
    t.parent.push_back(spine);
    t.start.push_back(pos);
    t.end.push_back(pos + 3);
    const int32_t v = static_cast<int32_t>(t.parent.size() - 1);
    if (spine >= 0) {  // a leaf beside the spine
      t.parent.push_back(spine);
      t.start.push_back(pos);
      t.end.push_back(pos + 1);
    }
    spine = v;
    pos += 3;
  }
  const SegmentForest f = t.Forest();
  const MinCallPlan p = PlanMinCalls(f, 64);
  CHECK(p.num_calls >= 1 && p.num_calls <= 2);
  CHECK_EQ(p.replay_tokens, MandatoryReplay(f, 64));
}

void TestErrors() {
  ExpectError<InvalidArgument>([] { ValidateChunkSize(0); }, "chunk_size");
  ExpectError<InvalidArgument>([] { ValidateChunkSize(-3); }, "chunk_size");
  ExpectError<InvalidArgument>([] { ValidateChunkSize(kMaxChunkSize + 1); }, "chunk_size");
  ValidateChunkSize(kMaxChunkSize);
  ValidateChunkSize(1);
  ExpectError<InvalidArgument>([] { Tree{{-1, 5}, {0, 2}, {2, 3}}.Forest(); }, "parent[1]");
  ExpectError<InvalidArgument>([] { Tree{{-1, 1}, {0, 2}, {2, 3}}.Forest(); }, "parent[1]");
  ExpectError<InvalidArgument>([] { Tree{{-1, 0}, {0, 3}, {2, 4}}.Forest(); }, "start[1]");
  ExpectError<InvalidArgument>([] { Tree{{1, 0}, {0, 2}, {2, 4}}.Forest(); }, "start[0]");  // cycle has no root
  ExpectError<InvalidArgument>([] { Tree{{2, 0, 1, -1}, {4, 4, 4, 0}, {4, 4, 4, 4}}.Forest(); }, "end[0]");
  ExpectError<InvalidArgument>([] { Tree{{}, {}, {}}.Forest(); }, "parent");
  ExpectError<InvalidArgument>([] { Tree{{-1}, {0, 1}, {1}}.Forest(); }, "start");  // sizes differ
  ExpectError<InvalidArgument>([] { Tree{{-1}, {0}, {}}.Forest(); }, "end");
  ExpectError<InvalidArgument>([] { Tree{{-1}, {-1}, {1}}.Forest(); }, "start[0]");
}

void TestCycle() {
  // Along a parent cycle start[v] = end[parent[v]] > start[parent[v]] would grow forever, so
  // every cycle violates a start check; the first violating segment is named.
  ExpectError<InvalidArgument>([] { Tree{{-1, 2, 1}, {0, 4, 6}, {4, 6, 8}}.Forest(); }, "start[1]");
  ExpectError<InvalidArgument>([] { Tree{{0}, {0}, {3}}.Forest(); }, "parent[0]");
}

}  // namespace
}  // namespace harts

int main() {
  harts::TestFigure2();
  harts::TestBoundaryCases();
  harts::TestErrors();
  harts::TestCycle();
  harts::TestBruteForce();
  harts::TestPhases();
  harts::TestUnaryInvariance();
  harts::TestDeepChain();
  std::printf("min_call_test: OK\n");
  return 0;
}
