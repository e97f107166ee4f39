// Conversion glue between the C++ core and Python: numpy views over vectors owned by a
// C++ object (zero copy; the view keeps its owner alive) and error translation.
#ifndef HARTS_BINDINGS_GLUE_H_
#define HARTS_BINDINGS_GLUE_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <vector>

namespace harts::py_glue {

namespace py = pybind11;

// Read-only numpy view of `v`; `owner` is the Python object that owns `v`.
template <typename T>
py::array_t<T> View(const std::vector<T>& v, py::handle owner) {
  py::array_t<T> a({static_cast<py::ssize_t>(v.size())}, {static_cast<py::ssize_t>(sizeof(T))}, v.data(), owner);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

// C-contiguous input array of exact dtype T; throws InvalidArgument naming `field`.
template <typename T>
py::array_t<T> RequireArray(const py::handle& obj, const char* field);

// Registers HartsError(ValueError) and its subclasses on `m` and translates
// harts::Error subclasses into them, with the offending field as `.field`:
// InvalidArgument -> InvalidArgumentError, ResourceExhausted -> ResourceLimitError,
// FailedPrecondition -> InfeasibleError, Cancelled -> PlanCancelledError (and
// `.deadline_exceeded`).
void RegisterErrors(py::module_& m);

}  // namespace harts::py_glue

#endif  // HARTS_BINDINGS_GLUE_H_
