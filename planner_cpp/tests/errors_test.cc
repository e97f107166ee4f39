// errors.h: the message builders spell each phrase as documented, and the Require* helpers
// throw the documented type naming the field, with "field: message" as the text, exactly at
// the boundary of their condition.
#include "harts/errors.h"

#include <cstdio>
#include <string>

#include "check.h"

namespace harts {
namespace {

using testing::ExpectError;

template <typename E, typename Fn>
std::string What(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  std::fprintf(stderr, "expected an error\n");
  std::exit(1);
}

void Builders() {
  CHECK_EQ(Indexed("offsets", 3), std::string("offsets[3]"));
  CHECK_EQ(Indexed("trajectory_end", 0), std::string("trajectory_end[0]"));
  CHECK_EQ(MustBeAtLeast(0, -4), std::string("must be >= 0, got -4"));
  CHECK_EQ(MustBeInRange(1, 1024, 0), std::string("must be in [1, 1024], got 0"));
  CHECK_EQ(NeedsOnePer("segment", 2, 3), std::string("needs one entry per segment (2), got 3"));
  CHECK_EQ(ExceedsLimit(5, "segments", 4), std::string("5 segments exceed the limit of 4"));
}

void Throwers() {
  RequireAtLeast(1, 1, "dp_size");
  ExpectError<InvalidArgument>([] { RequireAtLeast(0, 1, "dp_size"); }, "dp_size");
  CHECK_EQ(What<InvalidArgument>([] { RequireAtLeast(0, 1, "dp_size"); }), std::string("dp_size: must be >= 1, got 0"));

  RequireInRange(1, 1, 8, "chunk_size");
  RequireInRange(8, 1, 8, "chunk_size");
  ExpectError<InvalidArgument>([] { RequireInRange(0, 1, 8, "chunk_size"); }, "chunk_size");
  ExpectError<InvalidArgument>([] { RequireInRange(9, 1, 8, "chunk_size"); }, "chunk_size");
  CHECK_EQ(What<InvalidArgument>([] { RequireInRange(9, 1, 8, "chunk_size"); }),
           std::string("chunk_size: must be in [1, 8], got 9"));

  RequireOnePer(3, 3, "segment", "length");
  ExpectError<InvalidArgument>([] { RequireOnePer(2, 3, "segment", "length"); }, "length");

  RequireWithinLimit(4, 4, "trajectories", "offsets");
  ExpectError<ResourceExhausted>([] { RequireWithinLimit(5, 4, "trajectories", "offsets"); }, "offsets");
  CHECK_EQ(What<ResourceExhausted>([] { RequireWithinLimit(5, 4, "trajectories", "offsets"); }),
           std::string("offsets: 5 trajectories exceed the limit of 4"));
}

}  // namespace
}  // namespace harts

int main() {
  harts::Builders();
  harts::Throwers();
  std::printf("errors_test: OK\n");
  return 0;
}
