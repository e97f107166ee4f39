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
  explicit Builder(int64_t num_items) : next_end_(static_cast<size_t>(num_items), -1) {
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
  Builder b(num_items);
  std::vector<int32_t> stack = {0};
  std::vector<int64_t> row_base(static_cast<size_t>(num_items));
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
  f.start.resize(num_segments);
  f.end.resize(num_segments);
  f.parent.resize(num_segments);
  f.subtree_end.resize(num_segments);
  f.owner.resize(num_segments);
  f.row_begin.resize(num_segments);
  f.multiplicity.assign(num_segments, 0);
  f.child_offsets.assign(num_segments + 1, 0);
  f.end_offsets.assign(num_segments + 1, 0);
  f.item_segment.assign(num_items, -1);
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
  std::vector<int32_t> child_count(num_segments, 0);
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
  f.children.resize(f.child_offsets[num_segments]);
  std::vector<int64_t> fill(f.child_offsets.begin(), f.child_offsets.end() - 1);
  for (int64_t v = 0; v < num_segments; ++v)
    if (f.parent[v] >= 0) f.children[fill[f.parent[v]]++] = static_cast<int32_t>(v);
  f.ending.resize(f.end_offsets[num_segments]);
  std::vector<int64_t> end_fill(f.end_offsets.begin(), f.end_offsets.end() - 1);
  for (int64_t k = 0; k < num_items; ++k) f.ending[end_fill[f.item_segment[k]]++] = ids[k];
  return f;
}

}  // namespace harts
