// Size limits on the planner's inputs, shared by ingestion (rollout_batch.h) and the
// segment-tree validator (segment_tree.h). Together they keep every compact row, semantic
// position and segment id of a batch inside int32. Exceeding one throws ResourceExhausted
// naming the field whose size is over the limit.
#ifndef HARTS_LIMITS_H_
#define HARTS_LIMITS_H_

#include <cstdint>
#include <limits>

namespace harts {

// Trajectories N of one batch.
inline constexpr int64_t kMaxTrajectories = int64_t{1} << 24;
// Semantic tokens S of one batch (the sum of the trajectory lengths).
inline constexpr int64_t kMaxSemanticTokens = std::numeric_limits<int32_t>::max();
// Segments of a compacted tree (length form): a canonical tree has at most 2N of them.
inline constexpr int64_t kMaxTreeSegments = 2 * kMaxTrajectories;
// Segments, and compact rows, of a bare segment forest (position form): int32 ids and rows.
inline constexpr int64_t kMaxForestSegments = std::numeric_limits<int32_t>::max();
inline constexpr int64_t kMaxForestRows = std::numeric_limits<int32_t>::max();

}  // namespace harts

#endif  // HARTS_LIMITS_H_
