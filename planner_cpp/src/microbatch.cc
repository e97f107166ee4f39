#include "harts/microbatch.h"

#include <algorithm>
#include <cassert>

namespace harts {

PlanContext::PlanContext(const RolloutBatch& batch, int64_t capacity)
    : batch_(&batch), n_(batch.num_trajectories()), capacity_(capacity), len_(n_) {
  assert(capacity >= 1);
  for (int64_t r = 0; r < n_; ++r) len_[r] = batch.lengths()[batch.order()[r]];
}

int64_t SharedAmount(const PlanContext& ctx, const std::vector<int32_t>& m, int32_t r, int32_t exclude) {
  // Members strictly below r (excluding `exclude`) and strictly above r.
  auto it = std::lower_bound(m.begin(), m.end(), r);
  auto below = it;
  int64_t shared = 0;
  while (below != m.begin()) {
    --below;
    if (*below == exclude) continue;
    shared = ctx.Lcp(*below, r);
    break;
  }
  auto above = it;
  while (above != m.end() && (*above == r || *above == exclude)) ++above;
  if (above != m.end()) shared = std::max(shared, ctx.Lcp(r, *above));
  return shared;
}

int64_t GroupWork(const PlanContext& ctx, const std::vector<int32_t>& m) {
  int64_t work = 0;
  for (size_t j = 0; j < m.size(); ++j) work += ctx.Length(m[j]) - (j == 0 ? 0 : ctx.Lcp(m[j - 1], m[j]));
  return work;
}

void InsertSorted(std::vector<int32_t>& m, int32_t r) { m.insert(std::lower_bound(m.begin(), m.end(), r), r); }

void EraseSorted(std::vector<int32_t>& m, int32_t r) {
  auto it = std::lower_bound(m.begin(), m.end(), r);
  assert(it != m.end() && *it == r);
  m.erase(it);
}

int64_t Grouping::TotalWork() const {
  int64_t total = 0;
  for (int64_t w : work) total += w;
  return total;
}

int64_t Grouping::MaxWork() const {
  int64_t best = 0;
  for (int64_t w : work) best = std::max(best, w);
  return best;
}

void ReleasePolled(Grouping* g, CancelToken* cancel) {
  while (!g->groups.empty()) {
    Poll(cancel);
    for (int64_t i = 0; i < kPollBlock && !g->groups.empty(); ++i) g->groups.pop_back();
  }
  g->groups.shrink_to_fit();
  g->work.clear();
  g->work.shrink_to_fit();
}

void CopyPolled(const Grouping& from, Grouping* to, CancelToken* cancel) {
  ReleasePolled(to, cancel);
  to->groups.reserve(from.groups.size());
  for (int64_t k = 0; k < from.size(); ++k) {
    if (k % kPollBlock == 0) Poll(cancel);
    to->groups.push_back(from.groups[k]);
  }
  to->work = from.work;
}

Grouping GroupingFromCuts(const PlanContext& ctx, const std::vector<int32_t>& cuts) {
  Grouping g;
  const size_t k = cuts.size() - 1;
  g.groups.resize(k);
  g.work.resize(k);
  for (size_t i = 0; i < k; ++i) {
    assert(cuts[i] < cuts[i + 1]);
    g.groups[i].resize(cuts[i + 1] - cuts[i]);
    for (int32_t r = cuts[i]; r < cuts[i + 1]; ++r) g.groups[i][r - cuts[i]] = r;
    g.work[i] = ctx.Work(cuts[i], cuts[i + 1]);
  }
  return g;
}

int64_t CutsTotalWork(const PlanContext& ctx, const std::vector<int32_t>& cuts) {
  int64_t total = 0;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) total += ctx.Work(cuts[i], cuts[i + 1]);
  return total;
}

int64_t CutsMaxWork(const PlanContext& ctx, const std::vector<int32_t>& cuts) {
  int64_t best = 0;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) best = std::max(best, ctx.Work(cuts[i], cuts[i + 1]));
  return best;
}

}  // namespace harts
