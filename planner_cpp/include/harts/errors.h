// Error types shared by every HARTS planner module.
//
// Every precondition on caller-supplied data is checked and reported by throwing
// one of the types below; nothing in the planner aborts the process on bad input.
// The Python bindings translate them to exceptions that subclass ValueError, and
// the gRPC sidecar maps them to status codes:
//
//   InvalidArgument     -> harts_planner.InvalidArgumentError -> INVALID_ARGUMENT
//   ResourceExhausted   -> harts_planner.ResourceLimitError   -> RESOURCE_EXHAUSTED
//   FailedPrecondition  -> harts_planner.InfeasibleError      -> FAILED_PRECONDITION
//
// Glossary: `field` names the offending input (e.g. "offsets[3]"), so that a
// caller can locate the problem without reading the planner's source.
#ifndef HARTS_ERRORS_H_
#define HARTS_ERRORS_H_

#include <stdexcept>
#include <string>

namespace harts {

class Error : public std::runtime_error {
 public:
  Error(std::string field, const std::string& message)
      : std::runtime_error(field + ": " + message), field_(std::move(field)) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

// The input violates a documented precondition (bad offsets, negative ids, ...).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The input exceeds a documented size limit.
class ResourceExhausted : public Error {
 public:
  using Error::Error;
};

// The input is well formed but no plan satisfies the request (e.g. capacity).
class FailedPrecondition : public Error {
 public:
  using Error::Error;
};

}  // namespace harts

#endif  // HARTS_ERRORS_H_
