#include "harts/step_plan.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <numeric>
#include <optional>

#include "harts/candidate_range.h"
#include "harts/contiguous_dp.h"
#include "harts/contiguous_optimum.h"
#include "harts/cp_split.h"
#include "harts/errors.h"
#include "harts/evolution.h"
#include "harts/greedy.h"
#include "harts/microbatch.h"
#include "harts/natural_partition.h"
#include "harts/refinement.h"
#include "harts/sparse_repair.h"

namespace harts {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A candidate grouping. Contiguous candidates keep only their cuts and works; their
// Grouping is built when needed (an anchor to repair, or the winner).
struct Candidate {
  std::string source;
  std::optional<std::vector<int32_t>> cuts;  // set for contiguous candidates
  Grouping grouping;                         // groups empty for a contiguous candidate
  Schedule schedule;

  int64_t size() const { return static_cast<int64_t>(grouping.work.size()); }
  int64_t TotalWork() const { return grouping.TotalWork(); }
};

// J with every microbatch's work counted `cost` tokens more (step_plan.h, step 5): each replica
// runs K / D microbatches, one per slot.
Objective WithMicrobatchCost(const Candidate& c, int64_t cost, int64_t dp_size) {
  Objective j = c.schedule.objective;
  const int64_t slots = c.size() / dp_size;
  j.total_work += cost * c.size();
  j.slot_critical_work += cost * slots;
  j.max_replica_work += cost * slots;
  return j;
}

// Selection order (step_plan.h, step 5): the smaller J_c, then the fewer microbatches; a strict
// order, so the earlier candidate keeps a full tie.
bool Better(const Candidate& a, const Candidate& b, int64_t cost, int64_t dp_size) {
  const Objective ja = WithMicrobatchCost(a, cost, dp_size), jb = WithMicrobatchCost(b, cost, dp_size);
  if (ja < jb) return true;
  if (jb < ja) return false;
  return a.size() < b.size();
}

// The capacity as the errors name it: "T = t" (C = 1, as before CP) or "C x T = c x t = c t".
std::string CapacityText(int64_t capacity, int64_t cp_size) {
  if (cp_size == 1) return "T = " + std::to_string(capacity);
  return "C x T = " + std::to_string(cp_size) + " x " + std::to_string(capacity) + " = " +
         std::to_string(cp_size * capacity);
}

Candidate Contiguous(const PlanContext& ctx, std::string source, std::vector<int32_t> cuts) {
  Candidate c{std::move(source), std::nullopt, {}, {}};
  for (size_t i = 0; i + 1 < cuts.size(); ++i) c.grouping.work.push_back(ctx.Work(cuts[i], cuts[i + 1]));
  c.cuts = std::move(cuts);
  return c;
}

}  // namespace

void ValidatePlannerOptions(const PlannerOptions& o) {
  RequireAtLeast(o.dp_size, 1, "dp_size");
  RequireAtLeast(o.capacity, 1, "capacity");
  RequireAtLeast(o.exact_threshold, 0, "exact_threshold");
  RequireAtLeast(o.max_sampled_k, 2, "max_sampled_k");
  RequireAtLeast(o.refine_window, 0, "refine_window");
  RequireAtLeast(o.refine_sweeps, 0, "refine_sweeps");
  RequireAtLeast(o.max_anchors, 0, "max_anchors");
  RequireAtLeast(o.repair_window, 0, "repair_window");
  RequireAtLeast(o.repair_iterations, 0, "repair_iterations");
  RequireAtLeast(o.microbatch_cost, 0, "microbatch_cost");
  if (o.microbatch_cost > o.capacity)
    throw InvalidArgument("microbatch_cost", "must be <= capacity T = " + std::to_string(o.capacity) + ", got " +
                                                 std::to_string(o.microbatch_cost));
  RequireInRange(o.cp_size, 1, kMaxCpSize, "cp_size");
  if (o.capacity > kMaxCpRows / o.cp_size)
    throw InvalidArgument("cp_size", "capacity x cp_size = " + std::to_string(o.capacity) + " x " +
                                         std::to_string(o.cp_size) + " exceeds the limit of " +
                                         std::to_string(kMaxCpRows) + " compact rows per microbatch");
  if (o.search != "auto" && o.search != "exact" && o.search != "heuristic")
    throw InvalidArgument("search", "must be \"auto\", \"exact\" or \"heuristic\", got \"" + o.search + "\"");
}

void CheckTrajectoriesFit(const RolloutBatch& batch, int64_t capacity, int64_t cp_size) {
  const int64_t limit = capacity * cp_size;
  for (int64_t i = 0; i < batch.num_trajectories(); ++i)
    if (batch.lengths()[i] > limit)
      throw InvalidArgument(Indexed("trajectories", i),
                            "trajectory " + std::to_string(i) + " has " + std::to_string(batch.lengths()[i]) +
                                " tokens, more than the microbatch capacity " + CapacityText(capacity, cp_size) +
                                (cp_size == 1 ? "" : " (cp_size x capacity)") +
                                "; a trajectory cannot be split between microbatches");
}

StepPlan PlanStep(const RolloutBatch& batch, const PlannerOptions& o, CancelToken* cancel) {
  const Clock::time_point start = Clock::now();
  ValidatePlannerOptions(o);
  Check(cancel);
  const int64_t n = batch.num_trajectories();
  const int64_t d = o.dp_size;
  const int64_t cap = o.capacity * o.cp_size;  // C x T: every step below packs to this
  const std::string cap_text = CapacityText(o.capacity, o.cp_size);
  CheckTrajectoriesFit(batch, o.capacity, o.cp_size);
  if (n < d)
    throw FailedPrecondition("dp_size", "the batch has " + std::to_string(n) +
                                            " trajectories but D = " + std::to_string(d) +
                                            " replicas each need at least one non-empty "
                                            "microbatch (N >= D is required)");

  StepPlan plan;
  plan.dp_size = d;
  plan.capacity = o.capacity;
  plan.cp_size = o.cp_size;
  plan.num_trajectories = n;
  const PlanContext ctx(batch, cap);
  Clock::time_point phase = Clock::now();

  // 1. Natural partition and K range.
  const std::vector<int32_t> natural = NaturalPartition(ctx, cancel);
  const int64_t k0 = static_cast<int64_t>(natural.size()) - 1;
  const int64_t g_total = ctx.Work(0, n);
  const KRange range = CandidateRange(g_total, n, d, cap, k0);
  plan.natural_k = k0;
  plan.k_min = range.k_min;
  plan.k_max = range.k_max;
  plan.compact_tokens = g_total;
  if (range.k_min > d * (n / d))
    throw FailedPrecondition(
        "capacity", "the batch needs at least K_min = " + std::to_string(range.k_min) + " microbatches (G = " +
                        std::to_string(g_total) + " compact tokens at " + cap_text + ", D = " + std::to_string(d) +
                        ") but its " + std::to_string(n) + " trajectories fill at most " + std::to_string(d * (n / d)) +
                        " non-empty microbatches with K a multiple of D");
  plan.phase_seconds.push_back({"natural_partition", Since(phase)});
  Check(cancel);
  phase = Clock::now();

  // 2. Base candidates (dropped in the background when the plan stops early: cancel.h).
  Disposable<std::vector<Candidate>> candidates;
  std::vector<Candidate>& cands = *candidates;
  const bool exact = o.search == "exact" || (o.search == "auto" && n <= o.exact_threshold);
  plan.search_mode = exact ? "exact" : "heuristic";
  if (exact) {
    if ((range.k_max + 1) * (n + 1) > kMaxExactCells)
      throw ResourceExhausted("search", "exact search over N = " + std::to_string(n) +
                                            " trajectories and K <= " + std::to_string(range.k_max) + " needs " +
                                            std::to_string((range.k_max + 1) * (n + 1)) +
                                            " table cells, more than the limit of " + std::to_string(kMaxExactCells) +
                                            "; use search=\"auto\"");
    for (ContiguousResult& r : ExactContiguousPartitions(ctx, range.Values(), cancel))
      if (r.feasible) cands.push_back(Contiguous(ctx, "exact", std::move(r.cuts)));
  } else {
    for (EvolvedPartition& e : EvolvePartition(ctx, natural, SampleK(range, o.max_sampled_k), cancel))
      if (e.feasible) cands.push_back(Contiguous(ctx, "evolved", std::move(e.cuts)));
  }
  const size_t num_base = cands.size();
  plan.phase_seconds.push_back({exact ? "exact_dp" : "evolution", Since(phase)});
  Check(cancel);
  phase = Clock::now();

  // 3. Trie-aware greedy.
  int64_t greedy_index = -1;
  Disposable<std::optional<Grouping>> whole;  // the greedy's least-work plan, for the component greedy
  if (o.greedy) {
    GreedyResult gr = RunGreedy(ctx, d, cancel, o.component_greedy ? &*whole : nullptr);
    if (gr.feasible) {
      greedy_index = static_cast<int64_t>(cands.size());
      cands.push_back(Candidate{"greedy:" + gr.name, std::nullopt, std::move(gr.grouping), {}});
    }
  }
  int64_t component_index = -1;
  if (o.component_greedy) {
    GreedyResult cr = RunComponentGreedy(ctx, d, cancel, o.greedy ? &*whole : nullptr);
    if (*whole) ReleasePolled(&**whole, cancel);
    if (cr.feasible) {
      component_index = static_cast<int64_t>(cands.size());
      cands.push_back(Candidate{"greedy:" + cr.name, std::nullopt, std::move(cr.grouping), {}});
    }
  }
  plan.phase_seconds.push_back({"greedy", Since(phase)});
  Check(cancel);
  phase = Clock::now();

  // 4. Refinement.
  if (o.refine) {
    std::vector<int64_t> anchors;
    if (greedy_index >= 0 && o.max_anchors >= 1) anchors.push_back(greedy_index);
    if (!exact && num_base > 0) {
      std::vector<char> taken(num_base, 0);
      // Lowest base total work (ties: smaller K, i.e. earlier).
      if (static_cast<int64_t>(anchors.size()) < o.max_anchors) {
        size_t best = 0;
        for (size_t i = 1; i < num_base; ++i)
          if (cands[i].TotalWork() < cands[best].TotalWork()) best = i;
        taken[best] = 1;
        anchors.push_back(static_cast<int64_t>(best));
      }
      const int64_t ref_k = greedy_index >= 0 ? cands[greedy_index].size() : k0;
      while (static_cast<int64_t>(anchors.size()) < o.max_anchors) {
        int64_t best = -1, best_dist = 0;
        for (size_t i = 0; i < num_base; ++i) {
          if (taken[i]) continue;
          const int64_t dist = std::llabs(cands[i].size() - ref_k);
          if (best < 0 || dist < best_dist) {
            best = static_cast<int64_t>(i);
            best_dist = dist;
          }
        }
        if (best < 0) break;
        taken[best] = 1;
        anchors.push_back(best);
      }
    }
    if (component_index >= 0) anchors.push_back(component_index);  // outside the B_ref budget
    for (int64_t a : anchors) {
      int64_t changes = 0;
      Disposable<Grouping> anchor;
      Grouping& g = *anchor;
      std::string source = cands[a].source;
      if (cands[a].cuts) {
        std::vector<int32_t> cuts = *cands[a].cuts;
        const int64_t moves = RefineBoundaries(ctx, cuts, o.refine_window, o.refine_sweeps, cancel);
        changes += moves;
        if (moves > 0) source += "+boundary";
        g = GroupingFromCuts(ctx, cuts);
      } else {
        CopyPolled(cands[a].grouping, &g, cancel);
      }
      const int64_t updates = SparseRepair(ctx, g, o.repair_window, o.repair_iterations, cancel);
      changes += updates;
      if (updates > 0) source += "+repair";
      if (changes > 0) cands.push_back(Candidate{source, std::nullopt, std::move(g), {}});
    }
  }
  plan.phase_seconds.push_back({"refinement", Since(phase)});
  Check(cancel);
  phase = Clock::now();

  // 4b. The least-work contiguous partition over the whole K range (heuristic search only:
  // the exact DP already covers every K of the range), boundary-refined and sparse-repaired
  // like an anchor. Last in the order, so it only wins where it is strictly better.
  if (!exact && o.contiguous_optimum) {
    ContiguousOptimum opt = OptimalContiguousPartition(ctx, range, cancel);
    if (opt.feasible) {
      std::string source = "contiguous-optimum";
      int64_t changes = 0;
      if (o.refine) {
        const int64_t moves = RefineBoundaries(ctx, opt.cuts, o.refine_window, o.refine_sweeps, cancel);
        if (moves > 0) source += "+boundary";
      }
      cands.push_back(Contiguous(ctx, source, opt.cuts));
      if (o.refine) {
        Disposable<Grouping> repaired(GroupingFromCuts(ctx, opt.cuts));
        Grouping& g = *repaired;
        changes = SparseRepair(ctx, g, o.repair_window, o.repair_iterations, cancel);
        if (changes > 0) cands.push_back(Candidate{source + "+repair", std::nullopt, std::move(g), {}});
      }
    }
  }
  plan.phase_seconds.push_back({"contiguous_optimum", Since(phase)});
  Check(cancel);
  phase = Clock::now();

  // 5. Schedules and selection.
  if (cands.empty()) {
    throw FailedPrecondition(
        "capacity", "no candidate reached a capacity-feasible grouping with K a multiple of D = " + std::to_string(d) +
                        ": the natural partition needs K0 = " + std::to_string(k0) +
                        " microbatches, the candidate range is K in [" + std::to_string(range.k_min) + ", " +
                        std::to_string(range.k_max) + "] and N = " + std::to_string(n) +
                        " trajectories allow at most K = " + std::to_string(d * (n / d)) +
                        "; merging enough trajectories to reach a multiple of D exceeds " + cap_text);
  }
  int64_t best = -1;
  for (size_t i = 0; i < cands.size(); ++i) {
    Check(cancel);
    cands[i].schedule = AssignReplicas(cands[i].grouping.work, d);
    plan.candidates.push_back({cands[i].source, cands[i].size(), cands[i].schedule.objective});
    if (best < 0 || Better(cands[i], cands[best], o.microbatch_cost, d)) best = static_cast<int64_t>(i);
  }
  plan.selected = best;
  Candidate& c = cands[best];
  plan.source = c.source;
  plan.objective = c.schedule.objective;
  Disposable<Grouping> chosen_holder(c.cuts ? GroupingFromCuts(ctx, *c.cuts) : std::move(c.grouping));
  const Grouping& chosen = *chosen_holder;
  for (Candidate& other : cands) ReleasePolled(&other.grouping, cancel);  // the others, polled
  const int64_t k = chosen.size();
  std::vector<int32_t> by_position(k);  // microbatches ordered by (slot, replica)
  std::iota(by_position.begin(), by_position.end(), 0);
  std::sort(by_position.begin(), by_position.end(), [&](int32_t a, int32_t b) {
    return std::make_pair(c.schedule.slot[a], c.schedule.replica[a]) <
           std::make_pair(c.schedule.slot[b], c.schedule.replica[b]);
  });
  plan.member_offsets.assign(1, 0);
  plan.members.reserve(n);
  for (int32_t m : by_position) {
    Poll(cancel);
    for (int32_t r : chosen.groups[m]) plan.members.push_back(batch.order()[r]);
    plan.member_offsets.push_back(static_cast<int64_t>(plan.members.size()));
    plan.work.push_back(chosen.work[m]);
    plan.replica.push_back(c.schedule.replica[m]);
    plan.slot.push_back(c.schedule.slot[m]);
  }
  ReleasePolled(&*chosen_holder, cancel);
  plan.phase_seconds.push_back({"schedule", Since(phase)});
  plan.planning_seconds = Since(start);
  return plan;
}

}  // namespace harts
