#include "harts/min_call.h"

#include <algorithm>
#include <cassert>
#include <limits>
#include <stdexcept>
#include <utility>

#include "harts/errors.h"

namespace harts {
namespace {

// True when v stays inside its entry chunk (Equation 11).
bool SameChunk(const SegmentForest& f, int64_t v, int64_t chunk_size) {
  return f.end[v] < Anchor(f.start[v], chunk_size) + chunk_size;
}

}  // namespace

std::vector<int32_t> ParentsFirstOrder(const SegmentForest& f, CancelToken* cancel) {
  std::vector<int32_t> order;
  order.reserve(static_cast<size_t>(f.size()));
  bool increasing = true;
  for (int64_t v = 0; v < f.size() && increasing; ++v) increasing = f.parent[v] < v;
  if (increasing) {
    for (int64_t v = 0; v < f.size(); ++v) order.push_back(static_cast<int32_t>(v));
    return order;
  }
  order.insert(order.end(), f.roots.begin(), f.roots.end());
  for (size_t i = 0; i < order.size(); ++i) {
    Poll(cancel);
    const int32_t v = order[i];
    order.insert(order.end(), f.children.begin() + f.child_offsets[v], f.children.begin() + f.child_offsets[v + 1]);
  }
  return order;
}

void ValidateChunkSize(int64_t chunk_size) { RequireInRange(chunk_size, 1, kMaxChunkSize, "chunk_size"); }

MinCallCounts ComputeMinCallCounts(const SegmentForest& f, int64_t chunk_size, CancelToken* cancel) {
  Check(cancel);
  const int64_t n = f.size();
  MinCallCounts c;
  AssignPolled(&c.t_pre, n, 1, cancel);
  AssignPolled(&c.t_in, n, 1, cancel);
  const std::vector<int32_t> order = ParentsFirstOrder(f, cancel);
  for (auto it = order.rbegin(); it != order.rend(); ++it) {  // children before parents
    Poll(cancel);
    const int32_t v = *it;
    const int64_t lo = f.child_offsets[v], hi = f.child_offsets[v + 1];
    if (lo == hi) continue;  // leaf: Equation (12)
    // Largest and second-largest child T_pre (Algorithm 1, line 5); empty max = 0.
    int32_t first = 0, second = 0, arg_first = -1;
    for (int64_t i = lo; i < hi; ++i) {
      const int32_t t = c.t_pre[f.children[i]];
      if (t > first) {
        second = first;
        first = t;
        arg_first = f.children[i];
      } else if (t > second) {
        second = t;
      }
    }
    int32_t best = std::numeric_limits<int32_t>::max();
    for (int64_t i = lo; i < hi; ++i) {  // Equation (13)
      const int32_t o = f.children[i];
      const int32_t h = o == arg_first ? second : first;
      best = std::min(best, std::max(c.t_in[o], 1 + h));
    }
    c.t_in[v] = best;
    c.t_pre[v] = SameChunk(f, v, chunk_size) ? first : best;  // Equation (14)
  }
  return c;
}

int64_t MandatoryReplay(const SegmentForest& f, int64_t chunk_size) {
  int64_t r = 0;
  for (int64_t v = 0; v < f.size(); ++v) {
    const int64_t k = f.num_children(v);
    if (k > 0) r += (k - 1) * (f.end[v] % chunk_size);
  }
  return r;
}

MinCallRecovery RecoverContinuations(const SegmentForest& f, int64_t chunk_size, const MinCallCounts& counts,
                                     CancelToken* cancel) {
  Check(cancel);
  const int64_t n = f.size();
  const std::vector<int32_t>& t_pre = counts.t_pre;
  const std::vector<int32_t>& t_in = counts.t_in;
  MinCallRecovery rec;
  AssignPolled(&rec.direct_child, n, -1, cancel);
  ResizePolled(&rec.round, n, cancel);
  // Each segment receives (ready, budget, round) from its parent, so one pass in parents-first
  // order replaces the recursion of Algorithm 1.
  std::vector<char> ready;
  std::vector<int32_t> budget;
  ResizePolled(&ready, n, cancel);
  ResizePolled(&budget, n, cancel);
  for (int32_t root : f.roots) {
    ready[root] = 1;
    budget[root] = t_pre[root];
    rec.num_calls = std::max(rec.num_calls, t_pre[root]);
  }
  for (const int32_t v : ParentsFirstOrder(f, cancel)) {
    Poll(cancel);
    const int64_t lo = f.child_offsets[v], hi = f.child_offsets[v + 1];
    if (lo == hi) continue;
    const bool same = ready[v] && SameChunk(f, v, chunk_size);
    const int32_t delta = same ? 0 : 1;
    const int32_t k_round = budget[v], k_side = k_round - delta;
    int64_t over = 0;  // Algorithm 1's f: children whose T_pre exceeds the side budget
    for (int64_t i = lo; i < hi; ++i) over += t_pre[f.children[i]] > k_side;
    int32_t o = -1;
    for (int64_t i = lo; i < hi && o < 0; ++i) {
      const int32_t u = f.children[i];
      const int32_t h = same ? t_pre[u] : t_in[u];
      if (h <= k_round && over - (t_pre[u] > k_side) == 0) o = u;
    }
    if (o < 0) throw std::logic_error("PlanMinCalls: no feasible direct continuation (budget invariant broken)");
    rec.direct_child[v] = o;
    ready[o] = same;
    budget[o] = k_round;
    rec.round[o] = rec.round[v];
    for (int64_t i = lo; i < hi; ++i) {
      const int32_t u = f.children[i];
      if (u == o) continue;
      ready[u] = 1;
      budget[u] = k_side;
      rec.round[u] = rec.round[v] + delta;
    }
  }
  return rec;
}

MinCallPlan AssignSequences(const SegmentForest& f, int64_t chunk_size, MinCallCounts counts, MinCallRecovery recovery,
                            CancelToken* cancel) {
  Check(cancel);
  const int64_t n = f.size();
  MinCallPlan p;
  p.chunk_size = chunk_size;
  p.num_calls = recovery.num_calls;
  p.t_pre = std::move(counts.t_pre);
  p.t_in = std::move(counts.t_in);
  p.direct_child = std::move(recovery.direct_child);
  const std::vector<int32_t>& round = recovery.round;
  // Heads: the roots and every child that does not continue its parent's sequence.
  auto is_head = [&](int64_t v) { return f.parent[v] < 0 || p.direct_child[f.parent[v]] != v; };

  // Sequences: heads bucketed by round, increasing head id within a round.
  p.round_offsets.assign(p.num_calls + 1, 0);
  int64_t num_sequences = 0;
  for (int64_t v = 0; v < n; ++v) {
    if (!is_head(v)) continue;
    assert(round[v] < p.num_calls);
    ++p.round_offsets[round[v] + 1];
    ++num_sequences;
  }
  for (int32_t r = 0; r < p.num_calls; ++r) p.round_offsets[r + 1] += p.round_offsets[r];
  std::vector<int32_t> heads(num_sequences);
  {
    std::vector<int32_t> fill(p.round_offsets.begin(), p.round_offsets.end() - 1);
    for (int64_t v = 0; v < n; ++v)
      if (is_head(v)) heads[fill[round[v]]++] = static_cast<int32_t>(v);
  }
  p.sequence_round.resize(num_sequences);
  p.chain_offsets.assign(num_sequences + 1, 0);
  p.chain.reserve(n);
  p.sequence_anchor.resize(num_sequences);
  p.sequence_start.resize(num_sequences);
  p.sequence_end.resize(num_sequences);
  AssignPolled(&p.segment_sequence, n, -1, cancel);
  for (int64_t q = 0; q < num_sequences; ++q) {
    Poll(cancel);
    const int32_t head = heads[q];
    p.sequence_round[q] = round[head];
    p.sequence_start[q] = f.start[head];
    p.sequence_anchor[q] = static_cast<int32_t>(Anchor(f.start[head], chunk_size));
    p.replay_tokens += f.start[head] - p.sequence_anchor[q];
    int32_t v = head;
    for (;;) {
      Poll(cancel);
      p.chain.push_back(v);
      p.segment_sequence[v] = static_cast<int32_t>(q);
      p.own_tokens += f.end[v] - f.start[v];
      if (p.direct_child[v] < 0) break;
      v = p.direct_child[v];
    }
    p.sequence_end[q] = f.end[v];
    p.chain_offsets[q + 1] = static_cast<int32_t>(p.chain.size());
  }
  assert(static_cast<int64_t>(p.chain.size()) == n);
  assert(p.replay_tokens == MandatoryReplay(f, chunk_size));

  // State sources. anchor_segment[v] is the segment on v's path holding position a(s_v) - 1
  // (-1 when a(s_v) = 0): a child whose anchor moved past its parent's entry anchor finds it
  // in the parent, otherwise it inherits the parent's. A head consumes S_{a(s_head)}, which
  // is returned by the sequence outputting that segment; every consumer of one segment needs
  // the same state, S_{a(e_P)}, so there is at most one slot per producing segment P.
  std::vector<int32_t> anchor_segment;
  AssignPolled(&anchor_segment, n, -1, cancel);
  for (const int32_t v : ParentsFirstOrder(f, cancel)) {
    Poll(cancel);
    const int32_t par = f.parent[v];
    if (par < 0) continue;
    anchor_segment[v] = Anchor(f.start[v], chunk_size) == Anchor(f.start[par], chunk_size) ? anchor_segment[par] : par;
  }
  std::vector<int32_t> slot_of_segment;
  AssignPolled(&slot_of_segment, n, -1, cancel);
  int64_t num_slots = 0;
  for (int32_t head : heads)
    if (anchor_segment[head] >= 0 && slot_of_segment[anchor_segment[head]] < 0) {
      slot_of_segment[anchor_segment[head]] = 0;  // mark
      ++num_slots;
    }
  p.slot_producer.reserve(num_slots);
  p.slot_position.reserve(num_slots);
  p.slot_segment.reserve(num_slots);
  p.request_slot.reserve(num_slots);
  p.request_offsets.assign(num_sequences + 1, 0);
  for (int64_t q = 0; q < num_sequences; ++q) {
    Poll(cancel);
    for (int32_t i = p.chain_offsets[q]; i < p.chain_offsets[q + 1]; ++i) {
      const int32_t seg = p.chain[i];
      if (slot_of_segment[seg] < 0) continue;
      const int32_t slot = static_cast<int32_t>(p.slot_producer.size());
      slot_of_segment[seg] = slot;
      p.slot_producer.push_back(static_cast<int32_t>(q));
      p.slot_position.push_back(static_cast<int32_t>(Anchor(f.end[seg], chunk_size)));
      p.slot_segment.push_back(seg);
      p.request_slot.push_back(slot);
    }
    p.request_offsets[q + 1] = static_cast<int32_t>(p.request_slot.size());
  }
  p.sequence_slot.assign(num_sequences, -1);
  for (int64_t q = 0; q < num_sequences; ++q) {
    const int32_t src = anchor_segment[heads[q]];
    if (src < 0) continue;
    const int32_t slot = slot_of_segment[src];
    p.sequence_slot[q] = slot;
    assert(p.slot_position[slot] == p.sequence_anchor[q]);
    assert(p.sequence_round[p.slot_producer[slot]] < p.sequence_round[q]);
  }
  return p;
}

MinCallPlan PlanMinCalls(const SegmentForest& f, int64_t chunk_size, CancelToken* cancel) {
  MinCallCounts counts = ComputeMinCallCounts(f, chunk_size, cancel);  // each phase checks the clock first
  MinCallRecovery recovery = RecoverContinuations(f, chunk_size, counts, cancel);
  return AssignSequences(f, chunk_size, std::move(counts), std::move(recovery), cancel);
}

}  // namespace harts
