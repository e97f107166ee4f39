// Physical layout of microbatch plans checked against the batch's own compact trie
// (row_parent / row_depth / compact_map) on random batches and random trajectory subsets,
// plus the microbatch input errors.
#include "harts/call_layout.h"

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "check.h"
#include "harts/errors.h"
#include "planner_test_util.h"

namespace harts {
namespace {

using testing::ExpectError;

using Traj = std::vector<int32_t>;

// Batch row of the ancestor at position `pos` of batch row `row` (pos <= depth(row)).
int32_t AncestorAt(const RolloutBatch& b, int32_t row, int64_t pos) {
  while (b.row_depth()[row] > pos) row = b.row_parent()[row];
  return row;
}

void CheckLayout(const RolloutBatch& b, const std::vector<int32_t>& ids, const MicrobatchCallPlan& m) {
  const MinCallPlan& p = m.plan;
  const CallLayout& l = m.layout;
  const int64_t rows = m.forest.num_rows;
  const int64_t chunk = p.chunk_size;
  const int64_t ctx = l.conv_width - 1;
  // The microbatch rows are exactly the distinct prefixes of its trajectories.
  std::set<int32_t> prefixes;
  for (int32_t id : ids)
    for (int64_t pos = 0; pos < b.lengths()[id]; ++pos) prefixes.insert(b.row_of_position()[b.offsets()[id] + pos]);
  CHECK_EQ(static_cast<int64_t>(prefixes.size()), rows);
  CHECK(std::set<int32_t>(m.row_to_global.begin(), m.row_to_global.end()) == prefixes);
  // Physical order is a permutation with its inverse; positions are row depths.
  std::vector<int32_t> sorted = l.physical_to_row;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < rows; ++i) CHECK_EQ(sorted[i], static_cast<int32_t>(i));
  for (int64_t i = 0; i < rows; ++i) {
    CHECK_EQ(l.row_to_physical[l.physical_to_row[i]], static_cast<int32_t>(i));
    CHECK_EQ(m.physical_to_global[i], m.row_to_global[l.physical_to_row[i]]);
    CHECK_EQ(l.position_ids[i], b.row_depth()[m.physical_to_global[i]]);
  }
  // Semantic positions land on their compact rows.
  CHECK(m.trajectories == ids);
  for (size_t j = 0; j < ids.size(); ++j)
    for (int64_t pos = 0; pos < b.lengths()[ids[j]]; ++pos)
      CHECK_EQ(m.physical_to_global[m.semantic_to_physical[m.semantic_offsets[j] + pos]],
               b.row_of_position()[b.offsets()[ids[j]] + pos]);
  // Sequences own contiguous rows, round by round; each row is output exactly once.
  CHECK_EQ(l.sequence_offsets.front(), 0);
  CHECK_EQ(static_cast<int64_t>(l.sequence_offsets.back()), rows);
  std::vector<int> written(rows, 0);
  for (int32_t r = 0; r < p.num_calls; ++r) {
    CHECK_EQ(l.round_offsets[r], l.sequence_offsets[p.round_offsets[r]]);
    const int32_t* cu = l.cu_seqlens.data() + l.cu_offsets[r];
    CHECK_EQ(l.cu_offsets[r + 1] - l.cu_offsets[r], p.round_offsets[r + 1] - p.round_offsets[r] + 1);
    CHECK_EQ(cu[0], 0);
    const int64_t base = l.packed_offsets[r];
    for (int32_t q = p.round_offsets[r]; q < p.round_offsets[r + 1]; ++q) {
      const int32_t i = q - p.round_offsets[r];
      const int64_t s = p.sequence_start[q], anchor = p.sequence_anchor[q];
      const int64_t own = l.sequence_offsets[q + 1] - l.sequence_offsets[q];
      CHECK_EQ(static_cast<int64_t>(cu[i + 1] - cu[i]), (s - anchor) + own);
      CHECK_EQ(static_cast<int64_t>(l.sequence_replay_length[q]), s - anchor);
      CHECK_EQ(static_cast<int64_t>(l.position_ids[l.sequence_offsets[q]]), s);
      const int32_t first_own = m.physical_to_global[l.sequence_offsets[q]];
      for (int64_t k = 0; k < cu[i + 1] - cu[i]; ++k) {
        const int64_t at = base + cu[i] + k;
        const int64_t pos = anchor + k;
        if (pos < s) {  // replay: the true ancestor at pos, no output
          CHECK_EQ(l.packed_output_row[at], -1);
          CHECK_EQ(m.physical_to_global[l.gather_index[at]], AncestorAt(b, b.row_parent()[first_own], pos));
        } else {
          CHECK_EQ(l.gather_index[at], l.sequence_offsets[q] + static_cast<int32_t>(pos - s));
          CHECK_EQ(l.packed_output_row[at], l.gather_index[at]);
          CHECK_EQ(static_cast<int64_t>(l.position_ids[l.gather_index[at]]), pos);
          ++written[l.gather_index[at]];
        }
      }
      // Own rows follow each other on one path.
      for (int32_t row = l.sequence_offsets[q] + 1; row < l.sequence_offsets[q + 1]; ++row)
        CHECK_EQ(b.row_parent()[m.physical_to_global[row]], m.physical_to_global[row - 1]);
      for (int64_t k = 0; k < ctx; ++k) {
        const int64_t pc = anchor - ctx + k, po = s - ctx + k;
        const int32_t got = l.conv_context[q * ctx + k], got_own = l.own_conv_context[q * ctx + k];
        if (pc < 0)
          CHECK_EQ(got, -1);
        else
          CHECK_EQ(m.physical_to_global[got], AncestorAt(b, b.row_parent()[first_own], pc));
        if (po < 0)
          CHECK_EQ(got_own, -1);
        else
          CHECK_EQ(m.physical_to_global[got_own], AncestorAt(b, b.row_parent()[first_own], po));
      }
    }
    CHECK_EQ(l.packed_offsets[r + 1] - base, static_cast<int64_t>(cu[p.round_offsets[r + 1] - p.round_offsets[r]]));
  }
  for (int64_t i = 0; i < rows; ++i) CHECK_EQ(written[i], 1);
  // State requests: a chunk boundary of the producer, at its slot position, produced from
  // the producer's own row at position - 1.
  CHECK_EQ(static_cast<int64_t>(l.request_slot.size()), p.num_slots());
  for (size_t i = 0; i < l.request_slot.size(); ++i) {
    const int32_t q = l.request_sequence[i], slot = l.request_slot[i];
    CHECK_EQ(p.slot_producer[slot], q);
    CHECK_EQ(l.request_position[i], p.slot_position[slot]);
    CHECK_EQ(l.request_position[i] % chunk, int64_t{0});
    CHECK_EQ(static_cast<int64_t>(l.request_chunk[i]) * chunk + p.sequence_anchor[q],
             static_cast<int64_t>(l.request_position[i]));
    CHECK(l.request_chunk[i] >= 1);
    const int32_t last_row = l.segment_physical_begin[p.slot_segment[slot]] +
                             (p.slot_position[slot] - 1 - m.forest.start[p.slot_segment[slot]]);
    CHECK_EQ(static_cast<int64_t>(l.position_ids[last_row]), static_cast<int64_t>(p.slot_position[slot]) - 1);
    CHECK(last_row >= l.sequence_offsets[q] && last_row < l.sequence_offsets[q + 1]);
  }
  // A consumer's anchor state is its path's state: the producer's row at b - 1 is the
  // consumer's ancestor.
  for (int64_t q = 0; q < p.num_sequences(); ++q) {
    const int32_t slot = p.sequence_slot[q];
    if (slot < 0) continue;
    const int32_t first_own = m.physical_to_global[l.sequence_offsets[q]];
    const int32_t last_row = l.segment_physical_begin[p.slot_segment[slot]] +
                             (p.slot_position[slot] - 1 - m.forest.start[p.slot_segment[slot]]);
    CHECK_EQ(m.physical_to_global[last_row], AncestorAt(b, b.row_parent()[first_own], p.slot_position[slot] - 1));
  }
}

void TestRandomBatches() {
  std::mt19937 rng(2024);
  for (int iter = 0; iter < 3000; ++iter) {
    const int n = std::uniform_int_distribution<int>(1, 9)(rng);
    const int alphabet = std::uniform_int_distribution<int>(1, 3)(rng);
    std::vector<Traj> trajs(n);
    for (Traj& t : trajs) {
      const int len = std::uniform_int_distribution<int>(1, 14)(rng);
      for (int i = 0; i < len; ++i) t.push_back(std::uniform_int_distribution<int>(0, alphabet - 1)(rng));
    }
    if (iter % 7 == 0) trajs.push_back(trajs[0]);  // identical trajectories
    auto b = testing::MakeBatch(trajs);
    std::vector<int32_t> ids(trajs.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(std::uniform_int_distribution<size_t>(1, ids.size())(rng));
    const int64_t chunk = std::uniform_int_distribution<int>(1, 6)(rng);
    const int64_t width = std::uniform_int_distribution<int>(1, 5)(rng);
    const MicrobatchCallPlan m = PlanMicrobatch(*b, ids.data(), static_cast<int64_t>(ids.size()), chunk, width);
    CheckLayout(*b, ids, m);
    // Determinism.
    const MicrobatchCallPlan again = PlanMicrobatch(*b, ids.data(), static_cast<int64_t>(ids.size()), chunk, width);
    CHECK(again.layout.gather_index == m.layout.gather_index);
    CHECK(again.plan.chain == m.plan.chain);
    // Whole batch: microbatch rows are the batch rows.
    if (iter % 11 == 0) {
      const MicrobatchCallPlan all = PlanMicrobatch(*b, nullptr, 0, chunk, width);
      for (int64_t i = 0; i < all.forest.num_rows; ++i) CHECK_EQ(all.row_to_global[i], static_cast<int32_t>(i));
      std::vector<int32_t> every(trajs.size());
      for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<int32_t>(i);
      CheckLayout(*b, every, all);
    }
  }
}

// PlanMicrobatch maps microbatch rows to batch rows by walking the batch forest, not through the
// batch's per-row arrays: on random batches, and on the same batches rebuilt from their segment
// tree (whose per-row arrays are built lazily), the map equals the per-row formula
// row_of_position[offset of the owner + position] bit for bit, the two plans are identical, and
// planning leaves the tree batch's per-row arrays unbuilt.
void TestRowMapWithoutRowArrays() {
  std::mt19937 rng(5);
  for (int iter = 0; iter < 300; ++iter) {
    const int n = 1 + static_cast<int>(rng() % 30);
    const auto trajs = testing::RandomTrajectories(rng, n, 1 + static_cast<int>(rng() % 40), 3, 0.1);
    const auto b = testing::MakeBatch(trajs);
    const SegmentForest& bf = b->forest();
    std::vector<int32_t> parent = bf.parent, length, ends(n);
    for (int64_t v = 0; v < bf.size(); ++v) length.push_back(bf.end[v] - bf.start[v]);
    for (int64_t r = 0; r < n; ++r) ends[b->order()[r]] = bf.item_segment[r];
    const SegmentTreeView view{parent.data(), bf.size(), length.data(), bf.size(), ends.data(), n};
    const auto t = RolloutBatch::FromSegmentTree(view, nullptr, 0);
    std::vector<int32_t> ids(n);
    for (int i = 0; i < n; ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(1 + rng() % n);
    const int64_t chunk = 1 + rng() % 9, width = 1 + rng() % 4;
    const MicrobatchCallPlan m = PlanMicrobatch(*b, ids.data(), static_cast<int64_t>(ids.size()), chunk, width);
    const MicrobatchCallPlan mt = PlanMicrobatch(*t, ids.data(), static_cast<int64_t>(ids.size()), chunk, width);
    CHECK(!t->rows_built());
    CHECK(b->rows_built());
    // The per-row formula, on the token batch's compact map.
    std::vector<int32_t> sorted_ids(ids);
    std::sort(sorted_ids.begin(), sorted_ids.end(), [&](int32_t x, int32_t y) { return b->rank()[x] < b->rank()[y]; });
    std::vector<int32_t> expected(m.forest.num_rows);
    for (int64_t v = 0; v < m.forest.size(); ++v) {
      const int64_t base = b->offsets()[sorted_ids[m.forest.owner[v]]];
      for (int64_t p = m.forest.start[v]; p < m.forest.end[v]; ++p)
        expected[m.forest.row_begin[v] + (p - m.forest.start[v])] = b->row_of_position()[base + p];
    }
    CHECK(m.row_to_global == expected);
    CHECK(mt.row_to_global == expected);
    CHECK(mt.physical_to_global == m.physical_to_global && mt.semantic_to_physical == m.semantic_to_physical);
    CHECK(mt.layout.gather_index == m.layout.gather_index && mt.plan.chain == m.plan.chain);
    CHECK(mt.layout.conv_context == m.layout.conv_context && mt.plan.slot_position == m.plan.slot_position);
  }
}

void TestErrors() {
  auto b = testing::MakeBatch({{1, 2, 3}, {1, 2, 4}, {5}});
  const std::vector<int32_t> ok = {0, 2};
  ExpectError<Error>([&] { PlanMicrobatch(*b, ok.data(), 0, 64, 4); }, "trajectories");
  const std::vector<int32_t> out = {0, 3};
  ExpectError<Error>([&] { PlanMicrobatch(*b, out.data(), 2, 64, 4); }, "trajectories[1]");
  const std::vector<int32_t> neg = {-1};
  ExpectError<Error>([&] { PlanMicrobatch(*b, neg.data(), 1, 64, 4); }, "trajectories[0]");
  const std::vector<int32_t> rep = {2, 0, 2};
  ExpectError<Error>([&] { PlanMicrobatch(*b, rep.data(), 3, 64, 4); }, "trajectories");
  ExpectError<Error>([&] { PlanMicrobatch(*b, ok.data(), 2, 0, 4); }, "chunk_size");
  ExpectError<Error>([&] { PlanMicrobatch(*b, ok.data(), 2, kMaxChunkSize + 1, 4); }, "chunk_size");
  ExpectError<Error>([&] { PlanMicrobatch(*b, ok.data(), 2, 64, 0); }, "conv_width");
  const MicrobatchCallPlan m = PlanMicrobatch(*b, ok.data(), 2, 64, 4);
  CHECK_EQ(m.plan.num_calls, 1);
  CHECK_EQ(m.forest.num_rows, int64_t{4});
}

}  // namespace
}  // namespace harts

int main() {
  harts::TestErrors();
  harts::TestRandomBatches();
  harts::TestRowMapWithoutRowArrays();
  std::printf("call_layout_test: OK\n");
  return 0;
}
