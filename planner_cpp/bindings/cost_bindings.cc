// Bindings of the cost model (harts/plan_cost.h): call shapes of a request's call plans and the
// bytes they and the batch need, computed before any planning. The Python wrapper is
// harts_planner.step_plan (estimate_cost, PlanCost, CostLimits) with the wire sizes of
// harts_planner.call_plan.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "glue.h"
#include "harts/cancel.h"
#include "harts/plan_cost.h"
#include "harts/rollout_batch.h"
#include "harts/segment_tree.h"
#include "harts/step_plan.h"

namespace py = pybind11;
using harts::CallShape;
using harts::CancelToken;
using harts::RolloutBatch;
using harts::py_glue::RequireArray;

namespace {

// The microbatch argument: None (all trajectories) or int32 ids.
struct Ids {
  py::array_t<int32_t> array;
  bool given = false;
  explicit Ids(const py::handle& obj) : given(!obj.is_none()) {
    if (given) array = RequireArray<int32_t>(obj, "trajectories");
  }
  const int32_t* data() const { return given ? array.data() : nullptr; }
  int64_t size() const { return given ? array.size() : 0; }
};

harts::SegmentTreeView TreeView(const py::array_t<int32_t>& parent, const py::array_t<int32_t>& length,
                                const py::array_t<int32_t>& ends) {
  return {parent.data(), parent.size(), length.data(), length.size(), ends.data(), ends.size()};
}

py::tuple TreeShape(const py::handle& parent_obj, const py::handle& length_obj, const py::handle& ends_obj,
                    const py::handle& ids_obj, int64_t chunk_size, int64_t conv_width, CancelToken* cancel) {
  auto parent = RequireArray<int32_t>(parent_obj, "parent");
  auto length = RequireArray<int32_t>(length_obj, "length");
  auto ends = RequireArray<int32_t>(ends_obj, "trajectory_end");
  const Ids ids(ids_obj);
  CallShape shape;
  int64_t canonical = 0;
  {
    py::gil_scoped_release release;
    shape = harts::TreeCallShape(TreeView(parent, length, ends), ids.data(), ids.size(), chunk_size, conv_width,
                                 &canonical, cancel);
  }
  return py::make_tuple(shape, canonical);
}

CallShape BatchShape(const RolloutBatch& batch, const py::handle& ids_obj, int64_t chunk_size, int64_t conv_width,
                     CancelToken* cancel) {
  const Ids ids(ids_obj);
  py::gil_scoped_release release;
  return harts::BatchCallShape(batch, ids.data(), ids.size(), chunk_size, conv_width, cancel);
}

CallShape TokenShape(int64_t num_tokens, const py::handle& offsets_obj, const py::handle& ids_obj, int64_t chunk_size,
                     int64_t conv_width) {
  auto offsets = RequireArray<int64_t>(offsets_obj, "offsets");
  const Ids ids(ids_obj);
  py::gil_scoped_release release;
  return harts::TokenCallShape(num_tokens, offsets.data(), offsets.size(), ids.data(), ids.size(), chunk_size,
                               conv_width);
}

CallShape TreePartitionShape(const py::handle& parent_obj, const py::handle& length_obj, const py::handle& ends_obj,
                             int64_t chunk_size, int64_t conv_width, CancelToken* cancel) {
  auto parent = RequireArray<int32_t>(parent_obj, "parent");
  auto length = RequireArray<int32_t>(length_obj, "length");
  auto ends = RequireArray<int32_t>(ends_obj, "trajectory_end");
  py::gil_scoped_release release;
  return harts::TreePartitionCallShape(TreeView(parent, length, ends), chunk_size, conv_width, cancel);
}

int64_t StepBytes(int64_t trajectories, int64_t canonical_segments, int64_t max_sampled_k, int64_t exact_threshold,
                  const std::string& search) {
  harts::PlannerOptions o;
  o.max_sampled_k = max_sampled_k;
  o.exact_threshold = exact_threshold;
  o.search = search;
  return harts::StepPlanBytes(trajectories, canonical_segments, o);
}

}  // namespace

void DefineCost(py::module_& m) {
  m.attr("DEFAULT_MAX_PLAN_BYTES") = harts::kDefaultMaxPlanBytes;
  py::class_<CallShape>(m, "CallShape", "Sizes of one call plan, or sums over several (harts/plan_cost.h).")
      .def_readonly("trajectories", &CallShape::trajectories)
      .def_readonly("semantic_tokens", &CallShape::semantic_tokens)
      .def_readonly("segments", &CallShape::segments)
      .def_readonly("rows", &CallShape::rows)
      .def_readonly("replay_rows", &CallShape::replay_rows)
      .def_readonly("sequences", &CallShape::sequences)
      .def_readonly("roots", &CallShape::roots)
      .def_readonly("height", &CallShape::height)
      .def_readonly("state_slots", &CallShape::state_slots)
      .def_readonly("longest_walk", &CallShape::longest_walk)
      .def_readonly("exact", &CallShape::exact)
      .def_readonly("batch_links", &CallShape::batch_links)
      .def_property_readonly("rounds", &CallShape::rounds)
      .def("__repr__", [](const CallShape& s) {
        return "CallShape(rows=" + std::to_string(s.rows) + ", replay_rows=" + std::to_string(s.replay_rows) +
               ", segments=" + std::to_string(s.segments) + ", sequences=" + std::to_string(s.sequences) +
               ", exact=" + (s.exact ? "True" : "False") + ")";
      });
  m.def("tree_call_shape", &TreeShape, py::arg("parent"), py::arg("length"), py::arg("trajectory_end"),
        py::arg("trajectories") = py::none(), py::arg("chunk_size") = 64, py::arg("conv_width") = 4,
        py::arg("cancel") = py::none(),
        "(CallShape, canonical segments): the exact shape of the call plan of a microbatch (int32 ids, None for all) "
        "of a segment tree, which is validated. O(V + N + k); releases the GIL.");
  m.def("batch_call_shape", &BatchShape, py::arg("batch"), py::arg("trajectories") = py::none(),
        py::arg("chunk_size") = 64, py::arg("conv_width") = 4, py::arg("cancel") = py::none(),
        "The exact shape of plan_calls(batch, ...). O(k log k); releases the GIL.");
  m.def("token_call_shape", &TokenShape, py::arg("num_tokens"), py::arg("offsets"),
        py::arg("trajectories") = py::none(), py::arg("chunk_size") = 64, py::arg("conv_width") = 4,
        "A bound on the shape of the call plan of a token batch's microbatch, from its offsets. O(N + k).");
  m.def("tree_partition_shape", &TreePartitionShape, py::arg("parent"), py::arg("length"), py::arg("trajectory_end"),
        py::arg("chunk_size") = 64, py::arg("conv_width") = 4, py::arg("cancel") = py::none(),
        "Bounds on the sums of the call-plan shapes of any partition of a segment tree's batch. O(V + N).");
  m.def("batch_partition_shape", &harts::BatchPartitionCallShape, py::arg("batch"), py::arg("chunk_size") = 64,
        py::arg("conv_width") = 4, py::call_guard<py::gil_scoped_release>(),
        "Bounds on the sums of the call-plan shapes of any partition of a batch. O(V).");
  m.def(
      "call_plan_bytes",
      [](const CallShape& s, int64_t chunk_size, int64_t conv_width) {
        const harts::CallBytes b = harts::CallPlanBytes(s, chunk_size, conv_width);
        return py::make_tuple(b.retained, b.scratch);
      },
      py::arg("shape"), py::arg("chunk_size"), py::arg("conv_width"),
      "(retained, scratch): bounds on the bytes plan_calls allocates for `shape`.");
  m.def("partition_retained_bytes", &harts::PartitionRetainedBytes, py::arg("shape"), py::arg("plans"),
        py::arg("chunk_size"), py::arg("conv_width"),
        "Bound on the retained bytes of at most `plans` call plans whose shapes sum to `shape`.");
  m.def("tree_ingest_bytes", &harts::TreeIngestBytes, py::arg("segments"), py::arg("trajectories"),
        py::arg("canonical_segments"), "Bound on the bytes RolloutBatch.from_segment_tree allocates.");
  m.def("token_ingest_bytes", &harts::TokenIngestBytes, py::arg("trajectories"), py::arg("semantic_tokens"),
        py::arg("compact_rows"), py::arg("canonical_segments"),
        "Bound on the bytes RolloutBatch.from_arrays allocates (per-row arrays included).");
  m.def("row_arrays_bytes", &harts::RowArraysBytes, py::arg("semantic_tokens"), py::arg("compact_rows"),
        "Bytes of the per-row arrays (compact_map, multiplicity, row_parent, row_depth, row_segment).");
  m.def("step_plan_bytes", &StepBytes, py::arg("trajectories"), py::arg("canonical_segments"), py::arg("max_sampled_k"),
        py::arg("exact_threshold"), py::arg("search"),
        "Bound on the bytes plan_step allocates (calibrated on the current step planner).");
  m.def("max_plan_bytes", &harts::MaxPlanBytes, "The most bytes one call plan may allocate (the C++ backstop).");
  m.def("set_max_plan_bytes", &harts::SetMaxPlanBytes, py::arg("bytes"),
        "Set the most bytes one call plan may allocate (>= 1); returns the previous limit. Process-wide.");
}
