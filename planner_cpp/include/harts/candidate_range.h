// Candidate microbatch counts (Section 3.2, Equations 7 and 8, and the sampled-K budget).
//
// Glossary
//   G       C(X), the compact work of all trajectories in one trie.
//   K_min   D * max(1, ceil(G / (T * D)))                         (Eq. 7)
//   K_max   max(K_min, min(D * ceil(K0 / D), D * floor(N / D)))  (Eq. 8)
//   range   {K_min, K_min + D, ..., K_max}; every value is DP-compatible (K mod D = 0).
//
// Any valid plan has K >= G / T (microbatch works sum to at least G), K mod D = 0 and
// K <= N (microbatches are non-empty), so K_min > D * floor(N / D) proves a request
// infeasible. K_max is clamped by D * floor(N / D), so a range value never exceeds N.
#ifndef HARTS_CANDIDATE_RANGE_H_
#define HARTS_CANDIDATE_RANGE_H_

#include <cstdint>
#include <vector>

namespace harts {

struct KRange {
  int64_t k_min = 0;
  int64_t k_max = 0;
  int64_t step = 1;  // D
  // Values k_min, k_min + step, ..., <= k_max.
  std::vector<int64_t> Values() const;
  int64_t Count() const { return k_max < k_min ? 0 : (k_max - k_min) / step + 1; }
};

// Equations (7)-(8). Preconditions: n >= 1, dp_size >= 1, capacity >= 1, k0 >= 1.
KRange CandidateRange(int64_t total_work, int64_t n, int64_t dp_size, int64_t capacity, int64_t k0);

// The sampled-K budget of heuristic search: every value of the range when it has at
// most `budget` values; otherwise both endpoints, the budget/2 smallest values starting
// at K_min (dense), and evenly spaced values over the rest of the range (sparse), at
// most `budget` values in all, ascending and distinct. Precondition: budget >= 2.
std::vector<int64_t> SampleK(const KRange& range, int64_t budget);

}  // namespace harts

#endif  // HARTS_CANDIDATE_RANGE_H_
