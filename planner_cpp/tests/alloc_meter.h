// A counting global allocator for the tests that check plan_cost.h against the planner's real
// allocations. Including this header in a test binary replaces operator new / delete (every
// form) by versions that keep the live and peak bytes requested; malloc does the work, so the
// sanitizers still see every buffer. Include it in one translation unit only.
//
//   harts::testing::AllocMeter meter;   // starts measuring from the current live bytes
//   ... work ...
//   meter.peak();       // most bytes live at once since the meter started, above its start
//   meter.live();       // bytes live now, above its start
#ifndef HARTS_TESTS_ALLOC_METER_H_
#define HARTS_TESTS_ALLOC_METER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace harts::testing {

inline std::atomic<int64_t> alloc_live{0};
inline std::atomic<int64_t> alloc_peak{0};

// Every block carries its size in a 16-byte header (keeps 16-byte alignment of the payload).
// Not inlined, so that the compiler never pairs an inlined operator new with this free().
[[gnu::noinline]] inline void* CountedAlloc(std::size_t size) {
  void* block = std::malloc(size + 16);
  if (block == nullptr) return nullptr;
  *static_cast<std::size_t*>(block) = size;
  const int64_t live = alloc_live.fetch_add(static_cast<int64_t>(size)) + static_cast<int64_t>(size);
  int64_t peak = alloc_peak.load();
  while (live > peak && !alloc_peak.compare_exchange_weak(peak, live)) {
  }
  return static_cast<char*>(block) + 16;
}

[[gnu::noinline]] inline void CountedFree(void* p) {
  if (p == nullptr) return;
  void* block = static_cast<char*>(p) - 16;
  alloc_live.fetch_sub(static_cast<int64_t>(*static_cast<std::size_t*>(block)));
  std::free(block);
}

class AllocMeter {
 public:
  AllocMeter() : start_(alloc_live.load()) { alloc_peak.store(start_); }
  int64_t peak() const { return alloc_peak.load() - start_; }
  int64_t live() const { return alloc_live.load() - start_; }

 private:
  int64_t start_;
};

}  // namespace harts::testing

void* operator new(std::size_t size) {
  void* p = harts::testing::CountedAlloc(size);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new[](std::size_t size) { return operator new(size); }
void* operator new(std::size_t size, const std::nothrow_t&) noexcept { return harts::testing::CountedAlloc(size); }
void* operator new[](std::size_t size, const std::nothrow_t&) noexcept { return harts::testing::CountedAlloc(size); }
void operator delete(void* p) noexcept { harts::testing::CountedFree(p); }
void operator delete[](void* p) noexcept { harts::testing::CountedFree(p); }
void operator delete(void* p, std::size_t) noexcept { harts::testing::CountedFree(p); }
void operator delete[](void* p, std::size_t) noexcept { harts::testing::CountedFree(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { harts::testing::CountedFree(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { harts::testing::CountedFree(p); }

#endif  // HARTS_TESTS_ALLOC_METER_H_
