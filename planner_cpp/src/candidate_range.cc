#include "harts/candidate_range.h"

#include <algorithm>
#include <cassert>

namespace harts {

std::vector<int64_t> KRange::Values() const {
  std::vector<int64_t> v;
  for (int64_t k = k_min; k <= k_max; k += step) v.push_back(k);
  return v;
}

KRange CandidateRange(int64_t total_work, int64_t n, int64_t dp_size, int64_t capacity, int64_t k0) {
  assert(n >= 1 && dp_size >= 1 && capacity >= 1 && k0 >= 1);
  const int64_t d = dp_size;
  // ceil(G / (T * D)) without overflowing T * D.
  const int64_t per_replica = (total_work + d - 1) / d;  // >= G / D
  int64_t groups = (per_replica + capacity - 1) / capacity;
  // ceil(G / (T D)) = ceil(ceil(G / D) / T) for positive integers.
  KRange r;
  r.step = d;
  r.k_min = d * std::max<int64_t>(1, groups);
  r.k_max = std::max(r.k_min, std::min(d * ((k0 + d - 1) / d), d * (n / d)));
  return r;
}

std::vector<int64_t> SampleK(const KRange& range, int64_t budget) {
  assert(budget >= 2);
  const int64_t count = range.Count();
  std::vector<int64_t> all = range.Values();
  if (count <= budget) return all;
  std::vector<int64_t> idx;
  const int64_t dense = budget / 2;
  for (int64_t i = 0; i < dense; ++i) idx.push_back(i);
  const int64_t sparse = budget - dense;  // includes the upper endpoint
  // Evenly spaced indices over (dense - 1, count - 1], ending at count - 1.
  for (int64_t j = 1; j <= sparse; ++j) {
    const int64_t i = (dense - 1) + ((count - dense) * j + sparse - 1) / sparse;
    idx.push_back(std::min(i, count - 1));
  }
  std::sort(idx.begin(), idx.end());
  idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
  std::vector<int64_t> out;
  for (int64_t i : idx) out.push_back(all[i]);
  return out;
}

}  // namespace harts
