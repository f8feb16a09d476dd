// hfjax's CPU kernels for decoding, XLA FFI custom calls built by _build.py with the host's
// compiler (-march=native): AVX-512 where the CPU has it, else AVX2 with FMA.
//
// RowsTimesWeight: a few rows of activations times a torch Linear weight, out[r, n] =
// sum_k x[r, k] * w[n, k], for 1 to 8 rows and a row-major [N, K] weight. XLA:CPU hands such
// products to a general matrix-multiply library, which copies ("packs") the weight into tiles
// before multiplying: at 8 rows that ran at ~37 GB/s of weight on an AVX-512 machine, against
// ~55-80 GB/s for one row. This kernel reads each weight row once, straight from memory, and
// keeps a few weight rows times every activation row in vector registers. The weight is cut
// into contiguous chunks that the caller and hfjax's own helper threads (below) claim in turn.
//
// DecodeAttention: a few query rows per key/value head against its cache, in one pass (below).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include <linux/futex.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// -- vectors ------------------------------------------------------------------------------
//
// The kernels are written once against these few operations on a vector of kLanes floats:
// AVX-512 (16 lanes, 32 registers) or AVX2 with FMA (8 lanes, 16 registers). A Tail is the
// mask of a vector's first n lanes, for loads and stores past the end of a row.

#if defined(__AVX512F__)

constexpr int kLanes = 16;
constexpr int kRegisters = 32;
using Vec = __m512;
using Tail = __mmask16;

inline Tail TailOf(int64_t count) { return static_cast<Tail>((1u << count) - 1); }  // count <= kLanes
inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set1(float x) { return _mm512_set1_ps(x); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec LoadTail(Tail tail, const float* p) { return _mm512_maskz_loadu_ps(tail, p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void StoreTail(Tail tail, float* p, Vec v) { _mm512_mask_storeu_ps(p, tail, v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec MaxTail(Vec acc, Tail tail, Vec v) { return _mm512_mask_max_ps(acc, tail, acc, v); }
inline Vec KeepTail(Tail tail, Vec v) { return _mm512_maskz_mov_ps(tail, v); }
inline float ReduceAdd(Vec v) { return _mm512_reduce_add_ps(v); }
inline float ReduceMax(Vec v) { return _mm512_reduce_max_ps(v); }

// e^x for x <= 0 (scores less their maximum), to ~1 ulp: x = n ln2 + y with |y| <= ln2 / 2,
// e^y by its Taylor series to y^7 (error < 1e-8), times 2^n. Below e^-87, the smallest normal
// float, it gives 0: -inf (a masked slot) included.
inline Vec Polynomial(Vec y);
inline Vec ExpNonPositive(Vec x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 y = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2, high part
  y = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.4286068203e-06f), y);          // ln 2, low part
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(Polynomial(y), n));
}

// totals[i] = the sum of v[i]'s 16 lanes, for i < kCount: 16 vectors at a time through a
// tree of shuffles and adds (45 instructions), where one horizontal sum each takes 8.
template <int kCount>
inline void SumLanes(const Vec* v, float* totals) {
  for (int base = 0; base < kCount; base += 16) {
    auto at = [&](int i) { return base + i < kCount ? v[base + i] : _mm512_setzero_ps(); };
    __m512 q[4];
    for (int g = 0; g < 4; ++g) {  // q[g], per 128-bit block: the block's sums of v[4g .. 4g + 3]
      const __m512 a = at(4 * g), b = at(4 * g + 1), c = at(4 * g + 2), d = at(4 * g + 3);
      const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
      const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
      q[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                           _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    }
    const __m512 q01 = _mm512_add_ps(_mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 q23 = _mm512_add_ps(_mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(q[2], q[3], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 all = _mm512_add_ps(_mm512_shuffle_f32x4(q01, q23, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(q01, q23, _MM_SHUFFLE(3, 1, 3, 1)));
    const int count = kCount - base < 16 ? kCount - base : 16;
    _mm512_mask_storeu_ps(totals + base, TailOf(count), all);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int kLanes = 8;
constexpr int kRegisters = 16;
using Vec = __m256;
using Tail = __m256i;  // -1 in the lanes to load or store, 0 elsewhere

inline Tail TailOf(int64_t count) {  // count <= kLanes
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Set1(float x) { return _mm256_set1_ps(x); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec LoadTail(Tail tail, const float* p) { return _mm256_maskload_ps(p, tail); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void StoreTail(Tail tail, float* p, Vec v) { _mm256_maskstore_ps(p, tail, v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec MaxTail(Vec acc, Tail tail, Vec v) {
  return _mm256_blendv_ps(acc, _mm256_max_ps(acc, v), _mm256_castsi256_ps(tail));
}
inline Vec KeepTail(Tail tail, Vec v) { return _mm256_and_ps(v, _mm256_castsi256_ps(tail)); }
inline float ReduceAdd(Vec v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}
inline float ReduceMax(Vec v) {
  __m128 top = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  top = _mm_max_ps(top, _mm_movehl_ps(top, top));
  return _mm_cvtss_f32(_mm_max_ss(top, _mm_movehdup_ps(top)));
}

inline Vec Polynomial(Vec y);
inline Vec ExpNonPositive(Vec x) {  // as the AVX-512 version above; 2^n built in the exponent bits
  const __m256 floor = _mm256_set1_ps(-87.0f);
  const __m256 normal = _mm256_cmp_ps(x, floor, _CMP_GE_OQ);
  x = _mm256_max_ps(x, floor);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 y = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  y = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.4286068203e-06f), y);
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(Polynomial(y), _mm256_castsi256_ps(exponent)), normal);
}

template <int kCount>
inline void SumLanes(const Vec* v, float* totals) {
  for (int i = 0; i < kCount; ++i) totals[i] = ReduceAdd(v[i]);
}

#else
#error "hfjax's CPU kernels need AVX-512 or AVX2 with FMA (-march=native on such a CPU)"
#endif

inline Vec Polynomial(Vec y) {  // e^y for |y| <= ln2 / 2: Taylor to y^7
  Vec p = Set1(1.0f / 5040);
  p = Fma(p, y, Set1(1.0f / 720));
  p = Fma(p, y, Set1(1.0f / 120));
  p = Fma(p, y, Set1(1.0f / 24));
  p = Fma(p, y, Set1(1.0f / 6));
  p = Fma(p, y, Set1(0.5f));
  p = Fma(p, y, Set1(1.0f));
  return Fma(p, y, Set1(1.0f));
}

// -- a few rows times a weight ------------------------------------------------------------

constexpr int64_t kMaxRows = 8;     // activation rows
constexpr int64_t kAhead = 8;       // how far ahead, in weight rows, prefetching starts
constexpr int64_t kLeastRows = 64;  // weight rows below which a product is not split between threads

// Weight rows [n, n + kAtOnce) times the kRows activation rows, into out[:, n:n + kAtOnce].
template <int kRows, int kAtOnce, bool kPrefetch>
inline void MultiplyRows(const float* x, const float* w, float* out, int64_t k_size, int64_t n_size,
                         int64_t n) {
  Vec sums[kAtOnce][kRows];
  for (int p = 0; p < kAtOnce; ++p)
    for (int r = 0; r < kRows; ++r) sums[p][r] = Zero();
  const float* rows = w + n * k_size;
  const bool prefetch = kPrefetch && n + kAhead + 2 * kAtOnce <= n_size;
  const int64_t whole = k_size / kLanes * kLanes;
  for (int64_t k = 0; k < whole; k += kLanes) {
    if (prefetch)
      for (int p = 0; p < 2 * kAtOnce; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(rows + (kAhead + p) * k_size + k), _MM_HINT_T0);
    Vec weights[kAtOnce];
    for (int p = 0; p < kAtOnce; ++p) weights[p] = Load(rows + p * k_size + k);
    for (int r = 0; r < kRows; ++r) {
      const Vec activations = Load(x + r * k_size + k);
      for (int p = 0; p < kAtOnce; ++p) sums[p][r] = Fma(weights[p], activations, sums[p][r]);
    }
  }
  if (whole < k_size) {  // the last k_size % kLanes columns, under a mask
    const Tail tail = TailOf(k_size - whole);
    Vec weights[kAtOnce];
    for (int p = 0; p < kAtOnce; ++p) weights[p] = LoadTail(tail, rows + p * k_size + whole);
    for (int r = 0; r < kRows; ++r) {
      const Vec activations = LoadTail(tail, x + r * k_size + whole);
      for (int p = 0; p < kAtOnce; ++p) sums[p][r] = Fma(weights[p], activations, sums[p][r]);
    }
  }
  if constexpr (kRows == 1) {
    for (int p = 0; p < kAtOnce; ++p) out[n + p] = ReduceAdd(sums[p][0]);
  } else {
    float totals[kAtOnce * kRows];  // totals[p * kRows + r]: the sum of sums[p][r]'s lanes
    SumLanes<kAtOnce * kRows>(&sums[0][0], totals);
    for (int r = 0; r < kRows; ++r)
      for (int p = 0; p < kAtOnce; ++p) out[r * n_size + n + p] = totals[p * kRows + r];
  }
}

// Weight rows at once: as many as keep ~20 accumulators in AVX-512's 32 registers (8 in AVX2's 16). With 1-3 activation rows the cores have time to spare per weight byte, and 6-8 weight rows
// at once keep enough loads in flight for the hardware prefetcher alone (a 150M model's weights
// read at ~95% of a plain read). From 4 rows up the multiplying takes most of the time, and each
// step over k also prefetches the same columns of the 2 x kAtOnce weight rows from kAhead rows on;
// so each row is prefetched twice, kAtOnce rows apart (at 8 rows, 1.16x faster than one prefetch
// per row 16 rows ahead on an AVX-512 machine; benchmarks/README.md).
template <int kRows>
void MultiplyChunk(const float* x, const float* w, float* out, int64_t k_size, int64_t n_size, int64_t begin,
                   int64_t end) {
  constexpr int kAccumulators = kLanes == 16 ? 20 : 8;
  constexpr int kAtOnce = std::clamp(kAccumulators / kRows, kLanes == 16 ? 2 : 1, 8);
  constexpr bool kPrefetch = kRows >= 4;
  int64_t n = begin;
  for (; n + kAtOnce <= end; n += kAtOnce) MultiplyRows<kRows, kAtOnce, kPrefetch>(x, w, out, k_size, n_size, n);
  for (; n < end; ++n) MultiplyRows<kRows, 1, kPrefetch>(x, w, out, k_size, n_size, n);
}

using ChunkFunction = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr ChunkFunction kChunkFunctions[kMaxRows + 1] = {
    nullptr,          MultiplyChunk<1>, MultiplyChunk<2>, MultiplyChunk<3>, MultiplyChunk<4>,
    MultiplyChunk<5>, MultiplyChunk<6>, MultiplyChunk<7>, MultiplyChunk<8>};

// -- helper threads ------------------------------------------------------------------------
//
// A decoding step is ~85 products of 0.8-10 MB each, every one split between the cores. With
// XLA's intra-op pool, whose threads sleep between them, the caller read much of each weight
// alone while a helper woke, at one core's share of the bandwidth. The kernels keep their own
// helpers instead, which stay awake for kSpin after a task, so within a step each product starts
// on every core at once.
//
// They must not take cores that other processes want. A helper that was preempted since it last
// slept (its involuntary context switches rose), or whose yield while spinning handed the core to
// another thread, sleeps at once instead of spinning. The caller claims chunks as the helpers do,
// so a helper that lost its core holds back one chunk at most, and the caller waits for that
// chunk on a futex, not spinning, after a short while. And while the cores are contended (a
// helper was preempted during a task, or the caller had to sleep for one), the caller runs the
// products alone for kAlone before it asks the helpers again: beside a busy process, one thread
// that keeps its core beats two that wait for each other's time slices. Only contention that
// repeats counts (kContentions within kContentionWindow): a busy process preempts the helpers on
// nearly every product, where a thread of this process that wakes briefly (a server's event loop
// handing out a decode chunk's tokens) does so once a chunk. Going alone for that made `hfjax
// serve` at one stream 1.26x slower than XLA's own products (2-core EPYC, 20m Llama).

constexpr auto kSpin = std::chrono::microseconds(1000);
constexpr int64_t kMaxHelpers = 63;
constexpr int64_t kChunksPerThread = 4;
constexpr auto kAlone = std::chrono::milliseconds(50);
constexpr int kContentions = 3;
constexpr auto kContentionWindow = std::chrono::milliseconds(10);

std::atomic<int64_t> alone_until{0};  // steady_clock nanoseconds: until then the caller works alone
std::atomic<int64_t> contended_since{0};  // when the current window of contentions began
std::atomic<int> contentions{0};          // contentions seen in that window

inline int64_t Now() { return std::chrono::steady_clock::now().time_since_epoch().count(); }

// A helper was preempted, or the caller had to sleep for one. Threads race on the counters; a
// lost count only delays going alone by one more contention.
inline void Contended() {
  const int64_t now = Now();
  if (now - contended_since.load(std::memory_order_relaxed) > std::chrono::nanoseconds(kContentionWindow).count()) {
    contended_since.store(now, std::memory_order_relaxed);
    contentions.store(0, std::memory_order_relaxed);
  }
  if (contentions.fetch_add(1, std::memory_order_relaxed) + 1 >= kContentions) {
    alone_until.store(now + std::chrono::nanoseconds(kAlone).count(), std::memory_order_relaxed);
  }
}

inline int64_t InvoluntarySwitches() {
  rusage usage;
  return getrusage(RUSAGE_THREAD, &usage) == 0 ? usage.ru_nivcsw : 0;
}

inline void FutexWait(std::atomic<int>* word, int value, const timespec* timeout = nullptr) {
  syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAIT_PRIVATE, value, timeout, nullptr, 0);
}
inline void FutexWake(std::atomic<int>* word) {
  syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}

struct Task {
  virtual void Work() = 0;
  std::atomic<int> helped{0};    // helpers that took the task and are done with it
  std::atomic<int> waiting{0};   // the caller sleeps on `helped` (futex word) until it changes
};

class Helper {
 public:
  Helper() { std::thread([this] { Run(); }).detach(); }

  // Hands `task` over unless the helper has one waiting already.
  bool Offer(Task* task) {
    Task* none = nullptr;
    if (!slot_.compare_exchange_strong(none, task)) return false;
    if (sleeping_.exchange(0) == 1) FutexWake(&sleeping_);
    return true;
  }

  // Takes `task` back; false if the helper has taken it (and will count itself in task->helped).
  bool Withdraw(Task* task) { return slot_.compare_exchange_strong(task, nullptr); }

 private:
  void Run() {
    for (;;) {
      Task* task = Next();
      const int64_t switches = InvoluntarySwitches();
      task->Work();
      if (InvoluntarySwitches() != switches) Contended();
      const bool wake = task->waiting.load();  // read first: once `helped` counts this helper, the task may be gone
      task->helped.fetch_add(1);
      if (wake) FutexWake(&task->helped);  // an address only: no memory is read
    }
  }

  // The next task: spinning for kSpin, yielding the core now and then, unless another thread
  // wants this core (it preempted the helper while it ran its last task, or while it spins);
  // then, or once the spin is over, sleeping until a task comes.
  Task* Next() {
    const int64_t before = InvoluntarySwitches();
    if (before == switches_) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      for (int64_t round = 1; std::chrono::steady_clock::now() < until; ++round) {
        for (int i = 0; i < 64; ++i) {
          if (slot_.load(std::memory_order_relaxed) != nullptr) {
            Task* task = slot_.exchange(nullptr);
            if (task != nullptr) return task;
          }
          _mm_pause();
        }
        sched_yield();  // a yield that hands the core over counts as an involuntary switch
        if (round % 8 == 0 && InvoluntarySwitches() != before) break;
      }
    }
    for (;;) {
      switches_ = InvoluntarySwitches();
      sleeping_.store(1);
      if (slot_.load() == nullptr) FutexWait(&sleeping_, 1);
      sleeping_.store(0);
      Task* task = slot_.exchange(nullptr);
      if (task != nullptr) return task;
    }
  }

  std::atomic<Task*> slot_{nullptr};
  std::atomic<int> sleeping_{0};  // the futex word: 1 while the helper sleeps or is about to
  int64_t switches_ = -1;         // the helper's involuntary context switches when it last went to sleep
};

// One helper per core this process may run on, but the caller's; started on first use and
// kept for the process.
std::vector<Helper>& Helpers() {
  static auto* helpers = [] {
    cpu_set_t cores;
    const int64_t count = sched_getaffinity(0, sizeof(cores), &cores) == 0 ? CPU_COUNT(&cores) : 1;
    return new std::vector<Helper>(std::clamp<int64_t>(count, 1, kMaxHelpers + 1) - 1);
  }();
  return *helpers;
}

// Runs body(chunk) for chunks 0 .. chunks - 1 on the calling thread and up to chunks - 1
// helpers, which claim chunks in turn. A helper that comes late finds none left, and the
// caller finishes alone when no helper is free (or exists, as in a forked child).
template <typename Body>
struct Chunks : Task {
  Chunks(Body body, int64_t chunks) : body(std::move(body)), chunks(chunks) {}
  void Work() override {
    for (int64_t chunk; (chunk = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) body(chunk);
  }
  Body body;
  int64_t chunks;
  std::atomic<int64_t> next{0};
};

int64_t Threads() { return static_cast<int64_t>(Helpers().size()) + 1; }

template <typename Body>
void RunChunks(int64_t chunks, Body body) {
  Chunks<Body> task(std::move(body), chunks);
  auto& helpers = Helpers();
  const bool alone = Now() < alone_until.load(std::memory_order_relaxed);
  const int64_t wanted = alone ? 0 : std::min<int64_t>(chunks - 1, helpers.size());
  bool offered[kMaxHelpers] = {};
  for (int64_t i = 0; i < wanted; ++i) offered[i] = helpers[i].Offer(&task);
  task.Work();
  int taken = 0;
  for (int64_t i = 0; i < wanted; ++i) taken += offered[i] && !helpers[i].Withdraw(&task);
  // Every chunk is claimed; wait for the helpers that took the task to finish theirs: spinning
  // a little, then on the futex (its timeout covers a wake that the helper skipped because it
  // read `waiting` just before the caller set it).
  const timespec timeout{0, 200 * 1000};
  for (int spins = 0; task.helped.load() < taken; ++spins) {
    if (spins < 4096) {
      _mm_pause();
      continue;
    }
    if (spins == 4096) Contended();
    task.waiting.store(1);
    const int helped = task.helped.load();
    if (helped < taken) FutexWait(&task.helped, helped, &timeout);
  }
}

// Splits n rows into chunks of a multiple of 8 rows: kChunksPerThread per thread where there are
// enough rows, so that a thread that lost its core holds back a small part of the product.
inline int64_t ChunkRows(int64_t n_size) {
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(Threads() * kChunksPerThread, n_size / kLeastRows));
  return (n_size / chunks + 7) / 8 * 8;
}

// x [R, K] times a torch Linear weight w [N, K] -> [R, N], for 1 to 8 rows.
ffi::Error RowsTimesWeight(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[1] || x_dims[0] < 1 || x_dims[0] > kMaxRows) {
    return ffi::Error::InvalidArgument("hfjax_rows_times_weight takes x [1-8, K] and a weight [N, K]");
  }
  const ChunkFunction multiply = kChunkFunctions[x_dims[0]];
  const float* rows = x.typed_data();
  const float* weight = w.typed_data();
  float* result = out->typed_data();
  const int64_t k_size = w_dims[1], n_size = w_dims[0];
  const int64_t chunk_rows = ChunkRows(n_size);
  RunChunks((n_size + chunk_rows - 1) / chunk_rows, [=](int64_t chunk) {
    const int64_t begin = chunk * chunk_rows;
    multiply(rows, weight, result, k_size, n_size, begin, std::min(n_size, begin + chunk_rows));
  });
  return ffi::Error::Success();
}


// -- decoding attention -------------------------------------------------------------------
//
// A few query rows per key/value head (query heads per group x query length) against that
// head's keys and values: scores, softmax and the weighted sum of values in one pass over the
// cache. XLA:CPU ran this as two small batched products through YNNPACK and seven fusions
// between them, ~16 us each product for a 150M model's 4 heads x 192 slots.

constexpr int64_t kMaxQueryRows = 8;
constexpr int64_t kLeastBytes = 256 << 10;  // keys and values below which attention is not split between threads

struct Attention {
  // [B, H, R, D], [B', H, K, D], [B', H, K, Dv], [B, L, S]: sequence b reads k's and v's row b,
  // its first S of K columns (B' >= B, K >= S: a slot cache whose leading rows decode over its
  // leading columns, read where it lies)
  const float *q, *k, *v, *bias;
  float* out;                     // [B, H, R, Dv]
  int64_t heads, rows, length, slots, key_length, depth, value_depth;
  float scale;
  const int32_t* used;  // [B]: the columns each sequence reads (past them every weight is 0)
};

// One (sequence, key/value head): kRows query rows; `scores` holds kRows x slots floats.
template <int kRows>
void AttendHead(const Attention& a, int64_t task, float* scores) {
  const int64_t b = task / a.heads, stride = a.slots, d_size = a.depth, dv_size = a.value_depth;
  const float* q = a.q + task * kRows * d_size;
  const float* k = a.k + task * a.key_length * d_size;
  const float* v = a.v + task * a.key_length * dv_size;
  const float* bias = a.bias + b * a.length * stride;
  const int64_t s_size = a.used[b];  // the columns read; rows of scores are `stride` apart
  float* out = a.out + task * kRows * dv_size;
  const int64_t whole = d_size / kLanes * kLanes;
  const Tail tail = TailOf(d_size - whole);
  for (int64_t s = 0; s < s_size; ++s) {  // scores[r, s] = q[r] . k[s] * scale + bias[r % L, s]
    const float* key = k + s * d_size;
    Vec sums[kRows];
    for (int r = 0; r < kRows; ++r) sums[r] = Zero();
    for (int64_t d = 0; d < whole; d += kLanes) {
      const Vec keys = Load(key + d);
      for (int r = 0; r < kRows; ++r) sums[r] = Fma(Load(q + r * d_size + d), keys, sums[r]);
    }
    if (whole < d_size) {
      const Vec keys = LoadTail(tail, key + whole);
      for (int r = 0; r < kRows; ++r) sums[r] = Fma(LoadTail(tail, q + r * d_size + whole), keys, sums[r]);
    }
    for (int r = 0; r < kRows; ++r)
      scores[r * stride + s] = ReduceAdd(sums[r]) * a.scale + bias[(r % a.length) * stride + s];
  }
  const int64_t s_whole = s_size / kLanes * kLanes;
  const Tail s_tail = TailOf(s_size - s_whole);
  float inverse[kRows];
  for (int r = 0; r < kRows; ++r) {  // softmax over each row; a row that may attend to nothing gives zeros
    float* row = scores + r * stride;
    Vec top = Set1(-INFINITY);
    for (int64_t s = 0; s < s_whole; s += kLanes) top = Max(top, Load(row + s));
    if (s_whole < s_size) top = MaxTail(top, s_tail, LoadTail(s_tail, row + s_whole));
    float most = ReduceMax(top);
    if (most == -INFINITY) most = 0.0f;  // all -inf: every weight is 0
    const Vec shift = Set1(most);
    Vec total = Zero();
    for (int64_t s = 0; s < s_whole; s += kLanes) {
      const Vec e = ExpNonPositive(Sub(Load(row + s), shift));
      Store(row + s, e);
      total = Add(total, e);
    }
    if (s_whole < s_size) {
      const Vec e = KeepTail(s_tail, ExpNonPositive(Sub(LoadTail(s_tail, row + s_whole), shift)));
      StoreTail(s_tail, row + s_whole, e);
      total = Add(total, e);
    }
    const float sum = ReduceAdd(total);
    inverse[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  // Value columns per pass, in vectors: the kRows x kChunks accumulators fit the registers.
  constexpr int kChunks = kLanes == 16 ? (kRows <= 4 ? 4 : 2) : (kRows <= 2 ? 4 : kRows <= 4 ? 2 : 1);
  for (int64_t c0 = 0; c0 < dv_size; c0 += kLanes * kChunks) {
    const int64_t width = std::min<int64_t>(kLanes * kChunks, dv_size - c0);
    const int chunks = static_cast<int>((width + kLanes - 1) / kLanes);
    Tail tails[kChunks];
    for (int c = 0; c < kChunks; ++c) tails[c] = TailOf(std::max<int64_t>(0, std::min<int64_t>(kLanes, width - kLanes * c)));
    Vec sums[kRows][kChunks];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kChunks; ++c) sums[r][c] = Zero();
    for (int64_t s = 0; s < s_size; ++s) {
      const float* value = v + s * dv_size + c0;
      Vec values[kChunks];
      for (int c = 0; c < kChunks; ++c) values[c] = c < chunks ? LoadTail(tails[c], value + kLanes * c) : Zero();
      for (int r = 0; r < kRows; ++r) {
        const Vec weight = Set1(scores[r * stride + s]);
        for (int c = 0; c < kChunks; ++c) sums[r][c] = Fma(weight, values[c], sums[r][c]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < chunks; ++c)
        StoreTail(tails[c], out + r * dv_size + c0 + kLanes * c, Mul(sums[r][c], Set1(inverse[r])));
  }
}

using HeadFunction = void (*)(const Attention&, int64_t, float*);
constexpr HeadFunction kHeadFunctions[kMaxQueryRows + 1] = {
    nullptr,       AttendHead<1>, AttendHead<2>, AttendHead<3>, AttendHead<4>,
    AttendHead<5>, AttendHead<6>, AttendHead<7>, AttendHead<8>};

// Decoding attention: q [B, H, R, D], k [B', H, K, D], v [B', H, K, Dv], bias [B, L, S] (0 or
// -inf, or a float mask; query row r reads bias row r % L) -> [B, H, R, Dv], for R <= 8.
// Sequence b reads row b of k and v, its first S columns: K is `key_length` (>= S), B' >= B.
// used [B]: the columns sequence b reads, past which every row's bias is -inf, so that every
// weight there is exactly 0: attention stops there, and its cost follows the sequence's real
// length, not the cache's. The caller gives it (`decode_attention`: the slot decode's step knows
// each row's position; other callers find it from the bias).
ffi::Error DecodeAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> used,
                           ffi::ResultBuffer<ffi::F32> out, float scale, int64_t key_length) {
  // Keys and values come in any shape with B' x H x K x D elements: the decode loop carries a
  // batch of 1 without its size-1 axes, and a reshape here would make XLA copy the cache.
  const auto qd = q.dimensions(), bd = bias.dimensions();
  const bool shapes = qd.size() == 4 && bd.size() == 3 && qd[0] >= 1 && qd[1] >= 1 && qd[2] >= 1 &&
                      qd[2] <= kMaxQueryRows && qd[3] >= 1 && bd[0] == qd[0] && bd[1] >= 1 && qd[2] % bd[1] == 0 &&
                      bd[2] >= 1 && key_length >= bd[2];
  const int64_t tasks = shapes ? qd[0] * qd[1] : 0, slots = shapes ? bd[2] : 0;
  const int64_t row = shapes ? qd[1] * key_length : 0;  // columns of one row of k and v, all heads
  const int64_t key_rows = shapes ? static_cast<int64_t>(k.element_count()) / (row * qd[3]) : 0;
  if (!shapes || key_rows < qd[0] || static_cast<int64_t>(used.element_count()) != qd[0] ||
      static_cast<int64_t>(k.element_count()) != key_rows * row * qd[3] ||
      static_cast<int64_t>(v.element_count()) % (key_rows * row) != 0 ||
      static_cast<int64_t>(out->element_count()) != tasks * qd[2] * static_cast<int64_t>(v.element_count()) / (key_rows * row)) {
    return ffi::Error::InvalidArgument(
        "hfjax_decode_attention takes q [B, H, 1-8, D], k [B', H, K, D], v [B', H, K, Dv] and bias [B, L, S], "
        "with B' >= B and K (key_length) >= S, and used [B]");
  }
  const int64_t value_depth = v.element_count() / (key_rows * row);
  std::vector<int32_t> columns(qd[0]);  // each sequence's, within [0, S]
  int64_t read = 0;  // columns read, over all sequences
  for (int64_t b = 0; b < qd[0]; ++b) {
    columns[b] = static_cast<int32_t>(std::clamp<int64_t>(used.typed_data()[b], 0, slots));
    read += columns[b];
  }
  const Attention a{q.typed_data(), k.typed_data(), v.typed_data(), bias.typed_data(), out->typed_data(),
                    qd[1], qd[2], bd[1], slots, key_length, qd[3], value_depth, scale, columns.data()};
  const HeadFunction attend = kHeadFunctions[qd[2]];
  const int64_t bytes = read * qd[1] * (qd[3] + value_depth) * 4;  // keys and values read
  const int64_t split = bytes < kLeastBytes ? 1 : std::max<int64_t>(1, std::min<int64_t>(Threads(), tasks));
  const int64_t per_chunk = (tasks + split - 1) / split;
  RunChunks((tasks + per_chunk - 1) / per_chunk, [=](int64_t chunk) {
    std::unique_ptr<float[]> scores(new float[a.rows * a.slots]);
    for (int64_t task = chunk * per_chunk; task < std::min(tasks, (chunk + 1) * per_chunk); ++task) attend(a, task, scores.get());
  });
  return ffi::Error::Success();
}

// -- a few rows times a quantized weight ------------------------------------------------------
//
// RowsTimesQuantized: x [R, K] times a weight held quantized (hfjax.quantization's Layout):
// out[r, n] = sum_k x[r, k] * (q[n, k] - zero[n / rs, k / cs]) * scale[n / rs, k / cs], with q int8
// [N, K], float8 e4m3 [N, K], or 4-bit values packed two per byte [N, K / 2] (input 2i in the low
// half). The weight is read once, as it is stored (a quarter or an eighth of float32's bytes), and
// turned into floats in registers; each group of cs inputs is summed on its own, then scaled:
// sum_g scale[g] * (sum_{k in g} x[k] q[k] - zero[g] * sum_{k in g} x[k]).
//
// Each step turns kStepInputs inputs of a weight row into kVecs vectors of floats. The input rows
// are first rearranged into the order the lanes come out in (for 4-bit values: each step's even
// inputs, then its odd ones), so every format multiplies the same way.

enum class Stored { kInt8, kFp8, kInt4 };

template <Stored S>
struct Decode;

#if defined(__AVX512F__)

template <>
struct Decode<Stored::kInt8> {
  static constexpr int kVecs = 1;
  static constexpr int64_t kStepBytes = kLanes;
  static inline void Step(const uint8_t* w, Vec* out) {
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  }
};

// e4m3 bytes -> half-precision bits (sign, then the 7 other bits shifted into the half's exponent
// and mantissa), converted exactly: each value comes out times 2^-8, which the scale puts back.
template <>
struct Decode<Stored::kFp8> {
  static constexpr int kVecs = 1;
  static constexpr int64_t kStepBytes = kLanes;
  static inline void Step(const uint8_t* w, Vec* out) {
    const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    const __m256i half = _mm256_and_si256(_mm256_slli_epi16(words, 7), _mm256_set1_epi16(static_cast<short>(0xBF80)));
    out[0] = _mm512_cvtph_ps(half);
  }
};

template <>
struct Decode<Stored::kInt4> {
  static constexpr int kVecs = 2;
  static constexpr int64_t kStepBytes = kLanes;
  static inline void Step(const uint8_t* w, Vec* out) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    out[0] = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)));
    out[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
};

#else  // AVX2 with FMA and F16C

template <>
struct Decode<Stored::kInt8> {
  static constexpr int kVecs = 1;
  static constexpr int64_t kStepBytes = kLanes;
  static inline void Step(const uint8_t* w, Vec* out) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
  }
};

template <>
struct Decode<Stored::kFp8> {
  static constexpr int kVecs = 1;
  static constexpr int64_t kStepBytes = kLanes;
  static inline void Step(const uint8_t* w, Vec* out) {
    const __m128i words = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
    const __m128i half = _mm_and_si128(_mm_slli_epi16(words, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
    out[0] = _mm256_cvtph_ps(half);
  }
};

template <>
struct Decode<Stored::kInt4> {
  static constexpr int kVecs = 2;
  static constexpr int64_t kStepBytes = kLanes;
  static inline void Step(const uint8_t* w, Vec* out) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
    out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xF)));
    out[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  }
};

#endif

struct Quantized {
  const float* x;         // [R, K], in the order the decoded lanes come out
  const uint8_t* w;       // [N, row_bytes]
  const float* scale;     // [N / rs, G]
  const float* zero;      // [N / rs, G], or null
  const float* sums;      // [R, G]: each group's sum of x, where there are zero points
  float* out;             // [R, N]
  int64_t k_size, n_size, row_bytes, groups, group_size, rows_per_scale;
  float unit;             // what each decoded value is short by: 256 for e4m3 read as halves, else 1
};

// Weight rows [n, n + kAtOnce) times the kRows activation rows, into out[:, n:n + kAtOnce].
// kGroupSteps: the steps in a group when the group is 128 inputs wide (a loop the compiler unrolls),
// or 0 for any other width (a scale per channel, other group sizes).
template <Stored S, int kRows, int kAtOnce, int kGroupSteps>
inline void MultiplyQuantizedRows(const Quantized& q, int64_t n) {
  using D = Decode<S>;
  constexpr int64_t kStepInputs = kLanes * D::kVecs;
  const int64_t step_bytes = D::kStepBytes;
  const int64_t steps = kGroupSteps > 0 ? kGroupSteps : q.group_size / kStepInputs;
  Vec totals[kAtOnce][kRows];
  float offsets[kAtOnce][kRows] = {};
  for (int p = 0; p < kAtOnce; ++p)
    for (int r = 0; r < kRows; ++r) totals[p][r] = Zero();
  for (int64_t g = 0; g < q.groups; ++g) {
    Vec sums[kAtOnce][kRows];
    for (int p = 0; p < kAtOnce; ++p)
      for (int r = 0; r < kRows; ++r) sums[p][r] = Zero();
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t k = g * q.group_size + s * kStepInputs;
      const int64_t byte = (g * steps + s) * step_bytes;
      for (int p = 0; p < kAtOnce; ++p) {
        Vec weights[D::kVecs];
        D::Step(q.w + (n + p) * q.row_bytes + byte, weights);
        for (int r = 0; r < kRows; ++r)
          for (int v = 0; v < D::kVecs; ++v)
            sums[p][r] = Fma(weights[v], Load(q.x + r * q.k_size + k + v * kLanes), sums[p][r]);
      }
    }
    for (int p = 0; p < kAtOnce; ++p) {
      const int64_t cell = (n + p) / q.rows_per_scale * q.groups + g;
      const float scale = q.scale[cell] * q.unit;
      for (int r = 0; r < kRows; ++r) totals[p][r] = Fma(sums[p][r], Set1(scale), totals[p][r]);
      if (q.zero != nullptr)
        for (int r = 0; r < kRows; ++r) offsets[p][r] += q.scale[cell] * q.zero[cell] * q.sums[r * q.groups + g];
    }
  }
  for (int p = 0; p < kAtOnce; ++p)
    for (int r = 0; r < kRows; ++r) q.out[r * q.n_size + n + p] = ReduceAdd(totals[p][r]) - offsets[p][r];
}

// As many weight rows at once as keep the sums and totals in registers.
template <Stored S, int kRows, int kGroupSteps>
void MultiplyQuantizedRowsFrom(const Quantized& q, int64_t begin, int64_t end) {
  constexpr int kAtOnce = std::clamp((kRegisters - 4) / (2 * kRows), 1, 4);
  int64_t n = begin;
  for (; n + kAtOnce <= end; n += kAtOnce) MultiplyQuantizedRows<S, kRows, kAtOnce, kGroupSteps>(q, n);
  for (; n < end; ++n) MultiplyQuantizedRows<S, kRows, 1, kGroupSteps>(q, n);
}

template <Stored S, int kRows>
void MultiplyQuantizedChunk(const Quantized& q, int64_t begin, int64_t end) {
  constexpr int kSteps128 = 128 / (kLanes * Decode<S>::kVecs);
  if (q.group_size == 128 && q.groups > 1) {
    MultiplyQuantizedRowsFrom<S, kRows, kSteps128>(q, begin, end);
  } else {
    MultiplyQuantizedRowsFrom<S, kRows, 0>(q, begin, end);
  }
}

using QuantizedChunkFunction = void (*)(const Quantized&, int64_t, int64_t);

template <Stored S>
constexpr QuantizedChunkFunction kQuantizedChunkFunctions[kMaxRows + 1] = {
    nullptr,
    MultiplyQuantizedChunk<S, 1>, MultiplyQuantizedChunk<S, 2>, MultiplyQuantizedChunk<S, 3>, MultiplyQuantizedChunk<S, 4>,
    MultiplyQuantizedChunk<S, 5>, MultiplyQuantizedChunk<S, 6>, MultiplyQuantizedChunk<S, 7>, MultiplyQuantizedChunk<S, 8>};

// x [R, K] times a quantized weight (see above) -> [R, N], for 1 to 8 rows. Attributes: the output
// rows and inputs per scale (rs, cs); has_zero: whether `zero` holds zero points (else it is ignored).
// cs, and K, must be multiples of 32 (a step of 4-bit values on AVX-512).
ffi::Error RowsTimesQuantized(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                              ffi::Buffer<ffi::F32> zero, ffi::ResultBuffer<ffi::F32> out, int64_t rows_per_scale,
                              int64_t columns_per_scale, int64_t has_zero) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  const ffi::DataType type = w.element_type();
  const Stored stored = type == ffi::DataType::S8 ? Stored::kInt8 : type == ffi::DataType::U8 ? Stored::kInt4 : Stored::kFp8;
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 2 || xd[0] < 1 || xd[0] > kMaxRows ||
      (type != ffi::DataType::S8 && type != ffi::DataType::U8 && type != ffi::DataType::F8E4M3FN)) {
    return ffi::Error::InvalidArgument("hfjax_rows_times_quantized takes x [1-8, K], an int8, uint8 or e4m3 weight and scales [G_n, G_k]");
  }
  const int64_t rows = xd[0], k_size = xd[1], n_size = wd[0];
  const int64_t row_bytes = stored == Stored::kInt4 ? k_size / 2 : k_size;
  const int64_t group_size = std::min(columns_per_scale, k_size);
  if (wd[1] != row_bytes || k_size % 32 != 0 || group_size % 32 != 0 || k_size % group_size != 0 ||
      sd[1] != k_size / group_size || sd[0] != (n_size + rows_per_scale - 1) / rows_per_scale ||
      (has_zero && static_cast<int64_t>(zero.element_count()) != sd[0] * sd[1])) {
    return ffi::Error::InvalidArgument("hfjax_rows_times_quantized: the weight, scales and x do not agree");
  }
  const int64_t groups = sd[1];
  // The input rows in the order the decoded lanes come out, and each group's sum where there are zero points.
  std::unique_ptr<float[]> ordered;
  const float* rows_in = x.typed_data();
  if (stored == Stored::kInt4) {
    ordered.reset(new float[rows * k_size]);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < k_size; k += 2 * kLanes)
        for (int64_t i = 0; i < kLanes; ++i) {
          ordered[r * k_size + k + i] = rows_in[r * k_size + k + 2 * i];
          ordered[r * k_size + k + kLanes + i] = rows_in[r * k_size + k + 2 * i + 1];
        }
    rows_in = ordered.get();
  }
  std::unique_ptr<float[]> sums;
  if (has_zero) {
    sums.reset(new float[rows * groups]());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < k_size; ++k) sums[r * groups + k / group_size] += x.typed_data()[r * k_size + k];
  }
  const Quantized q{rows_in, static_cast<const uint8_t*>(w.untyped_data()), scale.typed_data(),
                    has_zero ? zero.typed_data() : nullptr, sums.get(), out->typed_data(), k_size, n_size, row_bytes,
                    groups, group_size, rows_per_scale, stored == Stored::kFp8 ? 256.0f : 1.0f};
  const QuantizedChunkFunction multiply = stored == Stored::kInt8 ? kQuantizedChunkFunctions<Stored::kInt8>[rows]
                                          : stored == Stored::kInt4 ? kQuantizedChunkFunctions<Stored::kInt4>[rows]
                                                                    : kQuantizedChunkFunctions<Stored::kFp8>[rows];
  const int64_t chunk_rows = ChunkRows(n_size);
  RunChunks((n_size + chunk_rows - 1) / chunk_rows, [&q, multiply, chunk_rows, n_size](int64_t chunk) {
    const int64_t begin = chunk * chunk_rows;
    multiply(q, begin, std::min(n_size, begin + chunk_rows));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HfjaxRowsTimesWeight, RowsTimesWeight,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HfjaxDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("key_length"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HfjaxRowsTimesQuantized, RowsTimesQuantized,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("rows_per_scale")
                                  .Attr<int64_t>("columns_per_scale")
                                  .Attr<int64_t>("has_zero"));
