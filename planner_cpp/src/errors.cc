#include "harts/errors.h"

namespace harts {
namespace {

std::string Str(std::string_view s) { return std::string(s); }
std::string Str(int64_t x) { return std::to_string(x); }

}  // namespace

std::string Indexed(std::string_view name, int64_t i) { return Str(name) + "[" + Str(i) + "]"; }

std::string MustBeAtLeast(int64_t lo, int64_t value) { return "must be >= " + Str(lo) + ", got " + Str(value); }

std::string MustBeInRange(int64_t lo, int64_t hi, int64_t value) {
  return "must be in [" + Str(lo) + ", " + Str(hi) + "], got " + Str(value);
}

std::string NeedsOnePer(std::string_view per, int64_t expected, int64_t size) {
  return "needs one entry per " + Str(per) + " (" + Str(expected) + "), got " + Str(size);
}

std::string ExceedsLimit(int64_t count, std::string_view noun, int64_t limit) {
  return Str(count) + " " + Str(noun) + " exceed the limit of " + Str(limit);
}

void RequireAtLeast(int64_t value, int64_t lo, std::string_view field) {
  if (value < lo) throw InvalidArgument(Str(field), MustBeAtLeast(lo, value));
}

void RequireInRange(int64_t value, int64_t lo, int64_t hi, std::string_view field) {
  if (value < lo || value > hi) throw InvalidArgument(Str(field), MustBeInRange(lo, hi, value));
}

void RequireOnePer(int64_t size, int64_t expected, std::string_view per, std::string_view field) {
  if (size != expected) throw InvalidArgument(Str(field), NeedsOnePer(per, expected, size));
}

void RequireWithinLimit(int64_t count, int64_t limit, std::string_view noun, std::string_view field) {
  if (count > limit) throw ResourceExhausted(Str(field), ExceedsLimit(count, noun, limit));
}

}  // namespace harts
