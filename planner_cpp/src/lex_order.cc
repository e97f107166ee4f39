#include "harts/lex_order.h"

#include <algorithm>
#include <cstring>

namespace harts {

int64_t CommonPrefixLength(const int32_t* a, int64_t n, const int32_t* b, int64_t m) {
  const int64_t len = std::min(n, m);
  int64_t i = 0;
  // Coarse blocks of 256 tokens (1 KiB), then 16 tokens (one cache line), then scalars.
  constexpr int64_t kCoarse = 256;
  constexpr int64_t kFine = 16;
  while (i + kCoarse <= len && std::memcmp(a + i, b + i, kCoarse * sizeof(int32_t)) == 0) i += kCoarse;
  while (i + kFine <= len && std::memcmp(a + i, b + i, kFine * sizeof(int32_t)) == 0) i += kFine;
  while (i < len && a[i] == b[i]) ++i;
  return i;
}

std::vector<int32_t> LexicographicOrder(const TrajectoryView& view, CancelToken* cancel) {
  Check(cancel);
  std::vector<int32_t> order;
  ResizePolled(&order, view.num_trajectories, cancel);
  ForEachBlock(0, view.num_trajectories, cancel, [&](int64_t i) { order[i] = static_cast<int32_t>(i); });
  std::stable_sort(order.begin(), order.end(), [&view, cancel](int32_t x, int32_t y) {
    Poll(cancel);
    const int64_t nx = view.length(x), ny = view.length(y);
    const int32_t* px = view.begin(x);
    const int32_t* py = view.begin(y);
    const int64_t l = CommonPrefixLength(px, nx, py, ny);
    if (l == nx || l == ny) return nx < ny;  // one is a prefix of the other
    return px[l] < py[l];
  });
  return order;
}

std::vector<int32_t> AdjacentLcp(const TrajectoryView& view, const std::vector<int32_t>& order, CancelToken* cancel) {
  Check(cancel);
  std::vector<int32_t> lcp;
  ResizePolled(&lcp, static_cast<int64_t>(order.size()), cancel);
  for (size_t r = 1; r < order.size(); ++r) {
    Poll(cancel);
    const int32_t x = order[r - 1], y = order[r];
    lcp[r] = static_cast<int32_t>(CommonPrefixLength(view.begin(x), view.length(x), view.begin(y), view.length(y)));
  }
  return lcp;
}

}  // namespace harts
