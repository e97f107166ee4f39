// Bindings of the step planner (harts/step_plan.h): a table of definitions.
// The Python wrapper is harts_planner.step_plan (StepPlan, plan_step). The option defaults
// and the planner's size limits are exported from the C++ definitions (default_step_options,
// planner_limits), so Python and planner.proto's comments are checked against one source.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "glue.h"
#include "harts/call_layout.h"
#include "harts/cancel.h"
#include "harts/contiguous_dp.h"
#include "harts/cp_split.h"
#include "harts/errors.h"
#include "harts/microbatch.h"
#include "harts/min_call.h"
#include "harts/natural_partition.h"
#include "harts/rollout_batch.h"
#include "harts/step_plan.h"

namespace py = pybind11;
using harts::RolloutBatch;
using harts::StepPlan;
using harts::py_glue::View;

namespace {

// The defaults of every search option (dp_size and capacity are required arguments, not options).
const harts::PlannerOptions kDefaults{};

// Search options and their defaults, in planner.proto's StepOptions order.
py::dict DefaultStepOptions() {
  py::dict d;
  d["exact_threshold"] = kDefaults.exact_threshold;
  d["max_sampled_k"] = kDefaults.max_sampled_k;
  d["refine_window"] = kDefaults.refine_window;
  d["refine_sweeps"] = kDefaults.refine_sweeps;
  d["max_anchors"] = kDefaults.max_anchors;
  d["repair_window"] = kDefaults.repair_window;
  d["repair_iterations"] = kDefaults.repair_iterations;
  d["greedy"] = kDefaults.greedy;
  d["refine"] = kDefaults.refine;
  d["component_greedy"] = kDefaults.component_greedy;
  d["search"] = kDefaults.search;
  d["contiguous_optimum"] = kDefaults.contiguous_optimum;
  d["microbatch_cost"] = kDefaults.microbatch_cost;
  d["cp_size"] = kDefaults.cp_size;
  return d;
}

// The size limits of the planner's inputs (rollout_batch.h, min_call.h, call_layout.h, step_plan.h).
py::dict PlannerLimits() {
  py::dict d;
  d["MAX_TRAJECTORIES"] = harts::kMaxTrajectories;
  d["MAX_SEMANTIC_TOKENS"] = harts::kMaxSemanticTokens;
  d["MAX_TREE_SEGMENTS"] = harts::kMaxTreeSegments;
  d["MAX_CHUNK_SIZE"] = harts::kMaxChunkSize;
  d["MAX_CONV_WIDTH"] = harts::kMaxConvWidth;
  d["MAX_EXACT_CELLS"] = harts::kMaxExactCells;
  d["MAX_CP_SIZE"] = harts::kMaxCpSize;
  return d;
}

py::tuple ObjectiveTuple(const harts::Objective& o) {
  return py::make_tuple(o.total_work, o.slot_critical_work, o.max_replica_work);
}

template <typename Member>
auto PlanView(Member member) {
  return [member](py::object self) { return View(self.cast<const StepPlan&>().*member, self); };
}

StepPlan Plan(const RolloutBatch& batch, int64_t dp_size, int64_t capacity, harts::CancelToken* cancel,
              int64_t exact_threshold, int64_t max_sampled_k, int64_t refine_window, int64_t refine_sweeps,
              int64_t max_anchors, int64_t repair_window, int64_t repair_iterations, bool greedy, bool refine,
              bool component_greedy, bool contiguous_optimum, const std::string& search, int64_t microbatch_cost,
              int64_t cp_size) {
  harts::PlannerOptions o;
  o.dp_size = dp_size;
  o.capacity = capacity;
  o.exact_threshold = exact_threshold;
  o.max_sampled_k = max_sampled_k;
  o.refine_window = refine_window;
  o.refine_sweeps = refine_sweeps;
  o.max_anchors = max_anchors;
  o.repair_window = repair_window;
  o.repair_iterations = repair_iterations;
  o.greedy = greedy;
  o.refine = refine;
  o.component_greedy = component_greedy;
  o.contiguous_optimum = contiguous_optimum;
  o.search = search;
  o.microbatch_cost = microbatch_cost;
  o.cp_size = cp_size;
  py::gil_scoped_release release;
  return harts::PlanStep(batch, o, cancel);
}

std::vector<int32_t> NaturalCuts(const RolloutBatch& batch, int64_t capacity) {
  if (capacity < 1) throw harts::InvalidArgument("capacity", "must be >= 1, got " + std::to_string(capacity));
  py::gil_scoped_release release;
  harts::CheckTrajectoriesFit(batch, capacity);
  return harts::NaturalPartition(harts::PlanContext(batch, capacity));
}

py::list ExactPartitions(const RolloutBatch& batch, int64_t capacity, const std::vector<int64_t>& ks) {
  if (capacity < 1) throw harts::InvalidArgument("capacity", "must be >= 1, got " + std::to_string(capacity));
  for (size_t i = 0; i < ks.size(); ++i)
    if (ks[i] < 1) throw harts::InvalidArgument("ks[" + std::to_string(i) + "]", "must be >= 1");
  std::vector<harts::ContiguousResult> results;
  {
    py::gil_scoped_release release;
    harts::CheckTrajectoriesFit(batch, capacity);
    results = harts::ExactContiguousPartitions(harts::PlanContext(batch, capacity), ks);
  }
  py::list out;
  for (const harts::ContiguousResult& r : results) {
    py::dict item;
    item["k"] = r.k;
    item["feasible"] = r.feasible;
    item["total_work"] = r.total_work;
    item["max_work"] = r.max_work;
    item["cuts"] = r.cuts;
    out.append(item);
  }
  return out;
}

}  // namespace

void DefineStepPlan(py::module_& m) {
  py::class_<StepPlan>(m, "StepPlan")
      .def_readonly("dp_size", &StepPlan::dp_size)
      .def_readonly("capacity", &StepPlan::capacity)
      .def_readonly("cp_size", &StepPlan::cp_size)
      .def_readonly("num_trajectories", &StepPlan::num_trajectories)
      .def_property_readonly("num_microbatches", &StepPlan::num_microbatches)
      .def_property_readonly("member_offsets", PlanView(&StepPlan::member_offsets))
      .def_property_readonly("members", PlanView(&StepPlan::members))
      .def_property_readonly("work", PlanView(&StepPlan::work))
      .def_property_readonly("replica", PlanView(&StepPlan::replica))
      .def_property_readonly("slot", PlanView(&StepPlan::slot))
      .def_property_readonly("objective", [](const StepPlan& p) { return ObjectiveTuple(p.objective); })
      .def_readonly("source", &StepPlan::source)
      .def_readonly("search_mode", &StepPlan::search_mode)
      .def_readonly("natural_k", &StepPlan::natural_k)
      .def_readonly("k_min", &StepPlan::k_min)
      .def_readonly("k_max", &StepPlan::k_max)
      .def_readonly("compact_tokens", &StepPlan::compact_tokens)
      .def_readonly("selected", &StepPlan::selected)
      .def_readonly("planning_seconds", &StepPlan::planning_seconds)
      .def_property_readonly("phase_seconds",
                             [](const StepPlan& p) {
                               py::dict d;
                               for (const auto& [name, s] : p.phase_seconds) d[py::str(name)] = s;
                               return d;
                             })
      .def_property_readonly("candidates", [](const StepPlan& p) {
        py::list out;
        for (const harts::CandidateSummary& c : p.candidates) {
          py::dict item;
          item["source"] = c.source;
          item["k"] = c.k;
          item["objective"] = ObjectiveTuple(c.objective);
          out.append(item);
        }
        return out;
      });

  // `cancel` (a CancelToken or None) has no default, so that the keyword defaults shown in the
  // signature are exactly the search options (tests/planner/test_plan_contract.py reads them).
  m.def("plan_step", &Plan, py::arg("batch"), py::arg("dp_size"), py::arg("capacity"), py::arg("cancel").none(true),
        py::arg("exact_threshold") = kDefaults.exact_threshold, py::arg("max_sampled_k") = kDefaults.max_sampled_k,
        py::arg("refine_window") = kDefaults.refine_window, py::arg("refine_sweeps") = kDefaults.refine_sweeps,
        py::arg("max_anchors") = kDefaults.max_anchors, py::arg("repair_window") = kDefaults.repair_window,
        py::arg("repair_iterations") = kDefaults.repair_iterations, py::arg("greedy") = kDefaults.greedy,
        py::arg("refine") = kDefaults.refine, py::arg("component_greedy") = kDefaults.component_greedy,
        py::arg("contiguous_optimum") = kDefaults.contiguous_optimum, py::arg("search") = kDefaults.search,
        py::arg("microbatch_cost") = kDefaults.microbatch_cost, py::arg("cp_size") = kDefaults.cp_size,
        "Plan one step (harts/step_plan.h; cancel: a CancelToken or None); releases the GIL.");
  m.def("default_step_options", &DefaultStepOptions,
        "A new dict: every search option of plan_step and its default (harts::PlannerOptions).");
  m.def("planner_limits", &PlannerLimits,
        "A new dict: the planner's size limits (kMaxTrajectories, ..., kMaxExactCells) by their Python names.");
  m.def("natural_partition", &NaturalCuts, py::arg("batch"), py::arg("capacity"),
        "Cuts (int32 ranks, K0 + 1 entries) of the natural partition P0.");
  m.def("exact_contiguous_partitions", &ExactPartitions, py::arg("batch"), py::arg("capacity"), py::arg("ks"),
        "Exact contiguous DP (Eq. 9) for each k: dicts k, feasible, total_work, max_work, cuts.");
}
