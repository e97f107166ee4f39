// harts_planner._native: a table of definitions; conversion lives in glue.{h,cc}.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cmath>

#include "glue.h"
#include "harts/cancel.h"
#include "harts/errors.h"
#include "harts/rollout_batch.h"

namespace py = pybind11;
void DefineMinCall(py::module_& m);   // min_call_bindings.cc
void DefineStepPlan(py::module_& m);  // step_plan_bindings.cc
void DefineCost(py::module_& m);      // cost_bindings.cc
void DefineCpSplit(py::module_& m);   // cp_split_bindings.cc
using harts::CancelToken;
using harts::RolloutBatch;
using harts::py_glue::RequireArray;
using harts::py_glue::View;

namespace {

std::unique_ptr<RolloutBatch> Ingest(const py::handle& tokens_obj, const py::handle& offsets_obj,
                                     const py::handle& tree_ids_obj, CancelToken* cancel) {
  auto tokens = RequireArray<int32_t>(tokens_obj, "tokens");
  auto offsets = RequireArray<int64_t>(offsets_obj, "offsets");
  py::array_t<int64_t> tree_ids;
  const bool has_tree_ids = !tree_ids_obj.is_none();
  if (has_tree_ids) tree_ids = RequireArray<int64_t>(tree_ids_obj, "tree_ids");
  py::gil_scoped_release release;
  return RolloutBatch::Ingest(tokens.data(), tokens.size(), offsets.data(), offsets.size(),
                              has_tree_ids ? tree_ids.data() : nullptr, has_tree_ids ? tree_ids.size() : 0, cancel);
}

std::unique_ptr<RolloutBatch> IngestSegmentTree(const py::handle& parent_obj, const py::handle& length_obj,
                                                const py::handle& ends_obj, const py::handle& tree_ids_obj,
                                                CancelToken* cancel) {
  auto parent = RequireArray<int32_t>(parent_obj, "parent");
  auto length = RequireArray<int32_t>(length_obj, "length");
  auto ends = RequireArray<int32_t>(ends_obj, "trajectory_end");
  py::array_t<int64_t> tree_ids;
  const bool has_tree_ids = !tree_ids_obj.is_none();
  if (has_tree_ids) tree_ids = RequireArray<int64_t>(tree_ids_obj, "tree_ids");
  py::gil_scoped_release release;
  harts::SegmentTreeView view;
  view.parent = parent.data();
  view.num_segments = parent.size();
  view.length = length.data();
  view.num_lengths = length.size();
  view.trajectory_end = ends.data();
  view.num_trajectories = ends.size();
  return RolloutBatch::FromSegmentTree(view, has_tree_ids ? tree_ids.data() : nullptr,
                                       has_tree_ids ? tree_ids.size() : 0, cancel);
}

// A getter returning a view; the per-row arrays of a batch built from a tree are built on
// first use (O(S)), so the getter runs without the GIL.
template <typename Getter>
auto ViewOf(Getter getter) {
  return [getter](py::object self) {
    const RolloutBatch& b = self.cast<const RolloutBatch&>();
    const std::remove_reference_t<decltype((b.*getter)())>* out;
    {
      py::gil_scoped_release release;
      out = &(b.*getter)();
    }
    return View(*out, self);
  };
}

template <typename Member>
auto ForestView(Member member) {
  return [member](py::object self) { return View(self.cast<const RolloutBatch&>().forest().*member, self); };
}

// set_deadline(seconds): the deadline `seconds` from now (negative: already past); +inf or more
// than 10^9 s clears it. NaN is refused.
void SetDeadline(CancelToken& token, double seconds) {
  if (std::isnan(seconds)) throw harts::InvalidArgument("seconds", "must be a number of seconds, got nan");
  if (seconds >= 1e9) {
    token.SetDeadline(CancelToken::Clock::time_point::max());
    return;
  }
  seconds = std::max(seconds, -1e9);
  token.SetDeadlineAfter(
      std::chrono::duration_cast<CancelToken::Clock::duration>(std::chrono::duration<double>(seconds)));
}

int64_t SubsetWork(const RolloutBatch& b, const py::handle& ids_obj) {
  auto ids = RequireArray<int32_t>(ids_obj, "trajectories");
  py::gil_scoped_release release;
  return b.SubsetWork(ids.data(), ids.size());
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "HARTS planner core (C++). Use the harts_planner package, not this module.";
  harts::py_glue::RegisterErrors(m);
  py::class_<CancelToken>(m, "CancelToken",
                          "Cooperative cancellation of a planning call (harts/cancel.h). Pass it as `cancel=`; "
                          "cancel() or an expired set_deadline() stops the call within milliseconds with "
                          "PlanCancelledError. Thread-safe: cancel it from any thread while the call runs.")
      .def(py::init<>())
      .def("cancel", &CancelToken::Cancel, "Request cancellation (thread-safe; never undone).")
      .def("set_deadline", &SetDeadline, py::arg("seconds"),
           "Stop the call once `seconds` (float) have passed from now; a negative value is already past, "
           "+inf clears the deadline.")
      .def_property_readonly("cancel_requested", &CancelToken::cancel_requested, "True once cancel() was called.")
      .def("__repr__", [](const CancelToken& t) {
        return std::string("CancelToken(cancel_requested=") + (t.cancel_requested() ? "True" : "False") + ")";
      });
  DefineStepPlan(m);
  m.attr("MAX_TRAJECTORIES") = harts::kMaxTrajectories;
  m.attr("MAX_SEMANTIC_TOKENS") = harts::kMaxSemanticTokens;

  py::class_<RolloutBatch>(m, "CompactBatch")
      .def_property_readonly("num_trajectories", &RolloutBatch::num_trajectories)
      .def_property_readonly("semantic_tokens", &RolloutBatch::semantic_tokens)
      .def_property_readonly("compact_tokens", &RolloutBatch::compact_tokens)
      .def_property_readonly("num_segments", [](const RolloutBatch& b) { return b.forest().size(); })
      .def_property_readonly("lengths", ViewOf(&RolloutBatch::lengths))
      .def_property_readonly("tree_ids", ViewOf(&RolloutBatch::tree_ids))
      .def_property_readonly("order", ViewOf(&RolloutBatch::order))
      .def_property_readonly("rank", ViewOf(&RolloutBatch::rank))
      .def_property_readonly("adjacent_lcp", ViewOf(&RolloutBatch::adjacent_lcp))
      .def_property_readonly("compact_map", ViewOf(&RolloutBatch::row_of_position))
      .def_property_readonly("multiplicity", ViewOf(&RolloutBatch::multiplicity))
      .def_property_readonly("row_parent", ViewOf(&RolloutBatch::row_parent))
      .def_property_readonly("row_depth", ViewOf(&RolloutBatch::row_depth))
      .def_property_readonly("row_segment", ViewOf(&RolloutBatch::row_segment))
      .def_property_readonly("component", ViewOf(&RolloutBatch::component))
      .def_property_readonly("segment_root", ViewOf(&RolloutBatch::segment_root))
      .def_property_readonly("segment_start", ForestView(&harts::SegmentForest::start))
      .def_property_readonly("segment_end", ForestView(&harts::SegmentForest::end))
      .def_property_readonly("segment_parent", ForestView(&harts::SegmentForest::parent))
      .def_property_readonly("segment_subtree_end", ForestView(&harts::SegmentForest::subtree_end))
      .def_property_readonly("segment_row_begin", ForestView(&harts::SegmentForest::row_begin))
      .def_property_readonly("segment_multiplicity", ForestView(&harts::SegmentForest::multiplicity))
      .def_property_readonly("segment_child_offsets", ForestView(&harts::SegmentForest::child_offsets))
      .def_property_readonly("segment_children", ForestView(&harts::SegmentForest::children))
      .def_property_readonly("segment_end_offsets", ForestView(&harts::SegmentForest::end_offsets))
      .def_property_readonly("segment_ending", ForestView(&harts::SegmentForest::ending))
      .def_property_readonly("segment_roots", ForestView(&harts::SegmentForest::roots))
      .def(
          "lcp",
          [](const RolloutBatch& b, int64_t i, int64_t j) {
            harts::CheckTrajectoryIndex(i, b.num_trajectories(), "i");
            harts::CheckTrajectoryIndex(j, b.num_trajectories(), "j");
            return b.Lcp(i, j);
          },
          py::arg("i"), py::arg("j"))
      .def(
          "interval_work",
          [](const RolloutBatch& b, int64_t lo, int64_t hi) {
            if (lo < 0 || hi > b.num_trajectories() || lo >= hi)
              throw harts::InvalidArgument("lo, hi", "need 0 <= lo < hi <= " + std::to_string(b.num_trajectories()) +
                                                         ", got [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                                         ")");
            return b.IntervalWork(lo, hi);
          },
          py::arg("lo"), py::arg("hi"))
      .def("subset_work", &SubsetWork, py::arg("trajectories"));

  m.def("ingest_segment_tree", &IngestSegmentTree, py::arg("parent"), py::arg("length"), py::arg("trajectory_end"),
        py::arg("tree_ids") = py::none(), py::arg("cancel") = py::none(),
        "Validate and build a batch from a compacted segment tree (int32 parent, length per segment; int32 "
        "trajectory_end per trajectory; optional int64 tree ids; optional CancelToken). Releases the GIL.");
  m.def("ingest", &Ingest, py::arg("tokens"), py::arg("offsets"), py::arg("tree_ids") = py::none(),
        py::arg("cancel") = py::none(),
        "Validate and ingest a packed batch (int32 tokens, int64 offsets, optional int64 tree ids; optional "
        "CancelToken). Releases the GIL.");
  m.def(
      "rows_built", [](const RolloutBatch& b) { return b.rows_built(); }, py::arg("batch"),
      "True once the batch's per-row arrays exist (a batch from a segment tree builds them on first use).");
  DefineMinCall(m);
  DefineCost(m);
  DefineCpSplit(m);
}
