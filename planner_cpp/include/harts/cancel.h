// Cooperative cancellation of long planner calls.
//
// A caller that may give up on a plan (the sidecar on a client's deadline or a cancelled RPC, a
// Python caller interrupted) hands a CancelToken to the planning entry points. Their long loops
// call `Poll()` and stop by throwing harts::Cancelled; nothing is left half-written that the
// caller could see (the partial plan is discarded with the exception).
//
//   CancelToken token;
//   token.SetDeadlineAfter(std::chrono::milliseconds(1000));   // optional
//   // another thread: token.Cancel();
//   PlanStep(batch, options, &token);                           // throws Cancelled
//
// Cost: `Poll()` is one relaxed atomic load plus, every kClockStride-th call, one steady-clock read;
// a loop that polls once per O(1)-to-O(log n) iteration stops within microseconds of the request.
// Entry points take `CancelToken* cancel` (nullptr: never cancelled). Cancel() and the deadline
// setters may be called from any thread at any time. Poll() is meant for the planning thread; the
// stride counter is a relaxed atomic updated without a read-modify-write, so that two plans sharing
// one token (a caller cancelling several at once) race on nothing but may lose counts (a clock read
// comes a little later; never a missed cancellation).
//
// Loops. A loop whose iterations cost O(1) to O(log n) calls Poll() once per iteration; a loop over
// rows or tokens, whose iterations cost a few nanoseconds, polls once per block of kPollBlock
// iterations (ForEachBlock below); a loop whose iterations vary in cost polls in both places. Every
// entry point also calls Check() once on entry, so that an expired deadline stops even a call too
// short to reach kClockStride polls.
#ifndef HARTS_CANCEL_H_
#define HARTS_CANCEL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "harts/errors.h"

#ifdef HARTS_PROFILE_POLL_GAPS
#include <dlfcn.h>
#include <execinfo.h>

#include <cstdio>
#endif

namespace harts {

#ifdef HARTS_PROFILE_POLL_GAPS
// A debugging aid (compile with -DHARTS_PROFILE_POLL_GAPS): every Poll() / Check() reads the clock
// and prints to stderr each stretch between two polls of one thread longer than 10 ms, with the
// return addresses (offsets in the binary; `addr2line -f -i -C -e <binary> <address>`) of both
// polls' callers. A stretch longer than the promised cancellation latency is a loop to poll.
__attribute__((noinline)) inline void ProfilePollGap() {
  constexpr int kFrames = 6;
  static thread_local int64_t last = 0;
  static thread_local void* last_frames[kFrames] = {};
  void* frames[kFrames] = {};
  const int got = backtrace(frames, kFrames);
  const int64_t now =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  if (last != 0 && now - last > 10'000'000) {
    Dl_info info{};
    dladdr(reinterpret_cast<void*>(&ProfilePollGap), &info);
    const char* base = static_cast<const char*>(info.dli_fbase);
    std::fprintf(stderr, "HARTS_POLL_GAP %.1f ms from", (now - last) / 1e6);
    for (int i = 1; i < kFrames; ++i)
      std::fprintf(stderr, " 0x%lx", static_cast<unsigned long>(static_cast<const char*>(last_frames[i]) - base));
    std::fprintf(stderr, " to");
    for (int i = 1; i < got; ++i)
      std::fprintf(stderr, " 0x%lx", static_cast<unsigned long>(static_cast<const char*>(frames[i]) - base));
    std::fprintf(stderr, "\n");
  }
  last = now;
  for (int i = 0; i < kFrames; ++i) last_frames[i] = frames[i];
}
#define HARTS_POLL_GAP_HOOK() ProfilePollGap()
#else
#define HARTS_POLL_GAP_HOOK() ((void)0)
#endif

// The plan was stopped: the caller cancelled it, or its deadline passed. `field()` is "deadline"
// for an expired deadline and "cancelled" for an explicit Cancel().
class Cancelled : public Error {
 public:
  using Error::Error;
  bool deadline_exceeded() const { return field() == "deadline"; }
};

class CancelToken {
 public:
  using Clock = std::chrono::steady_clock;
  // Polls between two clock reads.
  static constexpr uint32_t kClockStride = 256;

  CancelToken() = default;
  CancelToken(const CancelToken&) = delete;
  CancelToken& operator=(const CancelToken&) = delete;

  // Requests cancellation; the next Poll() of the planning thread throws. Thread-safe.
  void Cancel() noexcept { cancelled_.store(true, std::memory_order_relaxed); }

  // Sets (or moves) the deadline. Thread-safe.
  void SetDeadline(Clock::time_point when) noexcept {
    deadline_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(when.time_since_epoch()).count(),
                       std::memory_order_relaxed);
  }
  void SetDeadlineAfter(Clock::duration after) noexcept { SetDeadline(Clock::now() + after); }

  bool cancel_requested() const noexcept { return cancelled_.load(std::memory_order_relaxed); }

  // Throws Cancelled when cancellation was requested or the deadline has passed (the clock is read
  // on every kClockStride-th call). O(1).
  void Poll() {
    HARTS_POLL_GAP_HOOK();
    if (cancelled_.load(std::memory_order_relaxed)) throw Cancelled("cancelled", "the plan was cancelled");
    const uint32_t polls = polls_.load(std::memory_order_relaxed) + 1;
    polls_.store(polls, std::memory_order_relaxed);
    if (polls % kClockStride == 0) CheckDeadline();
  }

  // As Poll(), reading the clock now (for coarse checkpoints between phases).
  void Check() {
    HARTS_POLL_GAP_HOOK();
    if (cancelled_.load(std::memory_order_relaxed)) throw Cancelled("cancelled", "the plan was cancelled");
    CheckDeadline();
  }

 private:
  void CheckDeadline() const {
    const int64_t deadline = deadline_ns_.load(std::memory_order_relaxed);
    if (deadline == kNoDeadline) return;
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
    if (now >= deadline) throw Cancelled("deadline", "the deadline passed while planning");
  }

  static constexpr int64_t kNoDeadline = std::numeric_limits<int64_t>::max();
  std::atomic<bool> cancelled_{false};
  std::atomic<int64_t> deadline_ns_{kNoDeadline};
  std::atomic<uint32_t> polls_{0};
};

// Poll(token) for an optional token.
inline void Poll(CancelToken* token) {
  if (token != nullptr) token->Poll();
}

// Check(token) for an optional token (phase boundaries).
inline void Check(CancelToken* token) {
  if (token != nullptr) token->Check();
}

// Iterations of a per-row or per-token loop between two polls, and elements of a bulk copy or
// fill (memcpy speed) between two polls.
inline constexpr int64_t kPollBlock = int64_t{1} << 10;
inline constexpr int64_t kPollChunk = int64_t{1} << 14;

// Calls body(lo, hi) on the consecutive pieces [lo, hi) of [begin, end), each at most `chunk`
// long, polling `token` (may be null) before each piece.
template <typename Body>
void ForEachChunk(int64_t begin, int64_t end, int64_t chunk, CancelToken* token, Body&& body) {
  for (int64_t lo = begin; lo < end; lo += chunk) {
    Poll(token);
    body(lo, end - lo > chunk ? lo + chunk : end);
  }
}

// v->assign(n, value) in pieces of kPollChunk elements, polling `token` (may be null) before each:
// a vector of billions of elements is filled at memset speed with no long stretch between polls.
// One allocation (reserve), as assign would make.
template <typename T>
void AssignPolled(std::vector<T>* v, int64_t n, const T& value, CancelToken* token) {
  v->clear();
  v->reserve(static_cast<size_t>(n));
  ForEachChunk(0, n, kPollChunk, token, [&](int64_t, int64_t hi) { v->resize(static_cast<size_t>(hi), value); });
}

// v->assign(first, first + n) in pieces, as AssignPolled.
template <typename T>
void CopyPolled(std::vector<T>* v, const T* first, int64_t n, CancelToken* token) {
  v->clear();
  v->reserve(static_cast<size_t>(n));
  ForEachChunk(0, n, kPollChunk, token, [&](int64_t lo, int64_t hi) { v->insert(v->end(), first + lo, first + hi); });
}

// v->resize(n) from empty, value-initialized, as AssignPolled.
template <typename T>
void ResizePolled(std::vector<T>* v, int64_t n, CancelToken* token) {
  AssignPolled(v, n, T(), token);
}

// std::stable_sort(v->begin(), v->end(), less), polling `token` (may be null) every kPollChunk
// elements: pieces of kPollChunk sorted one at a time, then merged pairwise (bottom-up) with a
// poll every kPollChunk outputs. The result is std::stable_sort's (a stable sort's result is
// unique; a merge takes from the right run only what is strictly less). O(n log n) time, n extra.
template <typename T, typename Less>
void StableSortPolled(std::vector<T>* v, Less less, CancelToken* token) {
  const int64_t n = static_cast<int64_t>(v->size());
  ForEachChunk(0, n, kPollChunk, token,
               [&](int64_t lo, int64_t hi) { std::stable_sort(v->begin() + lo, v->begin() + hi, less); });
  if (n <= kPollChunk) return;
  std::vector<T> buffer;
  ResizePolled(&buffer, n, token);
  T* src = v->data();
  T* dst = buffer.data();
  for (int64_t width = kPollChunk; width < n; width *= 2) {
    for (int64_t lo = 0; lo < n; lo += 2 * width) {
      const int64_t mid = std::min(n, lo + width), hi = std::min(n, lo + 2 * width);
      int64_t i = lo, j = mid;
      ForEachChunk(lo, hi, kPollChunk, token, [&](int64_t a, int64_t b) {
        for (int64_t o = a; o < b; ++o) dst[o] = (j < hi && (i >= mid || less(src[j], src[i]))) ? src[j++] : src[i++];
      });
    }
    std::swap(src, dst);
  }
  if (src != v->data())
    ForEachChunk(0, n, kPollChunk, token, [&](int64_t a, int64_t b) { std::copy(src + a, src + b, v->data() + a); });
}

// Destroys `owned` on a short-lived detached thread, so that a call stopped by Cancelled (or any
// other error) returns at once instead of first handing its touched memory back to the system,
// which costs tens of milliseconds per GB. Destroys it here when no thread can be started.
template <typename T>
void DestroyInBackground(std::unique_ptr<T> owned) {
  if (owned == nullptr) return;
  T* raw = owned.release();
  try {
    std::thread([raw] { delete raw; }).detach();
  } catch (const std::system_error&) {
    delete raw;
  }
}

// A T on the heap that a Cancelled (or any exception) unwinding its scope destroys in the
// background (DestroyInBackground), and a normal exit destroys here. For the large locals of a
// planning call (candidate lists, groupings of millions of members, indexes), whose destruction
// would otherwise delay the error by tens of milliseconds per container.
//
//   Disposable<std::vector<Candidate>> holder;
//   std::vector<Candidate>& cands = *holder;
template <typename T>
class Disposable {
 public:
  template <typename... Args>
  explicit Disposable(Args&&... args)
      : owned_(std::make_unique<T>(std::forward<Args>(args)...)), exceptions_(std::uncaught_exceptions()) {}
  Disposable(const Disposable&) = delete;
  Disposable& operator=(const Disposable&) = delete;
  ~Disposable() {
    if (std::uncaught_exceptions() > exceptions_) DestroyInBackground(std::move(owned_));
  }
  T& operator*() const { return *owned_; }
  T* operator->() const { return owned_.get(); }

 private:
  std::unique_ptr<T> owned_;
  int exceptions_;
};

// Calls body(i) for i in [begin, end), polling `token` (may be null) before every kPollBlock
// iterations. O(end - begin) calls plus (end - begin) / kPollBlock polls.
template <typename Body>
void ForEachBlock(int64_t begin, int64_t end, CancelToken* token, Body&& body) {
  ForEachChunk(begin, end, kPollBlock, token, [&body](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) body(i);
  });
}

}  // namespace harts

#endif  // HARTS_CANCEL_H_
