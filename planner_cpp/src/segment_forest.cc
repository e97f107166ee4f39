#include "harts/segment_forest.h"

#include <algorithm>
#include <cassert>

namespace harts {
namespace {

// A trie node under construction. Children and ending items are kept as intrusive
// singly linked lists (in insertion order) so that building allocates O(1) per node.
struct Node {
  int64_t depth = 0;
  int32_t first_child = -1, last_child = -1, next_sibling = -1;
  int32_t first_end = -1, last_end = -1;  // item positions, linked through next_end
};

class Builder {
 public:
  Builder(int64_t num_items, CancelToken* cancel) {
    AssignPolled(&next_end_, num_items, -1, cancel);
    nodes_.reserve(static_cast<size_t>(2 * num_items + 1));
    nodes_.emplace_back();  // virtual root, depth 0
  }

  int32_t NewNode(int64_t depth) {
    nodes_.emplace_back();
    nodes_.back().depth = depth;
    return static_cast<int32_t>(nodes_.size() - 1);
  }

  void AddChild(int32_t parent, int32_t child) {
    Node& p = nodes_[parent];
    if (p.last_child < 0)
      p.first_child = child;
    else
      nodes_[p.last_child].next_sibling = child;
    p.last_child = child;
  }

  void AddEnd(int32_t node, int32_t item) {
    Node& n = nodes_[node];
    if (n.last_end < 0)
      n.first_end = item;
    else
      next_end_[n.last_end] = item;
    n.last_end = item;
  }

  std::vector<Node> nodes_;
  std::vector<int32_t> next_end_;
};

}  // namespace

SegmentForest BuildSegmentForest(const int32_t* ids, const int64_t* lengths, const int32_t* lcp, int64_t num_items,
                                 CancelToken* cancel) {
  Check(cancel);
  Builder b(num_items, cancel);
  std::vector<int32_t> stack = {0};
  std::vector<int64_t> row_base;
  ResizePolled(&row_base, num_items, cancel);
  int64_t rows = 0;
  for (int64_t k = 0; k < num_items; ++k) {
    Poll(cancel);
    const int64_t l = k == 0 ? 0 : lcp[k];
    row_base[k] = rows;
    rows += lengths[k] - l;
    // Close the nodes of the previous path that lie deeper than the shared prefix.
    while (b.nodes_[stack.back()].depth > l) {
      const int32_t last = stack.back();
      stack.pop_back();
      if (b.nodes_[stack.back()].depth >= l) {
        b.AddChild(stack.back(), last);
      } else {  // the fork at depth l splits the edge above `last`
        const int32_t fork = b.NewNode(l);
        b.AddChild(fork, last);
        stack.push_back(fork);
      }
    }
    if (lengths[k] == l) {
      b.AddEnd(stack.back(), static_cast<int32_t>(k));  // identical to the previous item
    } else {
      const int32_t leaf = b.NewNode(lengths[k]);
      b.AddEnd(leaf, static_cast<int32_t>(k));
      stack.push_back(leaf);
    }
  }
  while (stack.size() > 1) {
    const int32_t last = stack.back();
    stack.pop_back();
    b.AddChild(stack.back(), last);
  }

  // Number the segments (= non-root nodes) in preorder with an explicit stack.
  SegmentForest f;
  const int64_t num_segments = static_cast<int64_t>(b.nodes_.size()) - 1;
  ResizePolled(&f.start, num_segments, cancel);
  ResizePolled(&f.end, num_segments, cancel);
  ResizePolled(&f.parent, num_segments, cancel);
  ResizePolled(&f.subtree_end, num_segments, cancel);
  ResizePolled(&f.owner, num_segments, cancel);
  ResizePolled(&f.row_begin, num_segments, cancel);
  ResizePolled(&f.multiplicity, num_segments, cancel);
  ResizePolled(&f.child_offsets, num_segments + 1, cancel);
  ResizePolled(&f.end_offsets, num_segments + 1, cancel);
  AssignPolled(&f.item_segment, num_items, -1, cancel);
  f.num_rows = rows;

  struct Frame {
    int32_t node, segment, parent_segment;
    int64_t parent_depth;
    bool entered;
  };
  std::vector<Frame> dfs;
  dfs.reserve(num_segments);  // every segment is pushed once
  std::vector<int32_t> reversed;
  auto push_children = [&](int32_t node, int32_t segment) {
    reversed.clear();
    for (int32_t c = b.nodes_[node].first_child; c >= 0; c = b.nodes_[c].next_sibling) reversed.push_back(c);
    for (auto it = reversed.rbegin(); it != reversed.rend(); ++it)
      dfs.push_back({*it, -1, segment, b.nodes_[node].depth, false});
  };
  push_children(0, -1);
  int32_t next_id = 0;
  std::vector<int32_t> child_count;
  ResizePolled(&child_count, num_segments, cancel);
  while (!dfs.empty()) {
    Poll(cancel);
    Frame& fr = dfs.back();
    if (fr.entered) {
      f.subtree_end[fr.segment] = next_id;
      if (fr.parent_segment >= 0) f.multiplicity[fr.parent_segment] += f.multiplicity[fr.segment];
      dfs.pop_back();
      continue;
    }
    fr.entered = true;
    const int32_t v = next_id++;
    fr.segment = v;
    const Node& n = b.nodes_[fr.node];
    f.start[v] = static_cast<int32_t>(fr.parent_depth);
    f.end[v] = static_cast<int32_t>(n.depth);
    f.parent[v] = fr.parent_segment;
    if (fr.parent_segment < 0)
      f.roots.push_back(v);
    else
      ++child_count[fr.parent_segment];
    int32_t count = 0;
    for (int32_t it = n.first_end; it >= 0; it = b.next_end_[it]) {
      f.item_segment[it] = v;
      ++count;
    }
    f.end_offsets[v + 1] = count;
    f.multiplicity[v] = count;  // descendants are added when they finish
    push_children(fr.node, v);
  }
  assert(next_id == num_segments);
  // Owners: visiting items in order, the first item to reach v owns it; the walk stops
  // at the first segment already owned (its ancestors are owned too). O(V + K).
  std::fill(f.owner.begin(), f.owner.end(), -1);
  ForEachBlock(0, num_items, cancel, [&](int64_t k) {
    for (int32_t v = f.item_segment[k]; v >= 0 && f.owner[v] < 0; v = f.parent[v]) f.owner[v] = static_cast<int32_t>(k);
  });
  for (int64_t v = 0; v < num_segments; ++v) {
    Poll(cancel);
    const int64_t k = f.owner[v];
    const int64_t l = k == 0 ? 0 : lcp[k];
    f.row_begin[v] = row_base[k] + (f.start[v] - l);
    f.child_offsets[v + 1] = f.child_offsets[v] + child_count[v];
    f.end_offsets[v + 1] += f.end_offsets[v];
  }
  ResizePolled(&f.children, f.child_offsets[num_segments], cancel);
  std::vector<int64_t> fill;
  CopyPolled(&fill, f.child_offsets.data(), num_segments, cancel);
  ForEachBlock(0, num_segments, cancel, [&](int64_t v) {
    if (f.parent[v] >= 0) f.children[fill[f.parent[v]]++] = static_cast<int32_t>(v);
  });
  ResizePolled(&f.ending, f.end_offsets[num_segments], cancel);
  std::vector<int64_t> end_fill;
  CopyPolled(&end_fill, f.end_offsets.data(), num_segments, cancel);
  ForEachBlock(0, num_items, cancel, [&](int64_t k) { f.ending[end_fill[f.item_segment[k]]++] = ids[k]; });
  return f;
}

}  // namespace harts
