#include "harts/cp_split.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "harts/call_layout.h"
#include "harts/errors.h"
#include "harts/min_call.h"

namespace harts {

void ValidateCpSplitOptions(const CpSplitOptions& o) {
  RequireInRange(o.cp_size, 1, kMaxCpSize, "cp_size");
  ValidateChunkSize(o.chunk_size);
  ValidateConvWidth(o.conv_width);
  RequireInRange(o.linear_cost, 0, kMaxCpCost, "linear_cost");
  RequireInRange(o.attention_cost, 0, kMaxCpCost, "attention_cost");
  if (o.linear_cost == 0 && o.attention_cost == 0)
    throw InvalidArgument("linear_cost", "linear_cost and attention_cost cannot both be 0");
}

namespace {

using Wide = __int128;
constexpr int64_t kMaxTotalCost = int64_t{1} << 62;

// A legal cut: before row `row` (position `pos` of segment `segment`); prefix = cost of rows [0, row).
struct LegalCut {
  int64_t row;
  int64_t prefix;
  int32_t segment;  // -1 for the end cut (row = C_M)
  bool mid;         // inside the segment (pos > start): the path predecessor is row - 1
};

// An entering row: `row` of rank `rank`, whose path predecessor `pred` (in segment `pred_segment`)
// lives on an earlier rank.
struct Entry {
  int32_t rank, pred, pred_segment, row;
  bool operator<(const Entry& o) const { return std::tie(rank, pred, row) < std::tie(o.rank, o.pred, o.row); }
};

// Cost of the rows at positions [s, p) of one path: linear_cost (p - s) + attention_cost sum (q + 1).
Wide RunCost(const CpSplitOptions& o, int64_t s, int64_t p) {
  const Wide pairs = (Wide(p) * (p + 1) - Wide(s) * (s + 1)) / 2;
  return Wide(o.linear_cost) * (p - s) + Wide(o.attention_cost) * pairs;
}

// The legal cuts of the forest in row order: 0, the grid positions of every segment, C_M.
std::vector<LegalCut> LegalCuts(const SegmentForest& f, const CpSplitOptions& o, CancelToken* cancel) {
  std::vector<LegalCut> cuts;
  const int64_t b = o.chunk_size;
  Wide before = 0;  // cost of the rows of the segments before v
  for (int32_t v = 0; v < f.size(); ++v) {
    Poll(cancel);
    const int64_t s = f.start[v], e = f.end[v], rb = f.row_begin[v];
    const Wide after = before + RunCost(o, s, e);  // checked first: every prefix below fits int64
    if (after > kMaxTotalCost)
      throw ResourceExhausted(
          "attention_cost",
          "the microbatch's rows cost more than 2^62 under linear_cost = " + std::to_string(o.linear_cost) +
              " and attention_cost = " + std::to_string(o.attention_cost) + "; lower them");
    for (int64_t p = (s + b - 1) / b * b; p < e; p += b) {
      if ((p / b) % kPollBlock == 0) Poll(cancel);
      cuts.push_back({rb + (p - s), static_cast<int64_t>(before + RunCost(o, s, p)), v, p > s});
    }
    before = after;
  }
  cuts.push_back({f.num_rows, static_cast<int64_t>(before), -1, false});
  return cuts;
}

// Greedy split under `bound`: from each cut, the farthest legal cut whose range costs <= bound.
// Returns the chosen cut indices after 0 (at most C of them, the last the end cut), or an
// empty vector when C ranges do not reach the end.
std::vector<int64_t> GreedySplit(const std::vector<LegalCut>& cuts, int64_t cp_size, int64_t bound) {
  std::vector<int64_t> chosen;
  const int64_t last = static_cast<int64_t>(cuts.size()) - 1;
  int64_t i = 0;
  while (i < last) {
    if (static_cast<int64_t>(chosen.size()) == cp_size) return {};
    const int64_t limit = cuts[i].prefix + bound;
    const auto it = std::upper_bound(cuts.begin() + i + 1, cuts.end(), limit,
                                     [](int64_t value, const LegalCut& c) { return value < c.prefix; });
    const int64_t j = (it - cuts.begin()) - 1;
    if (j <= i) return {};
    chosen.push_back(j);
    i = j;
  }
  return chosen;
}

}  // namespace

CpSplit SplitForest(const SegmentForest& f, const CpSplitOptions& o, CancelToken* cancel) {
  ValidateCpSplitOptions(o);
  Check(cancel);
  const int64_t c = o.cp_size;
  const int64_t b = o.chunk_size;
  const int64_t ctx = o.conv_width - 1;
  CpSplit out;
  out.cp_size = c;
  out.chunk_size = b;
  out.conv_width = o.conv_width;
  out.linear_cost = o.linear_cost;
  out.attention_cost = o.attention_cost;
  out.num_rows = f.num_rows;

  // 1. Legal cuts and the least bound a split of C ranges reaches (binary search; feasibility is
  //    monotone in the bound and the greedy test is exact for contiguous ranges).
  const std::vector<LegalCut> cuts = LegalCuts(f, o, cancel);
  const int64_t total = cuts.back().prefix;
  out.total_cost = total;
  int64_t lo = (total + c - 1) / c, hi = total;  // hi is always feasible (one range)
  while (lo < hi) {
    Poll(cancel);
    const int64_t mid = lo + (hi - lo) / 2;
    if (GreedySplit(cuts, c, mid).empty())
      lo = mid + 1;
    else
      hi = mid;
  }
  const std::vector<int64_t> chosen = GreedySplit(cuts, c, lo);
  out.rank_row_offsets.assign(c + 1, f.num_rows);
  out.rank_row_offsets[0] = 0;
  std::vector<int64_t> cut_index(c + 1, static_cast<int64_t>(cuts.size()) - 1);  // legal cut of each offset
  cut_index[0] = 0;
  for (size_t r = 0; r < chosen.size(); ++r) {
    out.rank_row_offsets[r + 1] = cuts[chosen[r]].row;
    cut_index[r + 1] = chosen[r];
  }
  out.rank_cost.resize(c);
  for (int64_t r = 0; r < c; ++r) {
    out.rank_cost[r] = cuts[cut_index[r + 1]].prefix - cuts[cut_index[r]].prefix;
    out.max_cost = std::max(out.max_cost, out.rank_cost[r]);
  }
  const std::vector<int64_t>& offsets = out.rank_row_offsets;
  auto rank_of = [&](int64_t row) {
    return static_cast<int32_t>(std::upper_bound(offsets.begin(), offsets.end(), row) - offsets.begin() - 1);
  };

  // 2. Entering rows: fork heads below a parent on an earlier rank, and mid-segment cuts.
  std::vector<Entry> entries;
  for (int32_t v = 0; v < f.size(); ++v) {
    Poll(cancel);
    const int32_t u = f.parent[v];
    if (u < 0) continue;
    const int32_t head = static_cast<int32_t>(f.row_begin[v]);
    const int32_t pred = static_cast<int32_t>(f.row_begin[u] + (f.end[u] - f.start[u]) - 1);
    const int32_t r = rank_of(head);
    if (rank_of(pred) < r) entries.push_back({r, pred, u, head});
  }
  for (int64_t r = 1; r < c; ++r) {
    const LegalCut& cut = cuts[cut_index[r]];
    if (offsets[r] < offsets[r + 1] && cut.mid)
      entries.push_back(
          {static_cast<int32_t>(r), static_cast<int32_t>(cut.row - 1), cut.segment, static_cast<int32_t>(cut.row)});
  }
  std::sort(entries.begin(), entries.end());

  // 3. Receives: one per (rank, predecessor row); a walk up the path gives the replay rows, the
  //    conv context and the state row.
  std::vector<int32_t> receive_state_row;  // -1 for the zero state
  std::vector<int32_t> walk;               // walk[i]: row of position s - 1 - i
  out.receive_offsets.assign(c + 1, 0);
  out.receive_replay_offsets.push_back(0);
  out.receive_entry_offsets.push_back(0);
  for (size_t i = 0; i < entries.size(); ++i) {
    Poll(cancel);
    const Entry& e = entries[i];
    out.entry_rows.push_back(e.row);
    if (i + 1 < entries.size() && entries[i + 1].rank == e.rank && entries[i + 1].pred == e.pred) continue;
    out.receive_entry_offsets.push_back(static_cast<int32_t>(out.entry_rows.size()));
    int32_t w = e.pred_segment;
    const int64_t s = f.start[w] + (e.pred - f.row_begin[w]) + 1;  // pos(u) + 1
    const int64_t a = Anchor(s, b);
    const int64_t lowest = std::max<int64_t>(0, std::min(a - 1, a - ctx));
    walk.clear();
    for (int64_t p = s - 1; p >= lowest; --p) {
      while (p < f.start[w]) w = f.parent[w];
      walk.push_back(static_cast<int32_t>(f.row_begin[w] + (p - f.start[w])));
    }
    auto at = [&](int64_t p) { return p < 0 ? -1 : walk[s - 1 - p]; };
    for (int64_t p = a; p < s; ++p) out.replay_rows.push_back(at(p));
    out.receive_replay_offsets.push_back(static_cast<int32_t>(out.replay_rows.size()));
    for (int64_t p = a - ctx; p < a; ++p) out.receive_conv_context.push_back(at(p));
    out.receive_rank.push_back(e.rank);
    out.receive_row.push_back(e.pred);
    out.receive_anchor.push_back(static_cast<int32_t>(a));
    receive_state_row.push_back(a > 0 ? at(a - 1) : -1);
    ++out.receive_offsets[e.rank + 1];
  }
  for (int64_t r = 0; r < c; ++r) out.receive_offsets[r + 1] += out.receive_offsets[r];

  // 4. States: the distinct state rows, numbered by row (so by producing rank), and their ranks.
  out.state_row = receive_state_row;
  out.state_row.erase(std::remove(out.state_row.begin(), out.state_row.end(), -1), out.state_row.end());
  std::sort(out.state_row.begin(), out.state_row.end());
  out.state_row.erase(std::unique(out.state_row.begin(), out.state_row.end()), out.state_row.end());
  std::vector<std::pair<int32_t, int32_t>> consumers;  // (state, rank)
  for (size_t i = 0; i < receive_state_row.size(); ++i) {
    const int32_t row = receive_state_row[i];
    int32_t k = -1;
    if (row >= 0) {
      k = static_cast<int32_t>(std::lower_bound(out.state_row.begin(), out.state_row.end(), row) -
                               out.state_row.begin());
      consumers.emplace_back(k, out.receive_rank[i]);
    }
    out.receive_state.push_back(k);
  }
  const int64_t num_states = out.num_states();
  out.state_position.resize(num_states);
  out.state_rank.resize(num_states);
  for (size_t i = 0; i < receive_state_row.size(); ++i)
    if (out.receive_state[i] >= 0) out.state_position[out.receive_state[i]] = out.receive_anchor[i];
  for (int64_t k = 0; k < num_states; ++k) out.state_rank[k] = rank_of(out.state_row[k]);
  std::sort(consumers.begin(), consumers.end());
  consumers.erase(std::unique(consumers.begin(), consumers.end()), consumers.end());
  out.state_consumer_offsets.assign(num_states + 1, 0);
  for (const auto& [k, r] : consumers) {
    ++out.state_consumer_offsets[k + 1];
    out.state_consumer_rank.push_back(r);
  }
  for (int64_t k = 0; k < num_states; ++k) out.state_consumer_offsets[k + 1] += out.state_consumer_offsets[k];
  out.send_offsets.assign(c + 1, 0);
  for (int64_t k = 0; k < num_states; ++k) ++out.send_offsets[out.state_rank[k] + 1];
  for (int64_t r = 0; r < c; ++r) out.send_offsets[r + 1] += out.send_offsets[r];
  return out;
}

CpSplit PlanCpSplit(const RolloutBatch& batch, const int32_t* ids, int64_t k, const CpSplitOptions& o,
                    CancelToken* cancel) {
  ValidateCpSplitOptions(o);
  Check(cancel);
  const int64_t n = batch.num_trajectories();
  std::vector<int32_t> ranks;
  if (ids == nullptr) {
    ranks.resize(n);
    for (int32_t i = 0; i < n; ++i) ranks[i] = i;
  } else {
    if (k == 0) throw InvalidArgument("trajectories", "a microbatch needs at least one trajectory");
    ranks = batch.SortedRanks(ids, k, "trajectories");
  }
  const int64_t items = static_cast<int64_t>(ranks.size());
  std::vector<int32_t> item_ids(items), lcp(items, 0);
  std::vector<int64_t> lengths(items);
  ForEachBlock(0, items, cancel, [&](int64_t j) {
    item_ids[j] = batch.order()[ranks[j]];
    lengths[j] = batch.lengths()[item_ids[j]];
    if (j > 0) lcp[j] = static_cast<int32_t>(batch.RankLcp(ranks[j - 1], ranks[j]));
  });
  const SegmentForest forest = BuildSegmentForest(item_ids.data(), lengths.data(), lcp.data(), items, cancel);
  return SplitForest(forest, o, cancel);
}

}  // namespace harts
