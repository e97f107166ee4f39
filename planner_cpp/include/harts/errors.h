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
// caller can locate the problem without reading the planner's source. The text of
// an error is "field: message".
//
// Messages. Every phrase that more than one check uses is built here, once, so that
// the same violation reads the same wherever it is found:
//
//   Indexed("offsets", 3)                 "offsets[3]"
//   MustBeAtLeast(lo, x)                  "must be >= lo, got x"
//   MustBeInRange(lo, hi, x)              "must be in [lo, hi], got x"     (closed range)
//   NeedsOnePer("segment", n, m)          "needs one entry per segment (n), got m"
//   ExceedsLimit(x, "segments", limit)    "x segments exceed the limit of limit"
//
// The Require* helpers check a scalar and throw the matching error; they are meant
// for checks outside hot loops (a loop checks inline and throws with a builder, so
// that no field name is formatted unless the check fails). All are O(1) and no-ops
// when the value is valid.
#ifndef HARTS_ERRORS_H_
#define HARTS_ERRORS_H_

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

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

// "name[i]".
std::string Indexed(std::string_view name, int64_t i);
// "must be >= lo, got value".
std::string MustBeAtLeast(int64_t lo, int64_t value);
// "must be in [lo, hi], got value".
std::string MustBeInRange(int64_t lo, int64_t hi, int64_t value);
// "needs one entry per <per> (expected), got size".
std::string NeedsOnePer(std::string_view per, int64_t expected, int64_t size);
// "<count> <noun> exceed the limit of <limit>" (noun is plural: "segments").
std::string ExceedsLimit(int64_t count, std::string_view noun, int64_t limit);

// InvalidArgument(field, MustBeAtLeast(lo, value)) unless value >= lo.
void RequireAtLeast(int64_t value, int64_t lo, std::string_view field);
// InvalidArgument(field, MustBeInRange(lo, hi, value)) unless lo <= value <= hi.
void RequireInRange(int64_t value, int64_t lo, int64_t hi, std::string_view field);
// InvalidArgument(field, NeedsOnePer(per, expected, size)) unless size == expected.
void RequireOnePer(int64_t size, int64_t expected, std::string_view per, std::string_view field);
// ResourceExhausted(field, ExceedsLimit(count, noun, limit)) unless count <= limit.
void RequireWithinLimit(int64_t count, int64_t limit, std::string_view noun, std::string_view field);

}  // namespace harts

#endif  // HARTS_ERRORS_H_
