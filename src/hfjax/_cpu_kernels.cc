// hfjax's CPU kernel for batched decoding: a few rows of activations times a torch Linear
// weight, out[r, n] = sum_k x[r, k] * w[n, k], for 1 to 8 rows and a row-major [N, K] weight.
//
// XLA:CPU hands such products to a general matrix-multiply library, which copies ("packs")
// the weight into tiles before multiplying: at 8 rows that ran at ~37 GB/s of weight here,
// against ~55-80 GB/s for one row. This kernel reads each weight row once, straight from
// memory, keeps a pair of weight rows times every activation row in AVX-512 registers, and
// prefetches the rows ahead. The weight is cut into one contiguous chunk per XLA intra-op
// thread. Threads claim chunks, so the caller finishes the product alone if no helper runs.
// Built by _cpu_kernels.py with the host's compiler (-march=native).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 8;     // activation rows; kMaxRows x 2 accumulators fit the 32 registers
constexpr int64_t kAhead = 16;      // weight rows prefetched ahead of the pair being multiplied
constexpr int64_t kLeastRows = 64;  // weight rows below which a product is not split between threads

// Weight rows [n, n + kPair) times the kRows activation rows, into out[:, n:n + kPair].
template <int kRows, int kPair>
inline void MultiplyRows(const float* x, const float* w, float* out, int64_t k_size, int64_t n_size,
                         int64_t n) {
  __m512 sums[kPair][kRows];
  for (int p = 0; p < kPair; ++p)
    for (int r = 0; r < kRows; ++r) sums[p][r] = _mm512_setzero_ps();
  const float* rows = w + n * k_size;
  const bool prefetch = n + kAhead + kPair <= n_size;
  const int64_t whole = k_size / 16 * 16;
  for (int64_t k = 0; k < whole; k += 16) {
    __m512 weights[kPair];
    for (int p = 0; p < kPair; ++p) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(rows + (kAhead + p) * k_size + k), _MM_HINT_T0);
      weights[p] = _mm512_loadu_ps(rows + p * k_size + k);
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512 activations = _mm512_loadu_ps(x + r * k_size + k);
      for (int p = 0; p < kPair; ++p) sums[p][r] = _mm512_fmadd_ps(weights[p], activations, sums[p][r]);
    }
  }
  if (whole < k_size) {  // the last k_size % 16 columns, under a mask
    const __mmask16 mask = static_cast<__mmask16>((1u << (k_size - whole)) - 1);
    __m512 weights[kPair];
    for (int p = 0; p < kPair; ++p) weights[p] = _mm512_maskz_loadu_ps(mask, rows + p * k_size + whole);
    for (int r = 0; r < kRows; ++r) {
      const __m512 activations = _mm512_maskz_loadu_ps(mask, x + r * k_size + whole);
      for (int p = 0; p < kPair; ++p) sums[p][r] = _mm512_fmadd_ps(weights[p], activations, sums[p][r]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int p = 0; p < kPair; ++p) out[r * n_size + n + p] = _mm512_reduce_add_ps(sums[p][r]);
}

template <int kRows>
void MultiplyChunk(const float* x, const float* w, float* out, int64_t k_size, int64_t n_size, int64_t begin,
                   int64_t end) {
  int64_t n = begin;
  for (; n + 2 <= end; n += 2) MultiplyRows<kRows, 2>(x, w, out, k_size, n_size, n);
  if (n < end) MultiplyRows<kRows, 1>(x, w, out, k_size, n_size, n);
}

using ChunkFunction = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr ChunkFunction kChunkFunctions[kMaxRows + 1] = {
    nullptr,          MultiplyChunk<1>, MultiplyChunk<2>, MultiplyChunk<3>, MultiplyChunk<4>,
    MultiplyChunk<5>, MultiplyChunk<6>, MultiplyChunk<7>, MultiplyChunk<8>};

// One product, shared by the calling thread and the pool's threads, which claim its chunks
// in turn. A helper that starts after the caller has claimed every chunk finds none left;
// it holds its own reference, so the job outlives the call.
struct Job {
  ChunkFunction multiply;
  const float* x;
  const float* w;
  float* out;
  int64_t k_size, n_size, chunk_rows, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
};

void Work(Job& job) {
  for (int64_t chunk; (chunk = job.next.fetch_add(1, std::memory_order_relaxed)) < job.chunks;) {
    const int64_t begin = chunk * job.chunk_rows;
    job.multiply(job.x, job.w, job.out, job.k_size, job.n_size, begin, std::min(job.n_size, begin + job.chunk_rows));
    job.finished.fetch_add(1, std::memory_order_release);
  }
}

// x [R, K] times a torch Linear weight w [N, K] -> [R, N], for 1 to 8 rows.
ffi::Error RowsTimesWeight(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[1] || x_dims[0] < 1 || x_dims[0] > kMaxRows) {
    return ffi::Error::InvalidArgument("hfjax_rows_times_weight takes x [1-8, K] and a weight [N, K]");
  }
  auto job = std::make_shared<Job>();
  job->multiply = kChunkFunctions[x_dims[0]];
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->out = out->typed_data();
  job->k_size = w_dims[1];
  job->n_size = w_dims[0];
  // One contiguous chunk of the weight per thread: each streams its part from start to end.
  const int64_t split = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), job->n_size / kLeastRows));
  job->chunk_rows = (job->n_size / split + 1) / 2 * 2;
  job->chunks = (job->n_size + job->chunk_rows - 1) / job->chunk_rows;
  for (int64_t i = 1; i < job->chunks; ++i) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->finished.load(std::memory_order_acquire) < job->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HfjaxRowsTimesWeight, RowsTimesWeight,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
