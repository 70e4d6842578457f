// A decoder layer's per-token float32 ops on CPU, in place and in one pass each, as the Triton
// kernels do them on a GPU (the norm, the rotary, the KV cache write): at a decode step's 17 rows torch's versions of these ran 10-50 us of
// a layer in small ops (the rotary's index, chunks, multiplies and cat for q and for k), each a
// pass over memory and a dispatch (bench/NOTES.md). And the bf16 mode's SiLU-and-mul, bf16 in
// and out (float32 inside), its norm over a bf16 x, and its lm_head's top logits in float32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// a decode step's rows (microseconds of work) in the calling thread, a prompt's split over threads
constexpr int64_t kRowsPerTask = 64;

// x's elements read as float32 and written back: float32 as is, bfloat16 through c10's bit
// conversions (round to nearest even, as .to() rounds), which GCC vectorizes
inline float widened(float value) { return value; }
inline float widened(uint16_t bits) { return c10::detail::f32_from_bits(bits); }
inline float rounded(float value, float /*tag*/) { return value; }
inline uint16_t rounded(float value, uint16_t /*tag*/) {
  return c10::detail::round_to_nearest_even(value);
}

// One copy of the reduction for both of x's types, so that its order (which vectorizing
// chooses) and with it the norm do not depend on x's type.
__attribute__((noinline)) float sum_of_squares(const float* values, int64_t count) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < count; ++i) squares += values[i] * values[i];
  return squares;
}

// residual += x; x = residual / rms(residual) * weight, row by row, the sums in float32.
template <typename T>
void add_rms_norm_rows(T* xs, float* rs, const float* w, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xs + r * hidden;
      float* rr = rs + r * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) rr[i] += widened(xr[i]);
      const float inverse_rms = 1.f / std::sqrt(sum_of_squares(rr, hidden) / hidden + eps);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) xr[i] = rounded(rr[i] * inverse_rms * w[i], T{});
    }
  });
}

// x float32, or bfloat16 (the bf16 mode's GEMM outputs: the normed x comes back in bf16, the
// next GEMM's input, so neither way needs a cast); residual and weight float32.
void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  for (const at::Tensor* t : {&x, &residual, &weight})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() &&
                    (t->scalar_type() == at::kFloat ||
                     (t == &x && t->scalar_type() == at::kBFloat16)),
                "fused_add_rms_norm: contiguous CPU tensors, float32 (x bfloat16 too)");
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1),
              "fused_add_rms_norm: x and residual [rows, hidden], weight [hidden]");
  float* rs = residual.mutable_data_ptr<float>();
  const float* w = weight.const_data_ptr<float>();
  const auto e = static_cast<float>(eps);
  if (x.scalar_type() == at::kBFloat16) {
    auto* xs = reinterpret_cast<uint16_t*>(x.mutable_data_ptr<c10::BFloat16>());
    add_rms_norm_rows(xs, rs, w, x.size(0), x.size(1), e);
  } else {
    add_rms_norm_rows(x.mutable_data_ptr<float>(), rs, w, x.size(0), x.size(1), e);
  }
}

// Each head of x [tokens, heads, head_dim] (rows may be strided) rotated by its token's angles:
// the pairs (i, i + head_dim / 2), cos in the first half of the cache's row, sin in the second.
void rotate_heads(const at::Tensor& x, const int64_t* positions, const float* cos_sin,
                  int64_t head_dim) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == head_dim && x.stride(2) == 1,
              "rotary_embedding: q and k [tokens, heads, head_dim], head_dim contiguous");
  const int64_t half = head_dim / 2, heads = x.size(1);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  float* base = x.mutable_data_ptr<float>();
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_sin + positions[t] * head_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        float* first = base + t * token_stride + h * head_stride;
        float* second = first + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = first[i], b = second[i];
          first[i] = a * cos[i] - b * sin[i];
          second[i] = b * cos[i] + a * sin[i];
        }
      }
    }
  });
}

void rotary_embedding(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& cos_sin_cache) {
  for (const at::Tensor* t : {&q, &k, &cos_sin_cache})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat,
                "rotary_embedding: float32 CPU q, k and cos_sin_cache");
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous() && positions.size(0) == q.size(0) &&
                  positions.size(0) == k.size(0),
              "rotary_embedding: contiguous int64 positions, one per token of q and k");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.size(1) % 2 == 0,
              "rotary_embedding: a contiguous [max_position, head_dim] cos_sin_cache");
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t limit = cos_sin_cache.size(0);
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < limit, "rotary_embedding: position ", pos[t],
                " is outside 0..", limit - 1);
  const float* cos_sin = cos_sin_cache.const_data_ptr<float>();
  rotate_heads(q, pos, cos_sin, cos_sin_cache.size(1));
  rotate_heads(k, pos, cos_sin, cos_sin_cache.size(1));
}

template <typename cache_t>
void write_rows(const at::Tensor& source, cache_t* plane, const int64_t* slots) {
  const int64_t heads = source.size(1), head_dim = source.size(2), row = heads * head_dim;
  const float* base = source.const_data_ptr<float>();
  at::parallel_for(0, source.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      for (int64_t h = 0; h < heads; ++h) {
        const float* from = base + t * source.stride(0) + h * source.stride(1);
        cache_t* to = plane + slots[t] * row + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) to[d] = static_cast<cache_t>(from[d]);
      }
    }
  });
}

// Each token's key and value [tokens, kv_heads, head_dim] (rows may be strided) into its slot
// of a float32 or bfloat16 cache [2, blocks, block_size, kv_heads, head_dim]; slots < 0 are
// padding, skipped.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping) {
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 &&
                    t->stride(2) == 1 && t->sizes() == key.sizes(),
                "write_kv_cache: float32 CPU key and value [tokens, kv_heads, head_dim]");
  TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  kv_cache.is_contiguous() && kv_cache.size(3) == key.size(1) &&
                  kv_cache.size(4) == key.size(2),
              "write_kv_cache: a contiguous [2, blocks, block_size, kv_heads, head_dim] cache");
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) == key.size(0),
              "write_kv_cache: contiguous int64 slot_mapping, one per token");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t limit = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < slot_mapping.size(0); ++t)
    TORCH_CHECK(slots[t] < limit, "write_kv_cache: slot ", slots[t], " is past the cache's ",
                limit);
  if (kv_cache.scalar_type() == at::kBFloat16) {
    auto* keys = kv_cache.mutable_data_ptr<c10::BFloat16>();
    write_rows(key, keys, slots);
    write_rows(value, keys + kv_cache.stride(0), slots);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kFloat, "write_kv_cache: a float32 or bf16 cache");
    auto* keys = kv_cache.mutable_data_ptr<float>();
    write_rows(key, keys, slots);
    write_rows(value, keys + kv_cache.stride(0), slots);
  }
}

// exp(x) in float32 within 2 ulp, in a form GCC vectorizes (libm's expf, std::floor and
// std::fmin it does not, without -ffast-math): x = n ln2 + r, |r| <= ln2 / 2 (n rounded by the
// 1.5 * 2^23 shift, ln2 in two parts), exp(r) by Cephes's polynomial, 2^n put into the
// exponent's bits (n = 128 past 88.5 or so: infinity, as expf overflows, so silu(-90) is -0).
inline float vector_exp(float x) {
  x = x < -87.3f ? -87.3f : (x > 89.f ? 89.f : x);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// silu(gate) * up of x = [gate | up] [rows, 2 * inner] in bfloat16, computed in float32 and
// rounded once, as the float32 path rounds it on its way into the next bf16 GEMM; the bf16
// mode's GEMM output goes in and the next GEMM's input comes out, without the two float32
// copies between (bench/NOTES.md).
at::Tensor silu_and_mul_bf16(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul_bf16: a bfloat16 CPU [rows, 2 * inner], rows contiguous");
  const int64_t inner = x.size(1) / 2, row_stride = x.stride(0);
  at::Tensor out = at::empty({x.size(0), inner}, x.options());
  const auto* in = reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>());
  auto* to = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<c10::BFloat16>());
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* gate = in + r * row_stride;
      const uint16_t* up = gate + inner;
      uint16_t* row = to + r * inner;
#pragma omp simd
      for (int64_t i = 0; i < inner; ++i) {
        const float g = widened(gate[i]);
        row[i] = rounded(g / (1.f + vector_exp(-g)) * widened(up[i]), uint16_t{});
      }
    }
  });
  return out;
}

// Chunks of a logits row whose largest value is below the threshold are passed over whole.
constexpr int64_t kLogitChunk = 64;

// The bf16 mode's lm_head (cpu_bf16.py): each row's logits within margin of its largest are
// recomputed as float32 dot products of the row's hidden state with weight's rows, in place.
void refine_top_logits(const at::Tensor& logits, const at::Tensor& hidden, const at::Tensor& weight,
                       double margin) {
  for (const at::Tensor* t : {&logits, &hidden, &weight})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat &&
                    t->dim() == 2,
                "refine_top_logits: contiguous float32 CPU matrices");
  const int64_t vocab = logits.size(1), width = hidden.size(1);
  TORCH_CHECK(hidden.size(0) == logits.size(0) && weight.size(0) == vocab &&
                  weight.size(1) == width,
              "refine_top_logits: logits [R, V], hidden [R, H], weight [V, H]");
  float* all = logits.mutable_data_ptr<float>();
  const float* hs = hidden.const_data_ptr<float>();
  const float* ws = weight.const_data_ptr<float>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = all + r * vocab;
      const float* h = hs + r * width;
      float top = -INFINITY;
#pragma omp simd reduction(max : top)
      for (int64_t v = 0; v < vocab; ++v) top = row[v] > top ? row[v] : top;
      const float threshold = top - static_cast<float>(margin);
      for (int64_t start = 0; start < vocab; start += kLogitChunk) {
        const int64_t stop = std::min(start + kLogitChunk, vocab);
        float chunk_top = -INFINITY;
#pragma omp simd reduction(max : chunk_top)
        for (int64_t v = start; v < stop; ++v) chunk_top = row[v] > chunk_top ? row[v] : chunk_top;
        if (!(chunk_top >= threshold)) continue;
        for (int64_t v = start; v < stop; ++v) {
          if (!(row[v] >= threshold)) continue;
          const float* w = ws + v * width;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < width; ++i) dot += h[i] * w[i];
          row[v] = dot;
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(asyncllm_cpu_layer, m) {
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &fused_add_rms_norm);
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos_sin_cache) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &rotary_embedding);
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, &write_kv_cache);
  m.def("silu_and_mul_bf16(Tensor x) -> Tensor");
  m.impl("silu_and_mul_bf16", c10::DispatchKey::CPU, &silu_and_mul_bf16);
  m.def("refine_top_logits(Tensor(a!) logits, Tensor hidden, Tensor weight, float margin) -> ()");
  m.impl("refine_top_logits", c10::DispatchKey::CPU, &refine_top_logits);
}
