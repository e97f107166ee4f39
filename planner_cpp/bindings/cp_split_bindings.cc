// Bindings of the context-parallel split (harts/cp_split.h): a table of definitions; arrays are
// zero-copy views owned by the split. The Python wrapper is harts_planner.cp_split (plan_cp).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>

#include "glue.h"
#include "harts/cancel.h"
#include "harts/cp_split.h"
#include "harts/rollout_batch.h"

namespace py = pybind11;
using harts::CpSplit;
using harts::RolloutBatch;
using harts::py_glue::RequireArray;
using harts::py_glue::View;

namespace {

const harts::CpSplitOptions kDefaults{};

std::unique_ptr<CpSplit> PlanCp(const RolloutBatch& batch, const py::handle& ids_obj, int64_t cp_size,
                                int64_t chunk_size, int64_t conv_width, int64_t linear_cost, int64_t attention_cost,
                                harts::CancelToken* cancel) {
  py::array_t<int32_t> ids;
  const bool has_ids = !ids_obj.is_none();
  if (has_ids) ids = RequireArray<int32_t>(ids_obj, "microbatch");
  harts::CpSplitOptions o{cp_size, chunk_size, conv_width, linear_cost, attention_cost};
  py::gil_scoped_release release;
  return std::make_unique<CpSplit>(
      harts::PlanCpSplit(batch, has_ids ? ids.data() : nullptr, has_ids ? ids.size() : 0, o, cancel));
}

template <typename Member>
auto SplitView(Member member) {
  return [member](py::object self) { return View(self.cast<const CpSplit&>().*member, self); };
}

}  // namespace

void DefineCpSplit(py::module_& m) {
  py::class_<CpSplit>(m, "CpSplit")
      .def_readonly("cp_size", &CpSplit::cp_size)
      .def_readonly("chunk_size", &CpSplit::chunk_size)
      .def_readonly("conv_width", &CpSplit::conv_width)
      .def_readonly("linear_cost", &CpSplit::linear_cost)
      .def_readonly("attention_cost", &CpSplit::attention_cost)
      .def_readonly("num_rows", &CpSplit::num_rows)
      .def_readonly("total_cost", &CpSplit::total_cost)
      .def_readonly("max_cost", &CpSplit::max_cost)
      .def_property_readonly("rank_row_offsets", SplitView(&CpSplit::rank_row_offsets))
      .def_property_readonly("rank_cost", SplitView(&CpSplit::rank_cost))
      .def_property_readonly("receive_offsets", SplitView(&CpSplit::receive_offsets))
      .def_property_readonly("send_offsets", SplitView(&CpSplit::send_offsets))
      .def_property_readonly("receive_rank", SplitView(&CpSplit::receive_rank))
      .def_property_readonly("receive_row", SplitView(&CpSplit::receive_row))
      .def_property_readonly("receive_anchor", SplitView(&CpSplit::receive_anchor))
      .def_property_readonly("receive_state", SplitView(&CpSplit::receive_state))
      .def_property_readonly("receive_replay_offsets", SplitView(&CpSplit::receive_replay_offsets))
      .def_property_readonly("replay_rows", SplitView(&CpSplit::replay_rows))
      .def_property_readonly("receive_conv_context", SplitView(&CpSplit::receive_conv_context))
      .def_property_readonly("receive_entry_offsets", SplitView(&CpSplit::receive_entry_offsets))
      .def_property_readonly("entry_rows", SplitView(&CpSplit::entry_rows))
      .def_property_readonly("state_row", SplitView(&CpSplit::state_row))
      .def_property_readonly("state_position", SplitView(&CpSplit::state_position))
      .def_property_readonly("state_rank", SplitView(&CpSplit::state_rank))
      .def_property_readonly("state_consumer_offsets", SplitView(&CpSplit::state_consumer_offsets))
      .def_property_readonly("state_consumer_rank", SplitView(&CpSplit::state_consumer_rank));

  m.def("plan_cp", &PlanCp, py::arg("batch"), py::arg("microbatch").none(true), py::arg("cp_size"),
        py::arg("chunk_size") = kDefaults.chunk_size, py::arg("conv_width") = kDefaults.conv_width,
        py::arg("linear_cost") = kDefaults.linear_cost, py::arg("attention_cost") = kDefaults.attention_cost,
        py::arg("cancel") = py::none(),
        "Context-parallel split of one microbatch (harts/cp_split.h; microbatch: int32 trajectory ids or None "
        "for all; cancel: a CancelToken or None); releases the GIL.");
  m.attr("MAX_CP_SIZE") = harts::kMaxCpSize;
  m.attr("MAX_CP_COST") = harts::kMaxCpCost;
}
