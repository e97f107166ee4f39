// Minimal test assertions for the C++ unit tests (no framework, no network).
#ifndef HARTS_TESTS_CHECK_H_
#define HARTS_TESTS_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

#define CHECK_EQ(a, b)                                                                            \
  do {                                                                                            \
    const auto& check_a_ = (a);                                                                   \
    const auto& check_b_ = (b);                                                                   \
    if (!(check_a_ == check_b_)) {                                                                \
      std::ostringstream check_os_;                                                               \
      check_os_ << check_a_ << " != " << check_b_;                                                \
      std::fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %s (%s)\n", __FILE__, __LINE__, #a, #b, \
                   check_os_.str().c_str());                                                      \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace harts::testing {

// Runs fn() and checks that it throws E (a harts::Error subclass) naming `field`; exits otherwise.
template <typename E, typename Fn>
void ExpectError(Fn&& fn, const std::string& field) {
  try {
    fn();
  } catch (const E& e) {
    CHECK_EQ(e.field(), field);
    return;
  }
  std::fprintf(stderr, "expected an error for field %s\n", field.c_str());
  std::exit(1);
}

}  // namespace harts::testing

#endif  // HARTS_TESTS_CHECK_H_
