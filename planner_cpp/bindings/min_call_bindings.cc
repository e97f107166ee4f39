// Bindings of the minimum-call planner and the compact physical layout (min_call.h,
// call_layout.h; segment_tree.h for bare forests): a table of definitions; arrays are
// zero-copy views owned by the plan.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <memory>

#include "glue.h"
#include "harts/call_layout.h"
#include "harts/cancel.h"
#include "harts/errors.h"
#include "harts/min_call.h"
#include "harts/rollout_batch.h"
#include "harts/segment_tree.h"

namespace py = pybind11;
using harts::CallLayout;
using harts::MicrobatchCallPlan;
using harts::MinCallPlan;
using harts::RolloutBatch;
using harts::SegmentForest;
using harts::py_glue::RequireArray;
using harts::py_glue::View;

namespace {

std::unique_ptr<MicrobatchCallPlan> PlanCalls(const RolloutBatch& batch, int64_t chunk_size, const py::handle& ids_obj,
                                              int64_t conv_width, harts::CancelToken* cancel) {
  py::array_t<int32_t> ids;
  const bool has_ids = !ids_obj.is_none();
  if (has_ids) ids = RequireArray<int32_t>(ids_obj, "trajectories");
  py::gil_scoped_release release;
  return std::make_unique<MicrobatchCallPlan>(harts::PlanMicrobatch(
      batch, has_ids ? ids.data() : nullptr, has_ids ? ids.size() : 0, chunk_size, conv_width, cancel));
}

harts::SegmentForestView ForestView(const py::array_t<int32_t>& parent, const py::array_t<int32_t>& start,
                                    const py::array_t<int32_t>& end) {
  return {parent.data(), parent.size(), start.data(), start.size(), end.data(), end.size()};
}

std::unique_ptr<MicrobatchCallPlan> PlanForest(const py::handle& parent_obj, const py::handle& start_obj,
                                               const py::handle& end_obj, int64_t chunk_size, int64_t conv_width,
                                               harts::CancelToken* cancel) {
  auto parent = RequireArray<int32_t>(parent_obj, "parent");
  auto start = RequireArray<int32_t>(start_obj, "start");
  auto end = RequireArray<int32_t>(end_obj, "end");
  py::gil_scoped_release release;
  harts::ValidateChunkSize(chunk_size);
  harts::ValidateConvWidth(conv_width);
  return std::make_unique<MicrobatchCallPlan>(harts::PlanSegmentForest(
      harts::SegmentForestFromArrays(ForestView(parent, start, end), nullptr, cancel), chunk_size, conv_width, cancel));
}

// Planning of a bare forest, phase by phase, for benchmarks/min_call.py (seconds, steady clock).
py::dict TimePlanForest(const py::handle& parent_obj, const py::handle& start_obj, const py::handle& end_obj,
                        int64_t chunk_size, int64_t conv_width) {
  auto parent = RequireArray<int32_t>(parent_obj, "parent");
  auto start = RequireArray<int32_t>(start_obj, "start");
  auto end = RequireArray<int32_t>(end_obj, "end");
  harts::ValidateChunkSize(chunk_size);
  harts::ValidateConvWidth(conv_width);
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  double forest_s, plan_s, layout_s;
  MinCallPlan plan;
  int64_t rows, packed;
  {
    py::gil_scoped_release release;
    const auto t0 = Clock::now();
    const SegmentForest f = harts::SegmentForestFromArrays(ForestView(parent, start, end));
    const auto t1 = Clock::now();
    plan = harts::PlanMinCalls(f, chunk_size);
    const auto t2 = Clock::now();
    const CallLayout layout = harts::BuildCallLayout(f, plan, conv_width);
    const auto t3 = Clock::now();
    forest_s = seconds(t0, t1);
    plan_s = seconds(t1, t2);
    layout_s = seconds(t2, t3);
    rows = f.num_rows;
    packed = static_cast<int64_t>(layout.gather_index.size());
  }
  py::dict d;
  d["forest_seconds"] = forest_s;
  d["plan_seconds"] = plan_s;
  d["layout_seconds"] = layout_s;
  d["num_calls"] = plan.num_calls;
  d["replay_tokens"] = plan.replay_tokens;
  d["compact_tokens"] = rows;
  d["packed_tokens"] = packed;
  d["num_sequences"] = plan.num_sequences();
  d["num_state_slots"] = plan.num_slots();
  return d;
}

// Property getters returning read-only views of a vector member of one of the plan's parts.
template <typename Part, typename T>
auto PartView(Part MicrobatchCallPlan::* part, std::vector<T> Part::* member) {
  return [part, member](py::object self) { return View(self.cast<const MicrobatchCallPlan&>().*part.*member, self); };
}

template <typename T>
auto OwnView(std::vector<T> MicrobatchCallPlan::* member) {
  return [member](py::object self) { return View(self.cast<const MicrobatchCallPlan&>().*member, self); };
}

}  // namespace

void DefineMinCall(py::module_& m) {
  m.attr("MAX_CHUNK_SIZE") = harts::kMaxChunkSize;
  m.attr("MAX_CONV_WIDTH") = harts::kMaxConvWidth;
  using M = MicrobatchCallPlan;
  py::class_<M>(m, "CallPlan")
      .def_property_readonly("chunk_size", [](const M& p) { return p.plan.chunk_size; })
      .def_property_readonly("conv_width", [](const M& p) { return p.layout.conv_width; })
      .def_property_readonly("num_calls", [](const M& p) { return p.plan.num_calls; })
      .def_property_readonly("replay_tokens", [](const M& p) { return p.plan.replay_tokens; })
      .def_property_readonly("compact_tokens", [](const M& p) { return p.forest.num_rows; })
      .def_property_readonly("num_segments", [](const M& p) { return p.forest.size(); })
      .def_property_readonly("num_sequences", [](const M& p) { return p.plan.num_sequences(); })
      .def_property_readonly("num_state_slots", [](const M& p) { return p.plan.num_slots(); })
      // Segment forest of the microbatch.
      .def_property_readonly("segment_start", PartView(&M::forest, &SegmentForest::start))
      .def_property_readonly("segment_end", PartView(&M::forest, &SegmentForest::end))
      .def_property_readonly("segment_parent", PartView(&M::forest, &SegmentForest::parent))
      .def_property_readonly("segment_child_offsets", PartView(&M::forest, &SegmentForest::child_offsets))
      .def_property_readonly("segment_children", PartView(&M::forest, &SegmentForest::children))
      .def_property_readonly("segment_roots", PartView(&M::forest, &SegmentForest::roots))
      .def_property_readonly("segment_row_begin", PartView(&M::forest, &SegmentForest::row_begin))
      // Plan.
      .def_property_readonly("t_pre", PartView(&M::plan, &MinCallPlan::t_pre))
      .def_property_readonly("t_in", PartView(&M::plan, &MinCallPlan::t_in))
      .def_property_readonly("direct_child", PartView(&M::plan, &MinCallPlan::direct_child))
      .def_property_readonly("segment_sequence", PartView(&M::plan, &MinCallPlan::segment_sequence))
      .def_property_readonly("round_sequence_offsets", PartView(&M::plan, &MinCallPlan::round_offsets))
      .def_property_readonly("sequence_round", PartView(&M::plan, &MinCallPlan::sequence_round))
      .def_property_readonly("sequence_chain_offsets", PartView(&M::plan, &MinCallPlan::chain_offsets))
      .def_property_readonly("sequence_chain", PartView(&M::plan, &MinCallPlan::chain))
      .def_property_readonly("sequence_anchor", PartView(&M::plan, &MinCallPlan::sequence_anchor))
      .def_property_readonly("sequence_start", PartView(&M::plan, &MinCallPlan::sequence_start))
      .def_property_readonly("sequence_end", PartView(&M::plan, &MinCallPlan::sequence_end))
      .def_property_readonly("sequence_state_slot", PartView(&M::plan, &MinCallPlan::sequence_slot))
      .def_property_readonly("sequence_request_offsets", PartView(&M::plan, &MinCallPlan::request_offsets))
      .def_property_readonly("slot_producer", PartView(&M::plan, &MinCallPlan::slot_producer))
      .def_property_readonly("slot_position", PartView(&M::plan, &MinCallPlan::slot_position))
      .def_property_readonly("slot_segment", PartView(&M::plan, &MinCallPlan::slot_segment))
      // Layout.
      .def_property_readonly("physical_to_row", PartView(&M::layout, &CallLayout::physical_to_row))
      .def_property_readonly("row_to_physical", PartView(&M::layout, &CallLayout::row_to_physical))
      .def_property_readonly("position_ids", PartView(&M::layout, &CallLayout::position_ids))
      .def_property_readonly("segment_physical_begin", PartView(&M::layout, &CallLayout::segment_physical_begin))
      .def_property_readonly("sequence_physical_offsets", PartView(&M::layout, &CallLayout::sequence_offsets))
      .def_property_readonly("round_physical_offsets", PartView(&M::layout, &CallLayout::round_offsets))
      .def_property_readonly("packed_offsets", PartView(&M::layout, &CallLayout::packed_offsets))
      .def_property_readonly("gather_index", PartView(&M::layout, &CallLayout::gather_index))
      .def_property_readonly("packed_output_row", PartView(&M::layout, &CallLayout::packed_output_row))
      .def_property_readonly("cu_offsets", PartView(&M::layout, &CallLayout::cu_offsets))
      .def_property_readonly("cu_seqlens", PartView(&M::layout, &CallLayout::cu_seqlens))
      .def_property_readonly("request_sequence", PartView(&M::layout, &CallLayout::request_sequence))
      .def_property_readonly("request_position", PartView(&M::layout, &CallLayout::request_position))
      .def_property_readonly("request_chunk", PartView(&M::layout, &CallLayout::request_chunk))
      .def_property_readonly("request_slot", PartView(&M::layout, &CallLayout::request_slot))
      .def_property_readonly("sequence_replay_length", PartView(&M::layout, &CallLayout::sequence_replay_length))
      .def_property_readonly("conv_context", PartView(&M::layout, &CallLayout::conv_context))
      .def_property_readonly("own_conv_context", PartView(&M::layout, &CallLayout::own_conv_context))
      // Links to the batch.
      .def_property_readonly("trajectories", OwnView(&M::trajectories))
      .def_property_readonly("row_to_global", OwnView(&M::row_to_global))
      .def_property_readonly("physical_to_global", OwnView(&M::physical_to_global))
      .def_property_readonly("semantic_offsets", OwnView(&M::semantic_offsets))
      .def_property_readonly("semantic_to_physical", OwnView(&M::semantic_to_physical));

  m.def("plan_calls", &PlanCalls, py::arg("batch"), py::arg("chunk_size"), py::arg("trajectories") = py::none(),
        py::arg("conv_width") = 4, py::arg("cancel") = py::none(),
        "Minimum-call plan and physical layout of a microbatch (int32 trajectory ids, or None for all; optional "
        "CancelToken). Releases the GIL.");
  m.def("plan_segment_forest", &PlanForest, py::arg("parent"), py::arg("start"), py::arg("end"), py::arg("chunk_size"),
        py::arg("conv_width") = 4, py::arg("cancel") = py::none(),
        "Minimum-call plan and layout of a bare segment forest (int32 parent, start, end per segment; optional "
        "CancelToken). Releases the GIL.");
  m.def("time_plan_segment_forest", &TimePlanForest, py::arg("parent"), py::arg("start"), py::arg("end"),
        py::arg("chunk_size"), py::arg("conv_width") = 4,
        "Benchmark helper: seconds spent building the forest, planning (Algorithm 1) and laying out.");
}
