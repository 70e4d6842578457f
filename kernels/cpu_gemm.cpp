// The fp32 linear layers' GEMM on CPU with AVX-512: y [M, N] = x [M, K] @ W^T (+ bias), W packed
// as panels of 32 columns, [N / 32][K][32], each panel read once from memory in address order.
// At decode's 8-32 rows oneDNN's packed GEMM waited on the weights' reads from memory; here
// the next panel is prefetched into L2 while this one is computed (the offline fp32 workload
// 1.21x on the Zen 4: bench/results/throughput_fp32_cpu_smollm2_zen4_cpu_gemm_*.json).
// And the MLP's gate/up projection with SiLU-and-mul applied to its sums: [gate | up] is
// never written, only silu(gate) * up [M, N / 2].
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <utility>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // a panel's columns: two AVX-512 vectors
constexpr int kMaxRows = 14;    // rows a block: 28 accumulators of AVX-512's 32 registers
constexpr int64_t kChunkFloats = 96 * 1024;  // rows of x a thread keeps in L2 across panels

struct Gemm {
  const float* x;
  int64_t ldx;
  const float* w;  // [N / 32][K][32]
  const float* bias;  // [N] or null
  float* y;
  int64_t ldy, K;
};

#ifdef __AVX512F__

// What a block does with its sums: y = sums + bias; keep them in a tile (a gate's); or
// y = silu(tile) * sums (the up's).
enum class Epilogue { kBias, kGate, kSiluMul };

// exp(x), Cephes' polynomial as kernels/cpu_layer_ops.cpp's vector_exp (about 1 ulp); past 89
// the exponent's bits overflow to infinity, as expf does.
__m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(89.f));
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __m512 n =
      _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic), magic);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  const __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// silu(gate) * up, silu(g) = g / (1 + exp(-g)) as torch computes it
__m512 silu_mul(__m512 gate, __m512 up) {
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  return _mm512_mul_ps(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e)), up);
}

// The rows [0, ROWS) of x from `x` times one panel, to y at column `col` (or to `tile`, ROWS x
// 32); while it runs, the panel `next` (null: none) is prefetched into L2, a line for each line
// of this panel read.
template <Epilogue E, int ROWS>
void panel_block(const Gemm& g, const float* x, const float* panel, float* y, int64_t col,
                 const float* next, float* tile) {
  __m512 lo[ROWS], hi[ROWS];
  for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < g.K; ++k) {
    if (next) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel + 16), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * g.ldx + k]);
      lo[r] = _mm512_fmadd_ps(a, w0, lo[r]);
      hi[r] = _mm512_fmadd_ps(a, w1, hi[r]);
    }
  }
  if constexpr (E == Epilogue::kGate) {
    for (int r = 0; r < ROWS; ++r) {
      _mm512_storeu_ps(tile + r * kPanel, lo[r]);
      _mm512_storeu_ps(tile + r * kPanel + 16, hi[r]);
    }
  } else if constexpr (E == Epilogue::kSiluMul) {
    for (int r = 0; r < ROWS; ++r) {
      _mm512_storeu_ps(y + r * g.ldy + col, silu_mul(_mm512_loadu_ps(tile + r * kPanel), lo[r]));
      _mm512_storeu_ps(y + r * g.ldy + col + 16,
                       silu_mul(_mm512_loadu_ps(tile + r * kPanel + 16), hi[r]));
    }
  } else {
    const __m512 b0 = g.bias ? _mm512_loadu_ps(g.bias + col) : _mm512_setzero_ps();
    const __m512 b1 = g.bias ? _mm512_loadu_ps(g.bias + col + 16) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      _mm512_storeu_ps(y + r * g.ldy + col, _mm512_add_ps(lo[r], b0));
      _mm512_storeu_ps(y + r * g.ldy + col + 16, _mm512_add_ps(hi[r], b1));
    }
  }
}

using BlockFn = void (*)(const Gemm&, const float*, const float*, float*, int64_t, const float*,
                         float*);

template <Epilogue E, int... I>
constexpr std::array<BlockFn, sizeof...(I)> block_table(std::integer_sequence<int, I...>) {
  return {panel_block<E, I + 1>...};
}

template <Epilogue E>
const auto kBlocks = block_table<E>(std::make_integer_sequence<int, kMaxRows>{});

const float* panel_at(const Gemm& g, int64_t p) { return g.w + p * g.K * kPanel; }

// Rows [m0, m1) in blocks of at most kMaxRows rows of about equal size, each times panel p to
// y's columns from p * 32; the first block prefetches panel `next` (-1: none).
void panel_rows(const Gemm& g, int64_t m0, int64_t m1, int64_t p, int64_t next) {
  const int64_t rows = m1 - m0, blocks = (rows + kMaxRows - 1) / kMaxRows;
  for (int64_t b = 0, start = 0; b < blocks; ++b) {
    const int64_t end = rows * (b + 1) / blocks;
    const float* ahead = b == 0 && next >= 0 ? panel_at(g, next) : nullptr;
    kBlocks<Epilogue::kBias>[end - start - 1](g, g.x + (m0 + start) * g.ldx, panel_at(g, p),
                                              g.y + (m0 + start) * g.ldy, p * kPanel, ahead,
                                              nullptr);
    start = end;
  }
}

// The same for the gate panel p and its up panel p + half, silu(gate) * up to y's columns from
// p * 32, each block's gate sums held in a tile until its up sums are done.
void pair_rows(const Gemm& g, int64_t m0, int64_t m1, int64_t p, int64_t next) {
  const int64_t rows = m1 - m0, blocks = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t half = g.ldy / kPanel;
  alignas(64) float tile[kMaxRows * kPanel];
  for (int64_t b = 0, start = 0; b < blocks; ++b) {
    const int64_t end = rows * (b + 1) / blocks;
    const bool ahead = b == 0 && next >= 0;
    const float* x = g.x + (m0 + start) * g.ldx;
    float* y = g.y + (m0 + start) * g.ldy;
    kBlocks<Epilogue::kGate>[end - start - 1](g, x, panel_at(g, p), y, p * kPanel,
                                              ahead ? panel_at(g, next) : nullptr, tile);
    kBlocks<Epilogue::kSiluMul>[end - start - 1](g, x, panel_at(g, p + half), y, p * kPanel,
                                                 ahead ? panel_at(g, next + half) : nullptr,
                                                 tile);
    start = end;
  }
}

#else  // never called: check() refuses first

void panel_rows(const Gemm&, int64_t, int64_t, int64_t, int64_t) {}
void pair_rows(const Gemm&, int64_t, int64_t, int64_t, int64_t) {}

#endif  // __AVX512F__

// One thread's panels [p0, p1) for every row, the rows in chunks that stay in L2.
template <class Rows>
void thread_panels(const Gemm& g, int64_t M, int64_t p0, int64_t p1, Rows rows) {
  const int64_t chunk = std::max<int64_t>(kMaxRows, kChunkFloats / g.K);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    for (int64_t p = p0; p < p1; ++p) rows(g, m0, m1, p, p + 1 < p1 ? p + 1 : -1);
  }
}

bool supported() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

void check(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(supported(), "cpu_gemm: built without AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "cpu_gemm: x is float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.scalar_type() == torch::kFloat,
              "cpu_gemm: the weight is packed [N / 32][K][32]");
  TORCH_CHECK(packed.size(1) == x.size(1), "cpu_gemm: x's columns are not the weight's K");
}

// y [M, columns] from `panels` panels, each thread a range of them; rows(g, m0, m1, p, next)
template <class Rows>
torch::Tensor run(torch::Tensor x, const torch::Tensor& packed, const float* bias,
                  int64_t columns, int64_t panels, Rows rows) {
  if (x.stride(1) != 1) x = x.contiguous();
  auto y = torch::empty({x.size(0), columns}, x.options());
  const Gemm g{x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), bias,
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
  return run(x, packed, bias ? bias->data_ptr<float>() : nullptr, N, panels, panel_rows);
}

// silu(x @ gate^T) * (x @ up^T) for the weight [gate | up] packed: [M, N / 2]
torch::Tensor linear_silu_mul(torch::Tensor x, torch::Tensor packed) {
  check(x, packed);
  TORCH_CHECK(packed.size(0) % 2 == 0, "cpu_gemm: gate and up are whole panels each");
  const int64_t half = packed.size(0) / 2;
  return run(x, packed, nullptr, half * kPanel, half, pair_rows);
}

}  // namespace

TORCH_LIBRARY(asyncllm_cpu_gemm, m) {
  m.def("supported", &supported);
  m.def("linear", &linear);
  m.def("linear_silu_mul", &linear_silu_mul);
}
