// Range-minimum queries over a fixed int32 array (sparse table).
//
// Glossary
//   values   the array a[0, n) given at construction.
//   Min(l,r) min of a[l, r) for a half-open, non-empty range.
//
// Complexity: construction O(n log n) time and space (sum over levels k of n - 2^k + 1 entries),
// polling `cancel` (cancel.h; may be null) once per block of entries; Min is O(1).
// Used on the adjacent-LCP array: LCP of ranks i < j is Min(i + 1, j + 1).
#ifndef HARTS_RMQ_H_
#define HARTS_RMQ_H_

#include <cstdint>
#include <vector>

#include "harts/cancel.h"

namespace harts {

class SparseTableRmq {
 public:
  SparseTableRmq() = default;
  explicit SparseTableRmq(const std::vector<int32_t>& values, CancelToken* cancel = nullptr);

  // Minimum of values[l, r). Precondition: 0 <= l < r <= size().
  int32_t Min(int64_t l, int64_t r) const;
  int64_t size() const { return n_; }

 private:
  int64_t n_ = 0;
  // INVARIANT: levels_[k][i] = min of values[i, i + 2^k), for i + 2^k <= n_.
  std::vector<std::vector<int32_t>> levels_;
};

}  // namespace harts

#endif  // HARTS_RMQ_H_
