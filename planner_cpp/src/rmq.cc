#include "harts/rmq.h"

#include <algorithm>
#include <cassert>

namespace harts {
namespace {

int FloorLog2(uint64_t x) { return 63 - __builtin_clzll(x); }

}  // namespace

SparseTableRmq::SparseTableRmq(const std::vector<int32_t>& values, CancelToken* cancel)
    : n_(static_cast<int64_t>(values.size())) {
  Check(cancel);
  levels_.emplace_back();
  CopyPolled(&levels_.back(), values.data(), n_, cancel);
  for (int64_t width = 2; width <= n_; width *= 2) {
    const std::vector<int32_t>& prev = levels_.back();
    std::vector<int32_t> next;
    ResizePolled(&next, n_ - width + 1, cancel);
    const int64_t half = width / 2;
    ForEachBlock(0, n_ - width + 1, cancel, [&](int64_t i) { next[i] = std::min(prev[i], prev[i + half]); });
    levels_.push_back(std::move(next));
  }
}

int32_t SparseTableRmq::Min(int64_t l, int64_t r) const {
  assert(0 <= l && l < r && r <= n_);
  const int k = FloorLog2(static_cast<uint64_t>(r - l));
  const std::vector<int32_t>& level = levels_[k];
  return std::min(level[l], level[r - (int64_t{1} << k)]);
}

}  // namespace harts
