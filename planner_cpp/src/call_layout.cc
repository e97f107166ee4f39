#include "harts/call_layout.h"

#include <algorithm>
#include <cassert>
#include <limits>
#include <string>

#include "harts/errors.h"
#include "harts/plan_cost.h"

namespace harts {

void ValidateConvWidth(int64_t conv_width) { RequireInRange(conv_width, 1, kMaxConvWidth, "conv_width"); }

namespace {

// BuildCallLayout into `l` (empty).
void FillLayout(const SegmentForest& f, const MinCallPlan& plan, int64_t conv_width, CancelToken* cancel,
                CallLayout& l) {
  Check(cancel);
  const int64_t num_rows = f.num_rows;
  const int64_t num_segments = f.size();
  const int64_t num_sequences = plan.num_sequences();
  const int64_t num_rounds = plan.num_calls;
  const int64_t ctx = conv_width - 1;
  const int64_t chunk = plan.chunk_size;
  l.conv_width = static_cast<int32_t>(conv_width);

  // Physical order: sequences are numbered round by round, so walking them in order visits
  // rounds in order; each chain is a path, so its rows come out in position order.
  ResizePolled(&l.physical_to_row, num_rows, cancel);
  ResizePolled(&l.position_ids, num_rows, cancel);
  AssignPolled(&l.segment_physical_begin, num_segments, -1, cancel);
  l.sequence_offsets.assign(num_sequences + 1, 0);
  l.round_offsets.assign(num_rounds + 1, 0);
  int32_t next = 0;
  for (int64_t q = 0; q < num_sequences; ++q) {
    Poll(cancel);
    l.sequence_offsets[q] = next;
    for (int32_t i = plan.chain_offsets[q]; i < plan.chain_offsets[q + 1]; ++i) {
      const int32_t v = plan.chain[i];
      l.segment_physical_begin[v] = next;
      const int64_t row = f.row_begin[v] - f.start[v];
      ForEachBlock(f.start[v], f.end[v], cancel, [&](int64_t p) {
        l.physical_to_row[next] = static_cast<int32_t>(row + p);
        l.position_ids[next] = static_cast<int32_t>(p);
        ++next;
      });
    }
  }
  l.sequence_offsets[num_sequences] = next;
  assert(next == num_rows);
  for (int64_t r = 0; r <= num_rounds; ++r) l.round_offsets[r] = l.sequence_offsets[plan.round_offsets[r]];
  ResizePolled(&l.row_to_physical, num_rows, cancel);
  ForEachBlock(0, next, cancel, [&](int64_t p) { l.row_to_physical[l.physical_to_row[p]] = static_cast<int32_t>(p); });

  // Packed inputs, conv contexts. One walk up the path per sequence collects the physical rows
  // of positions [max(0, b_q - w + 1), s_head), nearest first; each step up covers at least one
  // position, so the walk costs O(s_head - b_q + w).
  l.packed_offsets.assign(num_rounds + 1, 0);
  l.cu_offsets.assign(num_rounds + 1, 0);
  l.gather_index.reserve(num_rows + plan.replay_tokens);
  l.packed_output_row.reserve(num_rows + plan.replay_tokens);
  l.cu_seqlens.reserve(num_sequences + num_rounds);
  ResizePolled(&l.sequence_replay_length, num_sequences, cancel);
  AssignPolled(&l.conv_context, num_sequences * ctx, -1, cancel);
  AssignPolled(&l.own_conv_context, num_sequences * ctx, -1, cancel);
  std::vector<int32_t> walk;  // walk[i]: physical row of position s_head - 1 - i
  {
    int64_t longest = 0;
    for (int64_t q = 0; q < num_sequences; ++q)
      longest =
          std::max<int64_t>(longest, plan.sequence_start[q] - std::max<int64_t>(0, plan.sequence_anchor[q] - ctx));
    walk.reserve(longest);
  }
  for (int64_t r = 0; r < num_rounds; ++r) {
    l.packed_offsets[r] = static_cast<int64_t>(l.gather_index.size());
    l.cu_offsets[r] = static_cast<int32_t>(l.cu_seqlens.size());
    l.cu_seqlens.push_back(0);
    int64_t packed = 0;
    for (int32_t q = plan.round_offsets[r]; q < plan.round_offsets[r + 1]; ++q) {
      Poll(cancel);
      const int32_t head = plan.chain[plan.chain_offsets[q]];
      const int64_t s = plan.sequence_start[q], b = plan.sequence_anchor[q];
      const int64_t lowest = std::max<int64_t>(0, b - ctx);
      walk.clear();
      int32_t w = f.parent[head];
      for (int64_t p = s - 1; p >= lowest; --p) {
        if ((s - 1 - p) % kPollBlock == kPollBlock - 1) Poll(cancel);
        while (p < f.start[w]) w = f.parent[w];
        walk.push_back(static_cast<int32_t>(l.segment_physical_begin[w] + (p - f.start[w])));
      }
      auto at = [&](int64_t p) { return p < 0 ? -1 : walk[s - 1 - p]; };
      ForEachBlock(b, s, cancel, [&](int64_t p) {
        l.gather_index.push_back(at(p));
        l.packed_output_row.push_back(-1);
      });
      ForEachBlock(l.sequence_offsets[q], l.sequence_offsets[q + 1], cancel, [&](int64_t row) {
        l.gather_index.push_back(static_cast<int32_t>(row));
        l.packed_output_row.push_back(static_cast<int32_t>(row));
      });
      for (int64_t i = 0; i < ctx; ++i) {
        l.conv_context[q * ctx + i] = at(b - ctx + i);
        l.own_conv_context[q * ctx + i] = at(s - ctx + i);  // s - ctx >= b - ctx: in the walk
      }
      l.sequence_replay_length[q] = static_cast<int32_t>(s - b);
      packed += (s - b) + (l.sequence_offsets[q + 1] - l.sequence_offsets[q]);
      if (packed > std::numeric_limits<int32_t>::max())
        throw ResourceExhausted("chunk_size", "round " + std::to_string(r) + " packs more than 2^31 - 1 rows");
      l.cu_seqlens.push_back(static_cast<int32_t>(packed));
    }
  }
  l.packed_offsets[num_rounds] = static_cast<int64_t>(l.gather_index.size());
  l.cu_offsets[num_rounds] = static_cast<int32_t>(l.cu_seqlens.size());

  const int64_t num_requests = plan.request_offsets.empty() ? 0 : plan.request_offsets.back();
  l.request_sequence.reserve(num_requests);
  l.request_position.reserve(num_requests);
  l.request_chunk.reserve(num_requests);
  l.request_slot.reserve(num_requests);
  for (int64_t q = 0; q < num_sequences; ++q) {
    Poll(cancel);
    for (int32_t i = plan.request_offsets[q]; i < plan.request_offsets[q + 1]; ++i) {
      const int32_t slot = plan.request_slot[i];
      l.request_sequence.push_back(static_cast<int32_t>(q));
      l.request_position.push_back(plan.slot_position[slot]);
      l.request_chunk.push_back(static_cast<int32_t>((plan.slot_position[slot] - plan.sequence_anchor[q]) / chunk));
      l.request_slot.push_back(slot);
    }
  }
}

}  // namespace

CallLayout BuildCallLayout(const SegmentForest& f, const MinCallPlan& plan, int64_t conv_width, CancelToken* cancel) {
  auto l = std::make_unique<CallLayout>();
  try {
    FillLayout(f, plan, conv_width, cancel, *l);
  } catch (...) {
    DestroyInBackground(std::move(l));  // a cancelled layout returns without freeing its rows first
    throw;
  }
  return std::move(*l);
}

namespace {

// The backstop of plan_cost.h: throws ResourceExhausted naming `field` when the call plan of
// `forest` would allocate more than MaxPlanBytes(). `trajectories` > 0 for PlanMicrobatch (its
// microbatch's count and semantic tokens), 0 for a bare forest.
void CheckPlanBudget(const SegmentForest& forest, int64_t chunk_size, int64_t conv_width, int64_t trajectories,
                     int64_t semantic_tokens, const char* field) {
  CallShape shape = ForestCallShape(forest, chunk_size, conv_width);
  shape.batch_links = trajectories > 0;
  shape.trajectories = trajectories;
  shape.semantic_tokens = semantic_tokens;
  CheckCallPlanBudget(shape, chunk_size, conv_width, field);
}

// Algorithm 1 and the layout of `forest`, on the heap: on any error (Cancelled) the partial plan
// is destroyed in the background (DestroyInBackground) before the error propagates.
std::unique_ptr<MicrobatchCallPlan> PlanForest(SegmentForest forest, int64_t chunk_size, int64_t conv_width,
                                               CancelToken* cancel) {
  auto m = std::make_unique<MicrobatchCallPlan>();
  try {
    m->forest = std::move(forest);
    m->plan = PlanMinCalls(m->forest, chunk_size, cancel);
    FillLayout(m->forest, m->plan, conv_width, cancel, m->layout);
  } catch (...) {
    DestroyInBackground(std::move(m));
    throw;
  }
  return m;
}

// out[p] = base + p for p in [lo, hi), polling once per kPollChunk values.
void FillRun(int32_t* out, int64_t lo, int64_t hi, int64_t base, CancelToken* cancel) {
  ForEachChunk(lo, hi, kPollChunk, cancel, [&](int64_t a, int64_t b) {
    for (int64_t p = a; p < b; ++p) out[p] = static_cast<int32_t>(base + p);
  });
}

// PlanMicrobatch's links to the batch: rows, physical rows and semantic positions as batch rows.
void AddBatchLinks(const RolloutBatch& batch, const std::vector<int32_t>& ranks, std::vector<int32_t> trajectories,
                   CancelToken* cancel, MicrobatchCallPlan& m) {
  const int64_t items = static_cast<int64_t>(ranks.size());
  m.trajectories = std::move(trajectories);
  const SegmentForest& f = m.forest;
  const CallLayout& l = m.layout;

  // Microbatch rows -> batch rows, O(C + k): the rows of segment v are positions [s_v, e_v) of
  // its owner's path, which the owner's batch path (walked up from the segment it ends at) holds
  // as rows of the batch forest. Each item walks only the segments it owns (the bottom of its
  // path), so no per-row array of the batch is needed.
  const SegmentForest& fb = batch.forest();
  ResizePolled(&m.row_to_global, f.num_rows, cancel);
  // Position p of batch segment u is batch row row_begin_u + p - start_u: each overlap of a
  // microbatch segment with a batch segment is one run of consecutive rows.
  for (int64_t item = 0; item < items; ++item) {
    Poll(cancel);
    int32_t u = fb.item_segment[ranks[item]];
    for (int32_t v = f.item_segment[item]; v >= 0 && f.owner[v] == item; v = f.parent[v]) {
      int32_t* out = m.row_to_global.data() + (f.row_begin[v] - f.start[v]);  // out[p], p in [s_v, e_v)
      for (int64_t hi = f.end[v]; hi > f.start[v];) {
        while (fb.start[u] >= hi) u = fb.parent[u];  // the batch segment holding position hi - 1
        const int64_t lo = std::max<int64_t>(f.start[v], fb.start[u]);
        FillRun(out, lo, hi, fb.row_begin[u] - fb.start[u], cancel);
        hi = lo;
      }
    }
  }
  ResizePolled(&m.physical_to_global, f.num_rows, cancel);
  ForEachBlock(0, f.num_rows, cancel,
               [&](int64_t p) { m.physical_to_global[p] = m.row_to_global[l.physical_to_row[p]]; });

  // Semantic positions -> physical rows, walking each trajectory up from its last segment.
  const int64_t count = static_cast<int64_t>(m.trajectories.size());
  m.semantic_offsets.assign(count + 1, 0);
  for (int64_t j = 0; j < count; ++j)
    m.semantic_offsets[j + 1] = m.semantic_offsets[j] + batch.lengths()[m.trajectories[j]];
  ResizePolled(&m.semantic_to_physical, m.semantic_offsets[count], cancel);
  for (int64_t j = 0; j < count; ++j) {
    Poll(cancel);
    const int32_t id = m.trajectories[j];
    const int64_t item = std::lower_bound(ranks.begin(), ranks.end(), batch.rank()[id]) - ranks.begin();
    int32_t v = f.item_segment[item];
    int32_t* out = m.semantic_to_physical.data() + m.semantic_offsets[j];
    for (int64_t hi = batch.lengths()[id]; hi > 0;) {  // one run per segment of the path
      while (f.start[v] >= hi) v = f.parent[v];
      FillRun(out, f.start[v], hi, l.segment_physical_begin[v] - f.start[v], cancel);
      hi = f.start[v];
    }
  }
}

}  // namespace

MicrobatchCallPlan PlanSegmentForest(SegmentForest forest, int64_t chunk_size, int64_t conv_width,
                                     CancelToken* cancel) {
  ValidateChunkSize(chunk_size);
  ValidateConvWidth(conv_width);
  CheckPlanBudget(forest, chunk_size, conv_width, 0, 0, "end");
  return std::move(*PlanForest(std::move(forest), chunk_size, conv_width, cancel));
}

MicrobatchCallPlan PlanMicrobatch(const RolloutBatch& batch, const int32_t* ids, int64_t k, int64_t chunk_size,
                                  int64_t conv_width, CancelToken* cancel) {
  ValidateChunkSize(chunk_size);
  ValidateConvWidth(conv_width);
  Check(cancel);
  const int64_t n = batch.num_trajectories();
  std::vector<int32_t> ranks;
  std::vector<int32_t> trajectories;
  if (ids == nullptr) {
    ranks.resize(n);
    trajectories.resize(n);
    for (int32_t i = 0; i < n; ++i) ranks[i] = trajectories[i] = i;
  } else {
    if (k == 0) throw InvalidArgument("trajectories", "a microbatch needs at least one trajectory");
    ranks = batch.SortedRanks(ids, k, "trajectories");
    trajectories.assign(ids, ids + k);
  }
  const int64_t items = static_cast<int64_t>(ranks.size());
  std::vector<int32_t> item_ids(items), lcp(items, 0);
  std::vector<int64_t> lengths(items);
  int64_t semantic_tokens = 0;
  ForEachBlock(0, items, cancel, [&](int64_t j) {
    item_ids[j] = batch.order()[ranks[j]];
    lengths[j] = batch.lengths()[item_ids[j]];
    semantic_tokens += lengths[j];
    if (j > 0) lcp[j] = static_cast<int32_t>(batch.RankLcp(ranks[j - 1], ranks[j]));
  });
  SegmentForest forest = BuildSegmentForest(item_ids.data(), lengths.data(), lcp.data(), items, cancel);
  CheckPlanBudget(forest, chunk_size, conv_width, items, semantic_tokens, "trajectories");
  std::unique_ptr<MicrobatchCallPlan> owned = PlanForest(std::move(forest), chunk_size, conv_width, cancel);
  try {
    AddBatchLinks(batch, ranks, std::move(trajectories), cancel, *owned);
  } catch (...) {
    DestroyInBackground(std::move(owned));
    throw;
  }
  return std::move(*owned);
}

}  // namespace harts
