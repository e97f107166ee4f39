#include "glue.h"

#include <string>

#include "harts/cancel.h"
#include "harts/errors.h"

namespace harts::py_glue {

template <typename T>
py::array_t<T> RequireArray(const py::handle& obj, const char* field) {
  if (!py::isinstance<py::array_t<T, py::array::c_style>>(obj) || !py::array_t<T, py::array::c_style>::check_(obj))
    throw InvalidArgument(field, std::string("must be a C-contiguous numpy array of dtype ") +
                                     py::str(py::dtype::of<T>()).cast<std::string>());
  py::array_t<T> a = py::reinterpret_borrow<py::array_t<T>>(obj);
  if (a.ndim() != 1)
    throw InvalidArgument(field, "must be one-dimensional, got " + std::to_string(a.ndim()) + " dimensions");
  return a;
}

template py::array_t<int32_t> RequireArray<int32_t>(const py::handle&, const char*);
template py::array_t<int64_t> RequireArray<int64_t>(const py::handle&, const char*);

namespace {

py::object& ErrorClass(const char* name) {
  // Leaked on purpose: Python objects must not be destroyed after interpreter shutdown.
  static py::object* invalid = new py::object();
  static py::object* exhausted = new py::object();
  static py::object* infeasible = new py::object();
  static py::object* cancelled = new py::object();
  std::string n(name);
  return n == "InvalidArgumentError" ? *invalid
         : n == "ResourceLimitError" ? *exhausted
         : n == "PlanCancelledError" ? *cancelled
                                     : *infeasible;
}

void Raise(const char* name, const Error& e) {
  py::object cls = ErrorClass(name);
  py::object exc = cls(e.what());
  exc.attr("field") = e.field();
  if (const auto* c = dynamic_cast<const Cancelled*>(&e)) exc.attr("deadline_exceeded") = c->deadline_exceeded();
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

}  // namespace

void RegisterErrors(py::module_& m) {
  py::object base = py::reinterpret_borrow<py::object>(PyExc_ValueError);
  py::object builtins = py::module_::import("builtins");
  py::object type = builtins.attr("type");
  auto make = [&](const char* name, py::object parent, const char* doc) {
    py::dict ns;
    ns["__doc__"] = doc;
    ns["__module__"] = "harts_planner";
    ns["field"] = py::none();
    py::object cls = type(name, py::make_tuple(parent), ns);
    m.attr(name) = cls;
    return cls;
  };
  py::object harts_error = make("HartsError", base, "Base class of planner errors; `field` names the offending input.");
  ErrorClass("InvalidArgumentError") =
      make("InvalidArgumentError", harts_error, "Input violates a documented precondition (gRPC INVALID_ARGUMENT).");
  ErrorClass("ResourceLimitError") =
      make("ResourceLimitError", harts_error, "Input exceeds a documented size limit (gRPC RESOURCE_EXHAUSTED).");
  ErrorClass("InfeasibleError") =
      make("InfeasibleError", harts_error, "No plan satisfies the request (gRPC FAILED_PRECONDITION).");
  py::object cancelled = make("PlanCancelledError", harts_error,
                              "The plan was stopped by its CancelToken: `field` is \"cancelled\" (cancel()) or "
                              "\"deadline\" (set_deadline); `deadline_exceeded` tells which (gRPC CANCELLED / "
                              "DEADLINE_EXCEEDED).");
  cancelled.attr("deadline_exceeded") = false;
  ErrorClass("PlanCancelledError") = cancelled;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidArgument& e) {
      Raise("InvalidArgumentError", e);
    } catch (const ResourceExhausted& e) {
      Raise("ResourceLimitError", e);
    } catch (const FailedPrecondition& e) {
      Raise("InfeasibleError", e);
    } catch (const Cancelled& e) {
      Raise("PlanCancelledError", e);
    }
  });
}

}  // namespace harts::py_glue
