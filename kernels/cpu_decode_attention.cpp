// Paged decode attention on CPU: one query token per request attends over its KV blocks where
// they lie in the cache, with no gathered copy. Layout: asyncllm/attention/backend.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

struct Shape {
  int64_t num_reqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t group() const { return num_heads / num_kv_heads; }
  int64_t token_stride() const { return num_kv_heads * head_dim; }
  int64_t block_stride() const { return block_size * token_stride(); }
};

// Per-thread scratch, grown to the longest context the thread meets.
struct Scratch {
  std::vector<float> query, scores, acc, inv_sum;
};

template <typename scalar_t>
float dot(const float* q, const scalar_t* k, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

template <typename scalar_t>
void add_scaled(float* acc, float w, const scalar_t* v, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += w * static_cast<float>(v[d]);
}

// Calls visit(pos, offset of the position's row within the K or V half) block by block.
template <typename Visit>
void for_each_position(const int32_t* block_table, int64_t seq_len, const Shape& s, Visit visit) {
  for (int64_t start = 0; start < seq_len; start += s.block_size) {
    const int64_t base = block_table[start / s.block_size] * s.block_stride();
    const int64_t n = std::min(s.block_size, seq_len - start);
    for (int64_t t = 0; t < n; ++t) visit(start + t, base + t * s.token_stride());
  }
}

// The query heads sharing one KV head of one request: each K and V row is read once for all of
// them. Scratch: q [group, D] pre-scaled, scores [group, seq_len], acc [group, D].
// kHeadDim > 0 makes head_dim a compile-time constant (fully unrolled loops: 1.5x faster at 64);
// 0 reads it from the shape.
template <typename scalar_t, int64_t kHeadDim>
void attend_group(const scalar_t* query, const scalar_t* keys, const scalar_t* values,
                  const int32_t* block_table, int64_t seq_len, float scale, scalar_t* out,
                  const Shape& s, Scratch& scratch) {
  const int64_t group = s.group(), D = kHeadDim > 0 ? kHeadDim : s.head_dim;
  scratch.query.resize(group * D);
  scratch.scores.resize(group * seq_len);
  scratch.acc.assign(group * D, 0.f);
  scratch.inv_sum.resize(group);
  float* q = scratch.query.data();
  float* scores = scratch.scores.data();
  float* acc = scratch.acc.data();
  float* inv_sum = scratch.inv_sum.data();
  for (int64_t i = 0; i < group * D; ++i) q[i] = scale * static_cast<float>(query[i]);

  for_each_position(block_table, seq_len, s, [&](int64_t pos, int64_t offset) {
    for (int64_t g = 0; g < group; ++g)
      scores[g * seq_len + pos] = dot(q + g * D, keys + offset, D);
  });
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * seq_len;
    const float max = *std::max_element(row, row + seq_len);
    float sum = 0.f;
    for (int64_t pos = 0; pos < seq_len; ++pos) sum += row[pos] = std::exp(row[pos] - max);
    inv_sum[g] = 1.f / sum;
  }
  for_each_position(block_table, seq_len, s, [&](int64_t pos, int64_t offset) {
    for (int64_t g = 0; g < group; ++g)
      add_scaled(acc + g * D, scores[g * seq_len + pos], values + offset, D);
  });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < D; ++d)
      out[g * D + d] = static_cast<scalar_t>(acc[g * D + d] * inv_sum[g]);
}

template <typename scalar_t>
void attend_all(const at::Tensor& query, const at::Tensor& kv_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, float scale,
                const at::Tensor& out, const Shape& s) {
  const scalar_t* q = query.const_data_ptr<scalar_t>();
  const scalar_t* keys = kv_cache.const_data_ptr<scalar_t>();
  const scalar_t* values = keys + kv_cache.stride(0);
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  scalar_t* o = out.mutable_data_ptr<scalar_t>();
  const int64_t head_span = s.group() * s.head_dim;
  const auto attend = s.head_dim == 64    ? attend_group<scalar_t, 64>
                      : s.head_dim == 128 ? attend_group<scalar_t, 128>
                                          : attend_group<scalar_t, 0>;
  at::parallel_for(0, s.num_reqs * s.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / s.num_kv_heads, h = item % s.num_kv_heads;
      attend(q + r * query.stride(0) + h * head_span, keys + h * s.head_dim,
             values + h * s.head_dim, tables + r * s.max_blocks, lens[r], scale,
             o + r * out.stride(0) + h * head_span, s, scratch);
    }
  });
}

// The kernel trusts every context to be non-empty and every block it reads to exist.
void check_contexts(const at::Tensor& block_tables, const at::Tensor& seq_lens, const Shape& s,
                    int64_t num_blocks) {
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  for (int64_t r = 0; r < s.num_reqs; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= s.max_blocks * s.block_size, "seq_lens[", r,
                "] = ", lens[r], " is outside 1..", s.max_blocks * s.block_size);
    for (int64_t b = 0; b * s.block_size < lens[r]; ++b) {
      const int32_t id = tables[r * s.max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " of request ", r,
                  " is out of range");
    }
  }
}

Shape check_inputs(const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& out) {
  for (const at::Tensor* t : {&query, &kv_cache, &block_tables, &seq_lens, &out})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention: every tensor must be on the CPU");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "query must be float32 or bfloat16");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, kv_cache and out must share a dtype");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "query and out: [rows, num_heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "query and out rows must be dense");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache: contiguous [2, num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
                  block_tables.is_contiguous(),
              "block_tables: contiguous int32 [num_reqs, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.is_contiguous(),
              "seq_lens: contiguous int32 [num_reqs]");
  const Shape s{seq_lens.size(0), query.size(1),  kv_cache.size(3),
                query.size(2),    kv_cache.size(2), block_tables.size(1)};
  TORCH_CHECK(block_tables.size(0) == s.num_reqs && query.size(0) >= s.num_reqs,
              "block_tables needs one row per request, query at least one");
  TORCH_CHECK(kv_cache.size(4) == s.head_dim, "query and kv_cache head_dim differ");
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  check_contexts(block_tables, seq_lens, s, kv_cache.size(1));
  return s;
}

void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, const at::Tensor& out) {
  const Shape s = check_inputs(query, kv_cache, block_tables, seq_lens, out);
  if (query.scalar_type() == at::kBFloat16)
    attend_all<c10::BFloat16>(query, kv_cache, block_tables, seq_lens, scale, out, s);
  else
    attend_all<float>(query, kv_cache, block_tables, seq_lens, scale, out, s);
}

}  // namespace

TORCH_LIBRARY(asyncllm_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
