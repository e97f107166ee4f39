#include "harts/segment_tree.h"

#include <string>
#include <utility>

#include "harts/errors.h"

namespace harts {
namespace {

// "a segment id in [0, V), got x": the words of both id checks (parent, trajectory_end).
std::string SegmentIdIn(int64_t v_count, int64_t got) {
  return "a segment id in [0, " + std::to_string(v_count) + "), got " + std::to_string(got);
}

// Step 2 (segments) of the checks in segment_tree.h.
void CheckSegmentCount(int64_t v_count, int64_t max_segments) {
  if (v_count < 1) throw InvalidArgument("parent", "a segment tree needs at least one segment");
  RequireWithinLimit(v_count, max_segments, "segments", "parent");
}

// Step 3, the parent of segment v.
void CheckParent(const int32_t* parent, int64_t v_count, int64_t v) {
  const int32_t p = parent[v];
  if (p < -1 || p >= v_count)
    throw InvalidArgument(Indexed("parent", v), "must be -1 (a root) or " + SegmentIdIn(v_count, p));
  if (p == v) throw InvalidArgument(Indexed("parent", v), "segment " + std::to_string(v) + " is its own parent");
}

// Fills f->parent, child_offsets, children (increasing id within a parent) and roots
// (increasing id). Parents must be in range. O(V).
void BuildChildren(const int32_t* parent, int64_t v_count, SegmentForest* f, CancelToken* cancel) {
  CopyPolled(&f->parent, parent, v_count, cancel);
  ResizePolled(&f->child_offsets, v_count + 1, cancel);
  f->roots.clear();
  ForEachBlock(0, v_count, cancel, [&](int64_t v) {
    if (parent[v] < 0)
      f->roots.push_back(static_cast<int32_t>(v));
    else
      ++f->child_offsets[parent[v] + 1];
  });
  ForEachBlock(0, v_count, cancel, [&](int64_t v) { f->child_offsets[v + 1] += f->child_offsets[v]; });
  ResizePolled(&f->children, f->child_offsets[v_count], cancel);
  std::vector<int64_t> fill;
  CopyPolled(&fill, f->child_offsets.data(), v_count, cancel);
  ForEachBlock(0, v_count, cancel, [&](int64_t v) {
    if (parent[v] >= 0) f->children[fill[parent[v]]++] = static_cast<int32_t>(v);
  });
}

// Step 5: the DFS preorder over the children CSR, with an explicit stack. Segments never
// reached lie on a parent cycle, or below one; the smallest such id is reported. O(V).
std::vector<int32_t> PreorderOrThrow(const SegmentForest& f, int64_t v_count, CancelToken* cancel) {
  std::vector<int32_t> preorder;
  preorder.reserve(v_count);
  std::vector<int32_t> stack(f.roots.rbegin(), f.roots.rend());
  while (!stack.empty()) {
    Poll(cancel);
    const int32_t v = stack.back();
    stack.pop_back();
    preorder.push_back(v);
    for (int64_t i = f.child_offsets[v + 1]; i-- > f.child_offsets[v];) stack.push_back(f.children[i]);
  }
  if (static_cast<int64_t>(preorder.size()) < v_count) {
    std::vector<char> reached(v_count, 0);
    for (const int32_t v : preorder) reached[v] = 1;
    int64_t v = 0;
    while (reached[v]) ++v;
    throw InvalidArgument(Indexed("parent", v),
                          "segment " + std::to_string(v) + " lies on a parent cycle (no root above it)");
  }
  return preorder;
}

// Rows along the preorder: fills f->row_begin and f->num_rows from f->start and f->end.
void NumberRows(const std::vector<int32_t>& preorder, SegmentForest* f) {
  f->row_begin.assign(preorder.size(), 0);
  int64_t next_row = 0;
  for (const int32_t v : preorder) {
    f->row_begin[v] = next_row;
    next_row += f->end[v] - f->start[v];
  }
  f->num_rows = next_row;
}

}  // namespace

SegmentForest SegmentForestFromTree(const SegmentTreeView& t, std::vector<int32_t>* preorder_out, CancelToken* cancel) {
  Check(cancel);
  const int64_t v_count = t.num_segments, n = t.num_trajectories;
  RequireOnePer(t.num_lengths, v_count, "segment", "length");
  CheckSegmentCount(v_count, kMaxTreeSegments);
  if (n < 1) throw InvalidArgument("trajectory_end", "needs at least one trajectory");
  RequireWithinLimit(n, kMaxTrajectories, "trajectories", "trajectory_end");
  ForEachBlock(0, v_count, cancel, [&](int64_t v) {
    CheckParent(t.parent, v_count, v);
    if (t.length[v] < 1)
      throw InvalidArgument(Indexed("length", v),
                            "a segment holds at least one token, got " + std::to_string(t.length[v]));
  });
  SegmentForest f;
  BuildChildren(t.parent, v_count, &f, cancel);
  std::vector<int32_t> preorder = PreorderOrThrow(f, v_count, cancel);
  // Positions along the preorder, in int64 until step 6 bounds them: <= V * 2^31.
  std::vector<int64_t> end_position;
  ResizePolled(&end_position, v_count, cancel);
  ForEachBlock(0, v_count, cancel, [&](int64_t k) {
    const int32_t v = preorder[k];
    end_position[v] = (t.parent[v] < 0 ? 0 : end_position[t.parent[v]]) + t.length[v];
  });
  std::vector<char> ends_here;
  ResizePolled(&ends_here, v_count, cancel);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i % kPollBlock == 0) Poll(cancel);
    const int32_t v = t.trajectory_end[i];
    if (v < 0 || v >= v_count)
      throw InvalidArgument(Indexed("trajectory_end", i), "must be " + SegmentIdIn(v_count, v));
    ends_here[v] = 1;
    total += end_position[v];
    if (total > kMaxSemanticTokens)
      throw ResourceExhausted(Indexed("trajectory_end", i),
                              "the trajectories up to " + std::to_string(i) + " hold " + std::to_string(total) +
                                  " semantic tokens, over the limit of " + std::to_string(kMaxSemanticTokens));
  }
  for (int64_t v = 0; v < v_count; ++v)
    if (f.child_offsets[v + 1] == f.child_offsets[v] && !ends_here[v])
      throw InvalidArgument("trajectory_end",
                            "leaf segment " + std::to_string(v) + " ends no trajectory (every leaf must end one)");
  // Every segment lies on the path of a trajectory (its leaves end one), so every position is
  // at most a trajectory length <= kMaxSemanticTokens: int32 from here on.
  ResizePolled(&f.start, v_count, cancel);
  ResizePolled(&f.end, v_count, cancel);
  ForEachBlock(0, v_count, cancel, [&](int64_t v) {
    f.end[v] = static_cast<int32_t>(end_position[v]);
    f.start[v] = static_cast<int32_t>(end_position[v] - t.length[v]);
  });
  NumberRows(preorder, &f);
  if (preorder_out != nullptr) *preorder_out = std::move(preorder);
  return f;
}

SegmentForest SegmentForestFromArrays(const SegmentForestView& a, std::vector<int32_t>* preorder_out,
                                      CancelToken* cancel) {
  Check(cancel);
  const int64_t v_count = a.num_segments;
  RequireOnePer(a.num_starts, v_count, "segment", "start");
  RequireOnePer(a.num_ends, v_count, "segment", "end");
  CheckSegmentCount(v_count, kMaxForestSegments);
  int64_t rows = 0;
  for (int64_t v = 0; v < v_count; ++v) {
    if (v % kPollBlock == 0) Poll(cancel);
    CheckParent(a.parent, v_count, v);
    if (a.start[v] < 0) throw InvalidArgument(Indexed("start", v), MustBeAtLeast(0, a.start[v]));
    if (a.end[v] <= a.start[v])
      throw InvalidArgument(Indexed("end", v),
                            "must exceed start (" + std::to_string(a.start[v]) + "), got " + std::to_string(a.end[v]));
    rows += a.end[v] - a.start[v];
  }
  RequireWithinLimit(rows, kMaxForestRows, "compact rows", "end");
  for (int64_t v = 0; v < v_count; ++v) {
    if (v % kPollBlock == 0) Poll(cancel);
    const int32_t p = a.parent[v];
    const int64_t expected = p < 0 ? 0 : a.end[p];
    if (a.start[v] != expected)
      throw InvalidArgument(Indexed("start", v),
                            p < 0 ? "a root segment must start at position 0, got " + std::to_string(a.start[v])
                                  : "must equal end[" + std::to_string(p) + "] = " + std::to_string(expected) +
                                        " (its parent's end), got " + std::to_string(a.start[v]));
  }
  SegmentForest f;
  BuildChildren(a.parent, v_count, &f, cancel);
  std::vector<int32_t> preorder = PreorderOrThrow(f, v_count, cancel);
  f.start.assign(a.start, a.start + v_count);
  f.end.assign(a.end, a.end + v_count);
  NumberRows(preorder, &f);
  if (preorder_out != nullptr) *preorder_out = std::move(preorder);
  return f;
}

}  // namespace harts
