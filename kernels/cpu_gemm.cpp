// The fp32 linear layers' GEMM on CPU with AVX-512 or AVX2: y [M, N] = x [M, K] @ W^T (+ bias),
// W packed as panels of 32 columns, [N / 32][K][32], each panel read once from memory in address
// order. W is float32, or bfloat16 widened to float32 as it is loaded (the bf16 mode on a CPU
// without bf16 dot products: half the weight bytes, the same float32 arithmetic). At decode's
// 8-32 rows oneDNN's packed GEMM waited on the weights' reads from memory; here the next panel
// is prefetched into L2 while this one is computed (the offline fp32 workload 1.21x on the
// Zen 4: bench/results/throughput_fp32_cpu_smollm2_zen4_cpu_gemm_*.json).
// x's rows are copied once a call into the blocks the kernel takes them in, each block's K
// columns interleaved, so that its broadcasts read consecutive floats: read in place, rows a
// K apart, a Zen 3 thread ran at half the square matmul's rate at 17-32 rows (bench/NOTES.md).
// And the MLP's gate/up projection with SiLU-and-mul applied to its sums: [gate | up] is
// never written, only silu(gate) * up [M, N / 2].
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ASYNCLLM_CPU_GEMM 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // a panel's columns: two AVX-512 vectors, four AVX2 ones
constexpr int64_t kChunkFloats = 96 * 1024;  // rows of x a thread keeps in L2 across panels

struct Gemm {
  const float* x;  // [M, K] rows ldx apart; in panel_rows and pair_rows, blocked_rows'
  int64_t ldx;
  const void* w;  // [N / 32][K][32], float32 or bfloat16
  const float* bias;  // [N] or null
  float* y;
  int64_t ldy, K;
};

#ifdef ASYNCLLM_CPU_GEMM

// A block's sums are two vectors a row: a whole panel's 32 columns with AVX-512, for up to 14
// rows (28 accumulators of its 32 registers); half a panel with AVX2, for up to 6 rows (12
// accumulators, the 2 weight vectors and a broadcast of its 16).
// kPackedRows and kSpreadPrefetch: the AVX2 build copies x's rows into its blocks' [K][rows]
// layout and spreads the next panel's prefetch over every block run (each 1.2-1.5x on a Zen 3
// streaming 30 layers' weights, bench/NOTES.md); the AVX-512 build reads x in place and
// prefetches the next panel in the first block run, as it did when measured at the floor's
// rate on the Zen 4 (the AVX2 scheme ran 1.5-2.4x slower on an AVX-512 Xeon).
#ifdef __AVX512F__
struct Simd {
  using V = __m512;
  using I = __m512i;
  static constexpr int kWidth = 16, kMaxRows = 14;
  static constexpr bool kPackedRows = false, kSpreadPrefetch = false;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  // a bf16's bits are the upper half of the float32 it rounds
  static V load(const c10::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  // 2^n for whole n in [-126, 127], from the exponent's bits
  static V pow2(V n) {
    const I biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(biased, 23));
  }
};
#else
struct Simd {
  using V = __m256;
  using I = __m256i;
  static constexpr int kWidth = 8, kMaxRows = 6;
  static constexpr bool kPackedRows = true, kSpreadPrefetch = true;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V pow2(V n) {
    const I biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
  }
};
#endif

using V = Simd::V;
constexpr int kMaxRows = Simd::kMaxRows;
constexpr int64_t kBlockColumns = 2 * Simd::kWidth;  // of a panel's 32

// What a block does with its sums: y = sums + bias; keep them in a tile (a gate's); or
// y = silu(tile) * sums (the up's).
enum class Epilogue { kBias, kGate, kSiluMul };

// exp(x), Cephes' polynomial as kernels/cpu_layer_ops.cpp's vector_exp (about 1 ulp); past 89
// the exponent's bits overflow to infinity, as expf does.
V vexp(V x) {
  x = Simd::min(Simd::max(x, Simd::set1(-87.3f)), Simd::set1(89.f));
  const V magic = Simd::set1(12582912.f);
  const V n = Simd::sub(Simd::fmadd(x, Simd::set1(1.44269504088896341f), magic), magic);
  V r = Simd::fnmadd(n, Simd::set1(0.693359375f), x);
  r = Simd::fmadd(n, Simd::set1(2.12194440e-4f), r);
  V p = Simd::set1(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f}) {
    p = Simd::fmadd(p, r, Simd::set1(c));
  }
  const V y = Simd::fmadd(p, Simd::mul(r, r), Simd::add(r, Simd::set1(1.f)));
  return Simd::mul(y, Simd::pow2(n));
}

// silu(gate) * up, silu(g) = g / (1 + exp(-g)) as torch computes it
V silu_mul(V gate, V up) {
  const V e = vexp(Simd::sub(Simd::zero(), gate));
  return Simd::mul(Simd::div(gate, Simd::add(Simd::set1(1.f), e)), up);
}

// A block run's share of the next panel's lines, prefetched into L2 evenly over its K steps:
// each of a panel's runs takes the next panel's lines in turn, so the whole panel is requested
// while this one is computed, not in a burst over the first run (which left a Zen 3 thread
// streaming the weights from DRAM at 4 GB/s, bench/NOTES.md).
template <class T>
struct Prefetch {
  const char* line;  // without kSpreadPrefetch: the next panel, whose k-th row step k takes
  int64_t lines, steps, due = 0;

  void step(int64_t k) {
    if constexpr (Simd::kSpreadPrefetch) {
      for (due += lines; due >= steps; due -= steps, line += 64) {
        _mm_prefetch(line, _MM_HINT_T1);
      }
    } else if (line) {
      const char* row = line + k * kPanel * sizeof(T);
      for (size_t b = 0; b < kPanel * sizeof(T); b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
    }
  }
};

// Run `run` of `runs` over a panel: its share of `next` (null: nothing to prefetch); without
// kSpreadPrefetch the first run takes it all
template <class T>
Prefetch<T> share(const Gemm& g, const T* next, int64_t run, int64_t runs) {
  if (!Simd::kSpreadPrefetch) {
    if (run > 0) next = nullptr;
    runs = 1;
  }
  if (!next) return {nullptr, 0, g.K};
  const int64_t lines = g.K * kPanel * sizeof(T) / 64;
  const int64_t first = lines * run / runs, last = lines * (run + 1) / runs;
  return {reinterpret_cast<const char*>(next) + first * 64, last - first, g.K};
}

// The rows [0, ROWS) of x from `x` (with kPackedRows [K][ROWS], as blocked_rows copies them)
// times the panel's columns [c, c + kBlockColumns), to y at column `col` + c (or to `tile`,
// ROWS x 32, at c), prefetching its share of the next panel.
template <Epilogue E, class T, int ROWS>
void panel_block(const Gemm& g, const float* x, const T* panel, float* y, int64_t col,
                 int64_t c, Prefetch<T> ahead, float* tile) {
  constexpr int W = Simd::kWidth;
  V lo[ROWS], hi[ROWS];
  for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = Simd::zero();
  panel += c;
  for (int64_t k = 0; k < g.K; ++k) {
    ahead.step(k);
    const V w0 = Simd::load(panel + k * kPanel);
    const V w1 = Simd::load(panel + k * kPanel + W);
    for (int r = 0; r < ROWS; ++r) {
      const V a = Simd::set1(Simd::kPackedRows ? x[k * ROWS + r] : x[r * g.ldx + k]);
      lo[r] = Simd::fmadd(a, w0, lo[r]);
      hi[r] = Simd::fmadd(a, w1, hi[r]);
    }
  }
  y += col + c;
  if constexpr (E == Epilogue::kGate) {
    for (int r = 0; r < ROWS; ++r) {
      Simd::store(tile + r * kPanel + c, lo[r]);
      Simd::store(tile + r * kPanel + c + W, hi[r]);
    }
  } else if constexpr (E == Epilogue::kSiluMul) {
    for (int r = 0; r < ROWS; ++r) {
      Simd::store(y + r * g.ldy, silu_mul(Simd::load(tile + r * kPanel + c), lo[r]));
      Simd::store(y + r * g.ldy + W, silu_mul(Simd::load(tile + r * kPanel + c + W), hi[r]));
    }
  } else {
    const float* bias = g.bias ? g.bias + col + c : nullptr;
    const V b0 = bias ? Simd::load(bias) : Simd::zero();
    const V b1 = bias ? Simd::load(bias + W) : Simd::zero();
    for (int r = 0; r < ROWS; ++r) {
      Simd::store(y + r * g.ldy, Simd::add(lo[r], b0));
      Simd::store(y + r * g.ldy + W, Simd::add(hi[r], b1));
    }
  }
}

template <class T>
using BlockFn = void (*)(const Gemm&, const float*, const T*, float*, int64_t, int64_t,
                         Prefetch<T>, float*);

template <Epilogue E, class T, int... I>
constexpr std::array<BlockFn<T>, sizeof...(I)> block_table(std::integer_sequence<int, I...>) {
  return {panel_block<E, T, I + 1>...};
}

template <Epilogue E, class T>
const auto kBlocks = block_table<E, T>(std::make_integer_sequence<int, kMaxRows>{});

template <class T>
const T* panel_at(const Gemm& g, int64_t p) {
  return static_cast<const T*>(g.w) + p * g.K * kPanel;
}

constexpr int64_t kRuns = kPanel / kBlockColumns;  // block runs a row block takes a panel in

// Rows split into blocks of at most kMaxRows rows of about equal size: how many, and where
// block b ends (panel_rows, pair_rows and blocked_rows split them alike)
int64_t row_blocks(int64_t rows) { return (rows + kMaxRows - 1) / kMaxRows; }
int64_t block_end(int64_t rows, int64_t blocks, int64_t b) { return rows * (b + 1) / blocks; }

// x's block of rows from m0 + start: blocked_rows' copy (kPackedRows), else x's own rows
const float* block_rows(const Gemm& g, int64_t m0, int64_t start) {
  return Simd::kPackedRows ? g.x + start * g.K : g.x + (m0 + start) * g.ldx;
}

// Rows [m0, m1) in blocks of at most kMaxRows rows of about equal size, each times panel p to
// y's columns from p * 32, prefetching panel `next` (-1: none).
template <class T>
void panel_rows(const Gemm& g, int64_t m0, int64_t m1, int64_t p, int64_t next) {
  const int64_t rows = m1 - m0, blocks = row_blocks(rows);
  const T* ahead = next >= 0 ? panel_at<T>(g, next) : nullptr;
  for (int64_t b = 0, start = 0; b < blocks; ++b) {
    const int64_t end = block_end(rows, blocks, b);
    for (int64_t run = 0; run < kRuns; ++run) {
      kBlocks<Epilogue::kBias, T>[end - start - 1](
          g, block_rows(g, m0, start), panel_at<T>(g, p), g.y + (m0 + start) * g.ldy, p * kPanel,
          run * kBlockColumns, share(g, ahead, b * kRuns + run, blocks * kRuns), nullptr);
    }
    start = end;
  }
}

// The same for the gate panel p and its up panel p + half, silu(gate) * up to y's columns from
// p * 32, each block's gate sums held in a tile until its up sums are done.
template <class T>
void pair_rows(const Gemm& g, int64_t m0, int64_t m1, int64_t p, int64_t next) {
  const int64_t rows = m1 - m0, blocks = row_blocks(rows);
  const int64_t half = g.ldy / kPanel;
  const T* gate_ahead = next >= 0 ? panel_at<T>(g, next) : nullptr;
  const T* up_ahead = next >= 0 ? panel_at<T>(g, next + half) : nullptr;
  alignas(64) float tile[kMaxRows * kPanel];
  for (int64_t b = 0, start = 0; b < blocks; ++b) {
    const int64_t end = block_end(rows, blocks, b);
    const float* x = block_rows(g, m0, start);
    float* y = g.y + (m0 + start) * g.ldy;
    for (int64_t run = 0; run < kRuns; ++run) {
      const int64_t c = run * kBlockColumns, index = b * kRuns + run, runs = blocks * kRuns;
      kBlocks<Epilogue::kGate, T>[end - start - 1](g, x, panel_at<T>(g, p), y, p * kPanel, c,
                                                   share(g, gate_ahead, index, runs), tile);
      kBlocks<Epilogue::kSiluMul, T>[end - start - 1](g, x, panel_at<T>(g, p + half), y,
                                                      p * kPanel, c,
                                                      share(g, up_ahead, index, runs), tile);
    }
    start = end;
  }
}

// x's rows [m0, m1) as the blocks read them: with kPackedRows copied into `packed` as
// panel_rows blocks them, each block [K][rows], so that a block's broadcasts read consecutive
// floats, and g returned with x the copy (the block of rows from m0 + start at x + start * K);
// else g as it is
Gemm blocked_rows(const Gemm& g, int64_t m0, int64_t m1, std::vector<float>& packed) {
  if (!Simd::kPackedRows) return g;
  const int64_t rows = m1 - m0, blocks = row_blocks(rows);
  packed.resize(rows * g.K);
  for (int64_t b = 0, start = 0; b < blocks; ++b) {
    const int64_t end = block_end(rows, blocks, b), n = end - start;
    float* block = packed.data() + start * g.K;
    for (int64_t r = 0; r < n; ++r) {
      const float* row = g.x + (m0 + start + r) * g.ldx;
      for (int64_t k = 0; k < g.K; ++k) block[k * n + r] = row[k];
    }
    start = end;
  }
  Gemm blocked = g;
  blocked.x = packed.data();
  return blocked;
}

#else  // never called: check() refuses first

constexpr int kMaxRows = 1;
template <class T>
void panel_rows(const Gemm&, int64_t, int64_t, int64_t, int64_t) {}
template <class T>
void pair_rows(const Gemm&, int64_t, int64_t, int64_t, int64_t) {}
Gemm blocked_rows(const Gemm& g, int64_t, int64_t, std::vector<float>&) { return g; }

#endif  // ASYNCLLM_CPU_GEMM

// One thread's panels [p0, p1) for every row, the rows in chunks that stay in L2.
template <class Rows>
void thread_panels(const Gemm& g, int64_t M, int64_t p0, int64_t p1, Rows rows) {
  const int64_t chunk = std::max<int64_t>(kMaxRows, kChunkFloats / g.K);
  std::vector<float> packed;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    const Gemm blocked = blocked_rows(g, m0, m1, packed);
    for (int64_t p = p0; p < p1; ++p) rows(blocked, m0, m1, p, p + 1 < p1 ? p + 1 : -1);
  }
}

bool supported() {
#ifdef ASYNCLLM_CPU_GEMM
  return true;
#else
  return false;
#endif
}

void check(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(supported(), "cpu_gemm: built without AVX-512 or AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "cpu_gemm: x is float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  (packed.scalar_type() == torch::kFloat ||
                   packed.scalar_type() == torch::kBFloat16),
              "cpu_gemm: the weight is float32 or bfloat16 packed [N / 32][K][32]");
  TORCH_CHECK(packed.size(1) == x.size(1), "cpu_gemm: x's columns are not the weight's K");
}

// y [M, columns] from `panels` panels, each thread a range of them; rows(g, m0, m1, p, next)
template <class Rows>
torch::Tensor run(torch::Tensor x, const torch::Tensor& packed, const float* bias,
                  int64_t columns, int64_t panels, Rows rows) {
  if (x.stride(1) != 1) x = x.contiguous();
  auto y = torch::empty({x.size(0), columns}, x.options());
  const Gemm g{x.data_ptr<float>(), x.stride(0), packed.data_ptr(), bias,
               y.data_ptr<float>(), columns, x.size(1)};
  if (x.size(0) > 0) {
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      thread_panels(g, x.size(0), p0, p1, rows);
    });
  }
  return y;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  check(x, packed);
  const int64_t panels = packed.size(0), N = panels * kPanel;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "cpu_gemm: the bias is float32 [N]");
  }
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  if (packed.scalar_type() == torch::kBFloat16) {
    return run(x, packed, b, N, panels, panel_rows<c10::BFloat16>);
  }
  return run(x, packed, b, N, panels, panel_rows<float>);
}

// silu(x @ gate^T) * (x @ up^T) for the weight [gate | up] packed: [M, N / 2]
torch::Tensor linear_silu_mul(torch::Tensor x, torch::Tensor packed) {
  check(x, packed);
  TORCH_CHECK(packed.size(0) % 2 == 0, "cpu_gemm: gate and up are whole panels each");
  const int64_t half = packed.size(0) / 2;
  if (packed.scalar_type() == torch::kBFloat16) {
    return run(x, packed, nullptr, half * kPanel, half, pair_rows<c10::BFloat16>);
  }
  return run(x, packed, nullptr, half * kPanel, half, pair_rows<float>);
}

}  // namespace

TORCH_LIBRARY(asyncllm_cpu_gemm, m) {
  m.def("supported", &supported);
  m.def("linear", &linear);
  m.def("linear_silu_mul", &linear_silu_mul);
}
