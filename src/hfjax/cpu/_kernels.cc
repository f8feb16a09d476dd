// hfjax's CPU kernels for decoding, XLA FFI custom calls built by _cpu_kernels.py with the
// host's compiler (-march=native).
//
// RowsTimesWeight: a few rows of activations times a torch Linear weight, out[r, n] =
// sum_k x[r, k] * w[n, k], for 1 to 8 rows and a row-major [N, K] weight. XLA:CPU hands such
// products to a general matrix-multiply library, which copies ("packs") the weight into tiles
// before multiplying: at 8 rows that ran at ~37 GB/s of weight here, against ~55-80 GB/s for
// one row. This kernel reads each weight row once, straight from memory, and keeps 2-8 weight
// rows times every activation row in AVX-512 registers. The weight is cut into one contiguous
// chunk per core, run by the caller and hfjax's own helper threads (below).
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
#include <sys/syscall.h>
#include <unistd.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 8;     // activation rows
constexpr int64_t kAhead = 8;       // how far ahead, in weight rows, prefetching starts
constexpr int64_t kLeastRows = 64;  // weight rows below which a product is not split between threads

inline __mmask16 TailMask(int64_t count) {  // the first `count` (<= 16) lanes
  return static_cast<__mmask16>((1u << count) - 1);
}

// totals[i] = the sum of v[i]'s 16 lanes, for i < kCount: 16 vectors at a time through a
// tree of shuffles and adds (45 instructions), where one horizontal sum each takes 8.
template <int kCount>
inline void SumLanes(const __m512* v, float* totals) {
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
    _mm512_mask_storeu_ps(totals + base, TailMask(count), all);
  }
}

// Weight rows [n, n + kAtOnce) times the kRows activation rows, into out[:, n:n + kAtOnce].
template <int kRows, int kAtOnce, bool kPrefetch>
inline void MultiplyRows(const float* x, const float* w, float* out, int64_t k_size, int64_t n_size,
                         int64_t n) {
  __m512 sums[kAtOnce][kRows];
  for (int p = 0; p < kAtOnce; ++p)
    for (int r = 0; r < kRows; ++r) sums[p][r] = _mm512_setzero_ps();
  const float* rows = w + n * k_size;
  const bool prefetch = kPrefetch && n + kAhead + 2 * kAtOnce <= n_size;
  const int64_t whole = k_size / 16 * 16;
  for (int64_t k = 0; k < whole; k += 16) {
    if (prefetch)
      for (int p = 0; p < 2 * kAtOnce; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(rows + (kAhead + p) * k_size + k), _MM_HINT_T0);
    __m512 weights[kAtOnce];
    for (int p = 0; p < kAtOnce; ++p) weights[p] = _mm512_loadu_ps(rows + p * k_size + k);
    for (int r = 0; r < kRows; ++r) {
      const __m512 activations = _mm512_loadu_ps(x + r * k_size + k);
      for (int p = 0; p < kAtOnce; ++p) sums[p][r] = _mm512_fmadd_ps(weights[p], activations, sums[p][r]);
    }
  }
  if (whole < k_size) {  // the last k_size % 16 columns, under a mask
    const __mmask16 mask = TailMask(k_size - whole);
    __m512 weights[kAtOnce];
    for (int p = 0; p < kAtOnce; ++p) weights[p] = _mm512_maskz_loadu_ps(mask, rows + p * k_size + whole);
    for (int r = 0; r < kRows; ++r) {
      const __m512 activations = _mm512_maskz_loadu_ps(mask, x + r * k_size + whole);
      for (int p = 0; p < kAtOnce; ++p) sums[p][r] = _mm512_fmadd_ps(weights[p], activations, sums[p][r]);
    }
  }
  if constexpr (kRows == 1) {
    for (int p = 0; p < kAtOnce; ++p) out[n + p] = _mm512_reduce_add_ps(sums[p][0]);
  } else {
    float totals[kAtOnce * kRows];  // totals[p * kRows + r]: the sum of sums[p][r]'s lanes
    SumLanes<kAtOnce * kRows>(&sums[0][0], totals);
    for (int r = 0; r < kRows; ++r)
      for (int p = 0; p < kAtOnce; ++p) out[r * n_size + n + p] = totals[p * kRows + r];
  }
}

// Weight rows at once: as many as keep ~20 accumulators in the 32 registers. With 1-3
// activation rows the cores have time to spare per weight byte, and 6-8 weight rows at once keep
// enough loads in flight for the hardware prefetcher alone (a 150M model's weights read at ~95%
// of a plain read). From 4 rows up the multiplying takes most of the time, and each step over k
// also prefetches the same columns of the 2 x kAtOnce weight rows from kAhead rows on; so each
// row is prefetched twice, kAtOnce rows apart. At 8 rows that streamed 1.16x faster than one
// prefetch per row 16 rows ahead, and 1.2x faster than one 8 rows ahead (in a harness,
// alternated with a plain read); a prefetch dropped while the core's miss buffers are full
// presumably gets its second chance.
template <int kRows>
void MultiplyChunk(const float* x, const float* w, float* out, int64_t k_size, int64_t n_size, int64_t begin,
                   int64_t end) {
  constexpr int kAtOnce = std::clamp(20 / kRows, 2, 8);
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
// alone while a helper woke, at one core's share of the bandwidth (half of it, when the
// machine gives each core its own). The kernels keep their own helpers instead: each spins
// for kSpin after its last chunk, yielding its core to any other thread that wants it, before
// it sleeps on a futex; so within a step each product starts on every core at once.

constexpr auto kSpin = std::chrono::microseconds(1000);
constexpr int64_t kMaxHelpers = 63;

struct Task {
  virtual void Work() = 0;
  std::atomic<int> helped{0};  // helpers that took the task and are done with it
};

class Helper {
 public:
  Helper() { std::thread([this] { Run(); }).detach(); }

  // Hands `task` over unless the helper has one waiting already.
  bool Offer(Task* task) {
    Task* none = nullptr;
    if (!slot_.compare_exchange_strong(none, task)) return false;
    if (sleeping_.exchange(0) == 1) syscall(SYS_futex, &sleeping_, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
    return true;
  }

  // Takes `task` back; false if the helper has taken it (and will count itself in task->helped).
  bool Withdraw(Task* task) { return slot_.compare_exchange_strong(task, nullptr); }

 private:
  void Run() {
    for (;;) {
      Task* task = Next();
      task->Work();
      task->helped.fetch_add(1, std::memory_order_release);  // the caller may free the task from here on
    }
  }

  Task* Next() {
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      do {
        for (int i = 0; i < 64; ++i) {
          if (slot_.load(std::memory_order_relaxed) != nullptr) {
            Task* task = slot_.exchange(nullptr);
            if (task != nullptr) return task;
          }
          _mm_pause();
        }
        sched_yield();
      } while (std::chrono::steady_clock::now() < until);
      sleeping_.store(1);
      if (slot_.load() == nullptr) syscall(SYS_futex, &sleeping_, FUTEX_WAIT_PRIVATE, 1, nullptr, nullptr, 0);
      sleeping_.store(0);
    }
  }

  std::atomic<Task*> slot_{nullptr};
  std::atomic<int> sleeping_{0};  // the futex word: 1 while the helper sleeps or is about to
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
    for (int64_t chunk; (chunk = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      body(chunk);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
  Body body;
  int64_t chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
};

int64_t Threads() { return static_cast<int64_t>(Helpers().size()) + 1; }

template <typename Body>
void RunChunks(int64_t chunks, Body body) {
  Chunks<Body> task(std::move(body), chunks);
  auto& helpers = Helpers();
  const int64_t wanted = std::min<int64_t>(chunks - 1, helpers.size());
  bool offered[kMaxHelpers] = {};
  for (int64_t i = 0; i < wanted; ++i) offered[i] = helpers[i].Offer(&task);
  task.Work();
  int taken = 0;
  for (int64_t i = 0; i < wanted; ++i) taken += offered[i] && !helpers[i].Withdraw(&task);
  while (task.finished.load(std::memory_order_acquire) < chunks || task.helped.load(std::memory_order_acquire) < taken)
    _mm_pause();
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
  // One contiguous chunk of the weight per thread: each streams its part from start to end.
  const int64_t split = std::max<int64_t>(1, std::min<int64_t>(Threads(), n_size / kLeastRows));
  const int64_t chunk_rows = (n_size / split + 7) / 8 * 8;
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

// e^x for x <= 0 (scores less their maximum), to ~1 ulp: x = n ln2 + y with |y| <= ln2 / 2,
// e^y by its Taylor series to y^7 (error < 1e-8), times 2^n. Below e^-87, the smallest normal
// float, it gives 0: -inf (a masked slot) included.
inline __m512 ExpNonPositive(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 y = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2, high part
  y = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.4286068203e-06f), y);          // ln 2, low part
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}

struct Attention {
  const float *q, *k, *v, *bias;  // [B, H, R, D], [B, H, S, D], [B, H, S, Dv], [B, L, S]
  float* out;                     // [B, H, R, Dv]
  int64_t heads, rows, length, slots, depth, value_depth;
  float scale;
};

// One (sequence, key/value head): kRows query rows; `scores` holds kRows x slots floats.
template <int kRows>
void AttendHead(const Attention& a, int64_t task, float* scores) {
  const int64_t b = task / a.heads, s_size = a.slots, d_size = a.depth, dv_size = a.value_depth;
  const float* q = a.q + task * kRows * d_size;
  const float* k = a.k + task * s_size * d_size;
  const float* v = a.v + task * s_size * dv_size;
  const float* bias = a.bias + b * a.length * s_size;
  float* out = a.out + task * kRows * dv_size;
  const int64_t whole = d_size / 16 * 16;
  const __mmask16 tail = TailMask(d_size - whole);
  for (int64_t s = 0; s < s_size; ++s) {  // scores[r, s] = q[r] . k[s] * scale + bias[r % L, s]
    const float* key = k + s * d_size;
    __m512 sums[kRows];
    for (int r = 0; r < kRows; ++r) sums[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < whole; d += 16) {
      const __m512 keys = _mm512_loadu_ps(key + d);
      for (int r = 0; r < kRows; ++r) sums[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * d_size + d), keys, sums[r]);
    }
    if (whole < d_size) {
      const __m512 keys = _mm512_maskz_loadu_ps(tail, key + whole);
      for (int r = 0; r < kRows; ++r)
        sums[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + r * d_size + whole), keys, sums[r]);
    }
    for (int r = 0; r < kRows; ++r)
      scores[r * s_size + s] = _mm512_reduce_add_ps(sums[r]) * a.scale + bias[(r % a.length) * s_size + s];
  }
  const int64_t s_whole = s_size / 16 * 16;
  const __mmask16 s_tail = TailMask(s_size - s_whole);
  float inverse[kRows];
  for (int r = 0; r < kRows; ++r) {  // softmax over each row; a row that may attend to nothing gives zeros
    float* row = scores + r * s_size;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t s = 0; s < s_whole; s += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + s));
    if (s_whole < s_size) top = _mm512_mask_max_ps(top, s_tail, top, _mm512_maskz_loadu_ps(s_tail, row + s_whole));
    float most = _mm512_reduce_max_ps(top);
    if (most == -INFINITY) most = 0.0f;  // all -inf: every weight is 0
    const __m512 shift = _mm512_set1_ps(most);
    __m512 total = _mm512_setzero_ps();
    for (int64_t s = 0; s < s_whole; s += 16) {
      const __m512 e = ExpNonPositive(_mm512_sub_ps(_mm512_loadu_ps(row + s), shift));
      _mm512_storeu_ps(row + s, e);
      total = _mm512_add_ps(total, e);
    }
    if (s_whole < s_size) {
      const __m512 e = _mm512_maskz_mov_ps(s_tail, ExpNonPositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(s_tail, row + s_whole), shift)));
      _mm512_mask_storeu_ps(row + s_whole, s_tail, e);
      total = _mm512_add_ps(total, e);
    }
    const float sum = _mm512_reduce_add_ps(total);
    inverse[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  constexpr int kChunks = kRows <= 4 ? 4 : 2;  // value columns per pass, in 16s: accumulators fit the registers
  for (int64_t c0 = 0; c0 < dv_size; c0 += 16 * kChunks) {
    const int64_t width = std::min<int64_t>(16 * kChunks, dv_size - c0);
    const int chunks = static_cast<int>((width + 15) / 16);
    __mmask16 masks[kChunks];
    for (int c = 0; c < kChunks; ++c) {
      const int64_t lanes = std::max<int64_t>(0, std::min<int64_t>(16, width - 16 * c));
      masks[c] = TailMask(lanes);
    }
    __m512 sums[kRows][kChunks];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kChunks; ++c) sums[r][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < s_size; ++s) {
      const float* value = v + s * dv_size + c0;
      __m512 values[kChunks];
      for (int c = 0; c < kChunks; ++c) values[c] = c < chunks ? _mm512_maskz_loadu_ps(masks[c], value + 16 * c) : _mm512_setzero_ps();
      for (int r = 0; r < kRows; ++r) {
        const __m512 weight = _mm512_set1_ps(scores[r * s_size + s]);
        for (int c = 0; c < kChunks; ++c) sums[r][c] = _mm512_fmadd_ps(weight, values[c], sums[r][c]);
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < chunks; ++c)
        _mm512_mask_storeu_ps(out + r * dv_size + c0 + 16 * c, masks[c], _mm512_mul_ps(sums[r][c], _mm512_set1_ps(inverse[r])));
  }
}

using HeadFunction = void (*)(const Attention&, int64_t, float*);
constexpr HeadFunction kHeadFunctions[kMaxQueryRows + 1] = {
    nullptr,       AttendHead<1>, AttendHead<2>, AttendHead<3>, AttendHead<4>,
    AttendHead<5>, AttendHead<6>, AttendHead<7>, AttendHead<8>};

// Decoding attention: q [B, H, R, D], k [B, H, S, D], v [B, H, S, Dv], bias [B, L, S] (0 or
// -inf, or a float mask; query row r reads bias row r % L) -> [B, H, R, Dv], for R <= 8.
ffi::Error DecodeAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> bias, ffi::ResultBuffer<ffi::F32> out,
                           float scale) {
  // Keys and values come in any shape with B x H x S x D elements: the decode loop carries a
  // batch of 1 without its size-1 axes, and a reshape here would make XLA copy the cache.
  const auto qd = q.dimensions(), bd = bias.dimensions();
  const bool shapes = qd.size() == 4 && bd.size() == 3 && qd[0] >= 1 && qd[1] >= 1 && qd[2] >= 1 &&
                      qd[2] <= kMaxQueryRows && qd[3] >= 1 && bd[0] == qd[0] && bd[1] >= 1 && qd[2] % bd[1] == 0 &&
                      bd[2] >= 1;
  const int64_t tasks = shapes ? qd[0] * qd[1] : 0, slots = shapes ? bd[2] : 0;
  if (!shapes || static_cast<int64_t>(k.element_count()) != tasks * slots * qd[3] ||
      static_cast<int64_t>(v.element_count()) % (tasks * slots) != 0 ||
      static_cast<int64_t>(out->element_count()) != tasks * qd[2] * static_cast<int64_t>(v.element_count()) / (tasks * slots)) {
    return ffi::Error::InvalidArgument(
        "hfjax_decode_attention takes q [B, H, 1-8, D], k [B, H, S, D], v [B, H, S, Dv] and bias [B, L, S]");
  }
  const int64_t value_depth = v.element_count() / (tasks * slots);
  const Attention a{q.typed_data(), k.typed_data(), v.typed_data(), bias.typed_data(), out->typed_data(),
                    qd[1], qd[2], bd[1], slots, qd[3], value_depth, scale};
  const HeadFunction attend = kHeadFunctions[qd[2]];
  const int64_t bytes = tasks * slots * (qd[3] + value_depth) * 4;
  const int64_t split = bytes < kLeastBytes ? 1 : std::max<int64_t>(1, std::min<int64_t>(Threads(), tasks));
  const int64_t per_chunk = (tasks + split - 1) / split;
  RunChunks((tasks + per_chunk - 1) / per_chunk, [=](int64_t chunk) {
    std::unique_ptr<float[]> scores(new float[a.rows * a.slots]);
    for (int64_t task = chunk * per_chunk; task < std::min(tasks, (chunk + 1) * per_chunk); ++task) attend(a, task, scores.get());
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
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
