// The fp32 linear layers' GEMM on CPU with AVX-512: y [M, N] = x [M, K] @ W^T (+ bias), W packed
// as panels of 32 columns, [N / 32][K][32], each panel read once from memory in address order.
// oneDNN read the weights of decode-sized GEMMs (8-32 rows) at 21 GB/s of the Zen 4's 48;
// prefetching the next panel into L2 while this one is computed is most of the gain here.
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

#ifdef __AVX512F__

struct Gemm {
  const float* x;
  int64_t ldx;
  const float* w;  // [N / 32][K][32]
  const float* bias;  // [N] or null
  float* y;
  int64_t N, K;
};

// The rows [0, ROWS) of x from `x` times one panel, into y at column `col`; while it runs, the
// panel `next` (null: none) is prefetched into L2, a line for each line of this panel read.
template <int ROWS>
void panel_block(const Gemm& g, const float* x, const float* panel, float* y, int64_t col,
                 const float* next) {
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
  const __m512 b0 = g.bias ? _mm512_loadu_ps(g.bias + col) : _mm512_setzero_ps();
  const __m512 b1 = g.bias ? _mm512_loadu_ps(g.bias + col + 16) : _mm512_setzero_ps();
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(y + r * g.N + col, _mm512_add_ps(lo[r], b0));
    _mm512_storeu_ps(y + r * g.N + col + 16, _mm512_add_ps(hi[r], b1));
  }
}

using BlockFn = void (*)(const Gemm&, const float*, const float*, float*, int64_t, const float*);

template <int... I>
constexpr std::array<BlockFn, sizeof...(I)> block_table(std::integer_sequence<int, I...>) {
  return {panel_block<I + 1>...};
}

const auto kBlocks = block_table(std::make_integer_sequence<int, kMaxRows>{});

// Rows [m0, m1) times one panel, in blocks of at most kMaxRows rows of about equal size; the
// first block prefetches `next`.
void panel_rows(const Gemm& g, int64_t m0, int64_t m1, int64_t p, const float* next) {
  const int64_t rows = m1 - m0, blocks = (rows + kMaxRows - 1) / kMaxRows;
  const float* panel = g.w + p * g.K * kPanel;
  for (int64_t b = 0, start = 0; b < blocks; ++b) {
    const int64_t end = rows * (b + 1) / blocks;
    kBlocks[end - start - 1](g, g.x + (m0 + start) * g.ldx, panel, g.y + (m0 + start) * g.N,
                             p * kPanel, b == 0 ? next : nullptr);
    start = end;
  }
}

// One thread's panels [p0, p1) for every row, the rows in chunks that stay in L2.
void thread_panels(const Gemm& g, int64_t M, int64_t p0, int64_t p1) {
  const int64_t chunk = std::max<int64_t>(kMaxRows, kChunkFloats / g.K);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    for (int64_t p = p0; p < p1; ++p) {
      const float* next = p + 1 < p1 ? g.w + (p + 1) * g.K * kPanel : nullptr;
      panel_rows(g, m0, m1, p, next);
    }
  }
}

#endif  // __AVX512F__

bool supported() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(supported(), "cpu_gemm: built without AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "cpu_gemm: x is float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "cpu_gemm: the weight is packed [N / 32][K][32]");
  TORCH_CHECK(packed.size(1) == x.size(1), "cpu_gemm: x's columns are not the weight's K");
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), N = panels * kPanel;
  auto y = torch::empty({M, N}, x.options());
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                    bias->numel() == N,
                "cpu_gemm: the bias is float32 [N]");
  }
#ifdef __AVX512F__
  const Gemm g{x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(),
               bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), N, K};
  if (M > 0) {
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) { thread_panels(g, M, p0, p1); });
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(asyncllm_cpu_gemm, m) {
  m.def("supported", &supported);
  m.def("linear", &linear);
}
