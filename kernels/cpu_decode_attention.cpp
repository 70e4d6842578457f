// Paged decode attention on CPU: one query token per request attends over its KV blocks where
// they lie in the cache, with no gathered copy. Layout: asyncllm/attention/backend.py. Query and
// output are float32 or bfloat16, the cache of their dtype or bfloat16 (`--dtype bfloat16` on
// CPU: fp32 activations over a bf16 cache).
//
// Per (request, KV head), one pass over the context in tiles of kTile positions: the scores of
// every query head of the group against the tile, an online softmax, and the tile's values
// added into the heads' accumulators. Each K and V row is read once for the whole group, and
// heads are taken in blocks of up to kHeadBlock so that a block's accumulators stay in the 16
// vector registers of AVX2.
//
// Paged prompt (prefill) attention, float32 query and output: per (request, KV head, chunk of
// eight query rows), the chunk's rows of every query head of the group attend causally over the
// context up to the chunk's last row, in tiles of kPromptTile positions. Scores are held
// transposed, one vector a (position, query head) with the chunk's rows in its lanes, so that
// the online softmax's max and sum are lanewise and the causal mask a lane mask; the query and
// the output are held transposed for that (packed and unpacked once a chunk), and each key and
// value element is broadcast against all the group's rows at once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int kTile = 8;       // positions per tile: one vector of scores
constexpr int kHeadBlock = 3;  // query heads whose accumulators share the registers
constexpr int kChunk = 4;      // vectors of head_dim per accumulator pass over the tile's values

// Eight float lanes: AVX2 intrinsics where the build targets them, plain arrays (left to the
// compiler's vectoriser) elsewhere.
#if defined(__AVX2__) && defined(__FMA__)
struct Vec {
  __m256 v;
};
inline Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vec load(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16))};
}
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
inline Vec splat(float x) { return {_mm256_set1_ps(x)}; }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec round(Vec a) {
  return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// 2^n for integer-valued n in [-126, 127]
inline Vec exp2_int(Vec n) {
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(biased, 23))};
}
// lanes at and past n set to fill
inline Vec first_lanes(Vec a, int n, float fill) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
  return {_mm256_blendv_ps(_mm256_set1_ps(fill), a.v, keep)};
}
// lanes before first set to fill
inline Vec from_lane(Vec a, int first, float fill) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(first - 1)));
  return {_mm256_blendv_ps(_mm256_set1_ps(fill), a.v, keep)};
}
inline float reduce_sum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// out[i] = the sum of a[i]'s lanes, for four vectors at once
inline void store_sums4(const Vec* a, float* out) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a[0].v, a[1].v), _mm256_hadd_ps(a[2].v, a[3].v));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
}
#else
struct Vec {
  float v[8];
};
template <typename F>
inline Vec lanewise(F f) {
  Vec r;
  for (int i = 0; i < 8; ++i) r.v[i] = f(i);
  return r;
}
template <typename scalar_t>
inline Vec load(const scalar_t* p) { return lanewise([&](int i) { return static_cast<float>(p[i]); }); }
inline void store(float* p, Vec a) { std::copy(a.v, a.v + 8, p); }
inline Vec splat(float x) { return lanewise([&](int) { return x; }); }
inline Vec add(Vec a, Vec b) { return lanewise([&](int i) { return a.v[i] + b.v[i]; }); }
inline Vec sub(Vec a, Vec b) { return lanewise([&](int i) { return a.v[i] - b.v[i]; }); }
inline Vec mul(Vec a, Vec b) { return lanewise([&](int i) { return a.v[i] * b.v[i]; }); }
inline Vec fmadd(Vec a, Vec b, Vec c) {
  return lanewise([&](int i) { return std::fma(a.v[i], b.v[i], c.v[i]); });
}
inline Vec max(Vec a, Vec b) { return lanewise([&](int i) { return std::max(a.v[i], b.v[i]); }); }
inline Vec round(Vec a) { return lanewise([&](int i) { return std::nearbyint(a.v[i]); }); }
inline Vec exp2_int(Vec n) {
  return lanewise([&](int i) { return std::ldexp(1.f, static_cast<int>(n.v[i])); });
}
inline Vec first_lanes(Vec a, int n, float fill) {
  return lanewise([&](int i) { return i < n ? a.v[i] : fill; });
}
inline Vec from_lane(Vec a, int first, float fill) {
  return lanewise([&](int i) { return i >= first ? a.v[i] : fill; });
}
inline float reduce_sum(Vec a) { return std::accumulate(a.v, a.v + 8, 0.f); }
inline float reduce_max(Vec a) { return *std::max_element(a.v, a.v + 8); }
inline void store_sums4(const Vec* a, float* out) {
  for (int i = 0; i < 4; ++i) out[i] = reduce_sum(a[i]);
}
#endif

// exp(x) for x <= 0 (a score less the running maximum): x = n ln2 + r with |r| <= ln2 / 2,
// exp(r) by Cephes' degree-7 polynomial (about 1 ulp), 2^n in the exponent bits. Below -87
// exp(x) is under float's smallest normal: a weight of about 1e-38 against a sum of at least 1.
inline Vec exp_nonpositive(Vec x) {
  x = max(x, splat(-87.f));
  const Vec n = round(mul(x, splat(1.44269504088896341f)));
  Vec r = fmadd(n, splat(-0.693359375f), x);
  r = fmadd(n, splat(2.12194440e-4f), r);
  Vec p = splat(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = fmadd(p, r, splat(c));
  p = fmadd(p, mul(r, r), add(r, splat(1.f)));
  return mul(p, exp2_int(n));
}

struct Shape {
  int64_t num_reqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t group() const { return num_heads / num_kv_heads; }
  int64_t token_stride() const { return num_kv_heads * head_dim; }
  int64_t block_stride() const { return block_size * token_stride(); }
};

// One work item's running state over its query heads: q [heads, D] pre-scaled, acc [heads, D],
// the tile's scores or weights [heads, kTile], and per head the running max and sum (lanewise).
struct Scratch {
  std::vector<float> query, acc, scores, max;
  std::vector<Vec> sum;
};

// A request's context in tiles of kTile positions: each tile's row offsets within the K (or V)
// half of the cache, found by counting through the block table rather than a division per row.
class TileCursor {
 public:
  TileCursor(const int32_t* table, int64_t seq_len, const Shape& shape)
      : table_(table), left_(seq_len), shape_(shape) {}

  // Fills rows[0, kTile), past the context's end with its last row; returns the rows in it.
  int next(int64_t* rows) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, left_));
    for (int t = 0; t < n; ++t) {
      rows[t] = table_[block_] * shape_.block_stride() + offset_ * shape_.token_stride();
      if (++offset_ == shape_.block_size) ++block_, offset_ = 0;
    }
    for (int t = n; n > 0 && t < kTile; ++t) rows[t] = rows[n - 1];
    left_ -= n;
    return n;
  }

 private:
  const int32_t* table_;
  int64_t left_, block_ = 0, offset_ = 0;
  const Shape& shape_;
};

// The next tile's rows on their way to L2 while this tile is computed, one line as each line of
// the same place in this tile is read: a request's blocks lie anywhere in the cache, where the
// hardware prefetcher does not follow, and a prefetch waits while the core's misses in flight
// are at their limit, so a burst of them stalls the arithmetic behind it. On a Zen 4 (30 layers
// at 32 x 215 tokens, one thread): the next tile's 192 lines in one burst 35-41 ms, K's and V's
// in two bursts 27-28, a line at a time 18.6; into L1 (prefetcht0) or further ahead, slower.
template <typename scalar_t>
inline void prefetch_line(const scalar_t* row, int64_t d) {
  constexpr int kRead = 0, kL2 = 1;  // __builtin_prefetch's rw and locality arguments
  if (d % (64 / sizeof(scalar_t)) == 0) __builtin_prefetch(row + d, kRead, kL2);
}

// The scores of NH heads against the kTile rows: scores[h * kTile + t] = q_h . k_t; the same
// lines of the ahead rows (the next tile's, or null) prefetched on the way.
template <int NH, typename scalar_t>
void tile_scores(const float* q, const scalar_t* const* rows, const scalar_t* const* ahead,
                 int64_t D, float* scores) {
  for (int half = 0; half < kTile; half += 4) {
    Vec acc[NH][4];
    for (auto& head : acc)
      for (Vec& a : head) a = splat(0.f);
    for (int64_t c = 0; c < D; c += 8) {
      Vec qc[NH];
      for (int h = 0; h < NH; ++h) qc[h] = load(q + h * D + c);
      for (int t = 0; t < 4; ++t) {
        const Vec k = load(rows[half + t] + c);
        if (ahead) prefetch_line(ahead[half + t], c);
        for (int h = 0; h < NH; ++h) acc[h][t] = fmadd(qc[h], k, acc[h][t]);
      }
    }
    for (int h = 0; h < NH; ++h) store_sums4(acc[h], scores + h * kTile + half);
  }
}

// acc_h[c0, c0 + 8 W) += sum over the tile's first n rows of p_h[t] v_t[c0, c0 + 8 W), the
// ahead rows' same lines prefetched
template <int NH, int W, typename scalar_t>
void add_values(const float* p, const scalar_t* const* rows, const scalar_t* const* ahead, int n,
                int64_t c0, int64_t D, float* acc) {
  Vec a[NH][W];
  for (int h = 0; h < NH; ++h)
    for (int w = 0; w < W; ++w) a[h][w] = load(acc + h * D + c0 + 8 * w);
  for (int t = 0; t < n; ++t) {
    Vec weight[NH];
    for (int h = 0; h < NH; ++h) weight[h] = splat(p[h * kTile + t]);
    for (int w = 0; w < W; ++w) {
      const Vec v = load(rows[t] + c0 + 8 * w);
      if (ahead) prefetch_line(ahead[t], c0 + 8 * w);
      for (int h = 0; h < NH; ++h) a[h][w] = fmadd(weight[h], v, a[h][w]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int w = 0; w < W; ++w) store(acc + h * D + c0 + 8 * w, a[h][w]);
}

template <int NH, typename scalar_t>
void add_tile_values(const float* p, const scalar_t* const* rows, const scalar_t* const* ahead,
                     int n, int64_t D, float* acc) {
  int64_t c0 = 0;
  for (; c0 + 8 * kChunk <= D; c0 += 8 * kChunk)
    add_values<NH, kChunk>(p, rows, ahead, n, c0, D, acc);
  for (; c0 < D; c0 += 8) add_values<NH, 1>(p, rows, ahead, n, c0, D, acc);
}

// Turns a tile's scores (n valid) into weights against the running max, rescaling the heads'
// sums and accumulators where the max grew.
void online_softmax(float* scores, int n, int64_t heads, int64_t D, Scratch& s, float* acc) {
  for (int64_t h = 0; h < heads; ++h) {
    const Vec x = first_lanes(load(scores + h * kTile), n, -std::numeric_limits<float>::infinity());
    const float tile_max = reduce_max(x);
    if (tile_max > s.max[h]) {
      const Vec correction = splat(std::exp(s.max[h] - tile_max));  // 0 on the first tile
      s.sum[h] = mul(s.sum[h], correction);
      for (int64_t d = 0; d < D; d += 8)
        store(acc + h * D + d, mul(load(acc + h * D + d), correction));
      s.max[h] = tile_max;
    }
    const Vec p = first_lanes(exp_nonpositive(add(x, splat(-s.max[h]))), n, 0.f);
    s.sum[h] = add(s.sum[h], p);
    store(scores + h * kTile, p);
  }
}

// Heads [0, heads) in blocks of up to kHeadBlock, the tail block by its own instantiation.
template <typename Block>
void for_head_blocks(int64_t heads, Block block) {
  int64_t h = 0;
  for (; h + kHeadBlock <= heads; h += kHeadBlock) block(h, std::integral_constant<int, 3>{});
  if (heads - h == 2) block(h, std::integral_constant<int, 2>{});
  if (heads - h == 1) block(h, std::integral_constant<int, 1>{});
}

template <typename kv_t>
void point_rows(const kv_t* half, const int64_t* rows, const kv_t** out) {
  for (int t = 0; t < kTile; ++t) out[t] = half + rows[t];
}

// The work item a thread takes next, whose first tile is prefetched during this one's last.
struct NextItem {
  const int32_t* block_table = nullptr;  // null: none
  int64_t seq_len = 0;
  int64_t shift = 0;  // its KV heads' place in a row less this item's
};

// KV heads [first, first + count) of one request, with the query heads of their groups: each
// tile's rows are read once for all of them, count * head_dim values side by side.
template <typename q_t, typename kv_t>
void attend_heads(const q_t* query, const kv_t* keys, const kv_t* values,
                  const int32_t* block_table, int64_t seq_len, float scale, q_t* out,
                  int64_t count, const Shape& shape, Scratch& s, const NextItem& following) {
  const int64_t G = shape.group(), D = shape.head_dim, heads = count * G;
  s.query.resize(heads * D);
  s.scores.resize(heads * kTile);
  s.acc.assign(heads * D, 0.f);
  s.max.assign(heads, -std::numeric_limits<float>::infinity());
  s.sum.assign(heads, splat(0.f));
  float* acc = s.acc.data();
  float* scores = s.scores.data();
  for (int64_t i = 0; i < heads * D; ++i) s.query[i] = scale * static_cast<float>(query[i]);

  TileCursor cursor(block_table, seq_len, shape);
  int64_t rows[2][kTile], first_rows[kTile];
  int n_next = cursor.next(rows[0]);
  const kv_t* key_rows[kTile];
  const kv_t* value_rows[kTile];
  const kv_t* key_ahead[kTile];
  const kv_t* value_ahead[kTile];
  for (int64_t tile = 0; n_next > 0; ++tile) {
    const int64_t* current = rows[tile % 2];
    const int n = n_next;
    n_next = cursor.next(rows[(tile + 1) % 2]);
    const int64_t* next = rows[(tile + 1) % 2];
    int64_t shift = 0;
    if (n_next == 0 && following.block_table) {
      TileCursor(following.block_table, following.seq_len, shape).next(first_rows);
      next = first_rows, shift = following.shift;
    }
    // by a KV head's first block of query heads
    const bool prefetch = n_next > 0 || following.block_table;
    for (int64_t kv = 0; kv < count; ++kv) {
      point_rows(keys + kv * D, current, key_rows);
      point_rows(keys + kv * D + shift, next, key_ahead);
      for_head_blocks(G, [&](int64_t h, auto nh) {
        const int64_t head = kv * G + h;
        tile_scores<decltype(nh)::value>(s.query.data() + head * D, key_rows,
                                         prefetch && h == 0 ? key_ahead : nullptr, D,
                                         scores + head * kTile);
      });
    }
    online_softmax(scores, n, heads, D, s, acc);
    for (int64_t kv = 0; kv < count; ++kv) {
      point_rows(values + kv * D, current, value_rows);
      point_rows(values + kv * D + shift, next, value_ahead);
      for_head_blocks(G, [&](int64_t h, auto nh) {
        const int64_t head = kv * G + h;
        add_tile_values<decltype(nh)::value>(scores + head * kTile, value_rows,
                                             prefetch && h == 0 ? value_ahead : nullptr, n, D,
                                             acc + head * D);
      });
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv_sum = 1.f / reduce_sum(s.sum[h]);
    for (int64_t d = 0; d < D; ++d)
      out[h * D + d] = static_cast<q_t>(acc[h * D + d] * inv_sum);
  }
}

// parts[i], parts[i + 1]: the first and last + 1 of the items of part i, parts of about equal
// cost, not of equal item counts; ends[item]: the cost of the items up to and including item.
std::vector<int64_t> split_by_cost(const std::vector<int64_t>& ends, int64_t num_parts) {
  const int64_t items = static_cast<int64_t>(ends.size());
  const int64_t total = items ? ends.back() : 0;
  std::vector<int64_t> parts(num_parts + 1, items);
  parts[0] = 0;
  for (int64_t part = 1; part < num_parts; ++part)
    parts[part] = std::lower_bound(ends.begin(), ends.end(), total * part / num_parts) -
                  ends.begin() + 1;
  return parts;
}

// Parts of about equal tokens (a context's length, plus a tile for an item's own cost): a
// step's contexts differ in length.
std::vector<int64_t> split_by_tokens(const int32_t* lens, int64_t items, int64_t spans,
                                     int64_t num_parts) {
  std::vector<int64_t> ends(items);
  int64_t total = 0;
  for (int64_t item = 0; item < items; ++item) ends[item] = total += lens[item / spans] + kTile;
  return split_by_cost(ends, num_parts);
}

// Work items are (request, span of KV heads): a request's every KV head at once where there
// are requests enough to keep the threads busy (its rows read whole, in address order), one
// KV head an item where there are few. A thread takes a part of about equal tokens.
template <typename q_t, typename kv_t>
void attend_all(const at::Tensor& query, const at::Tensor& kv_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, float scale,
                const at::Tensor& out, const Shape& s) {
  const q_t* q = query.const_data_ptr<q_t>();
  const kv_t* keys = kv_cache.const_data_ptr<kv_t>();
  const kv_t* values = keys + kv_cache.stride(0);
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  q_t* o = out.mutable_data_ptr<q_t>();
  const int64_t head_span = s.group() * s.head_dim;
  const int64_t threads = at::get_num_threads();
  const int64_t span = s.num_reqs >= 4 * threads ? s.num_kv_heads : 1;
  const int64_t spans = s.num_kv_heads / span;
  const std::vector<int64_t> parts = split_by_tokens(lens, s.num_reqs * spans, spans, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t item = parts[begin]; item < parts[end]; ++item) {
      const int64_t r = item / spans, h = item % spans * span;
      const int64_t r2 = (item + 1) / spans, h2 = (item + 1) % spans * span;
      const NextItem following = item + 1 < parts[end]
                                     ? NextItem{tables + r2 * s.max_blocks, lens[r2],
                                                (h2 - h) * s.head_dim}
                                     : NextItem{};
      attend_heads(q + r * query.stride(0) + h * head_span, keys + h * s.head_dim,
                   values + h * s.head_dim, tables + r * s.max_blocks, lens[r], scale,
                   o + r * out.stride(0) + h * head_span, span, s, scratch, following);
    }
  });
}

constexpr int kChunkRows = 8;    // query rows a prompt work item: one vector's lanes
constexpr int kPromptTile = 32;  // positions a tile of the prompt kernel
// rows of a block of broadcast products: with AVX-512's 32 vector registers a block's 8 x 3
// accumulators fit (the kernel 1.45x faster than at 4 x 3 on a Zen 4), in AVX2's 16 only 4 x 3
#ifdef __AVX512VL__
constexpr int kProductRows = 8;
#else
constexpr int kProductRows = 4;
#endif

// A prompt work item's state over its M = group * kChunkRows query rows, head g's row i as row
// g * kChunkRows + i: each a vector's lane, so vector g holds head g's rows.
struct PromptScratch {
  std::vector<float> query_t;    // [D][M], pre-scaled, zero in the lanes past the chunk's rows
  std::vector<float> scores;     // [kPromptTile][M]: the tile's scores, then its weights
  std::vector<float> acc_t;      // [D][M]: the output, transposed
  std::vector<float> tile_rows;  // [2][kPromptTile][D]: a bf16 tile's keys and values as float32
  std::vector<Vec> max, sum, correction;  // per query head of the group, lanewise over the rows
};

// c[i][v] = sum over k < K of a(i, k) b[k][v], for I rows i and NV vectors v, ld floats between
// rows of b and of c; rescale[v] (null: none) times c[i][v] added to it. The scores are
// a(t, d) = key t's element d against the transposed query, the transposed output
// a(d, t) = value t's element d against the tile's weights: each element broadcast once for the
// NV vectors of rows.
template <int I, int NV, typename Elements>
void broadcast_products(Elements a, int64_t K, const float* b, int64_t ld, const Vec* rescale,
                        float* c) {
  Vec acc[I][NV];
  for (int i = 0; i < I; ++i)
    for (int v = 0; v < NV; ++v)
      acc[i][v] = rescale ? mul(load(c + i * ld + 8 * v), rescale[v]) : splat(0.f);
  for (int64_t k = 0; k < K; ++k) {
    Vec bk[NV];
    for (int v = 0; v < NV; ++v) bk[v] = load(b + k * ld + 8 * v);
    for (int i = 0; i < I; ++i) {
      const Vec x = splat(a(i, k));
      for (int v = 0; v < NV; ++v) acc[i][v] = fmadd(x, bk[v], acc[i][v]);
    }
  }
  for (int i = 0; i < I; ++i)
    for (int v = 0; v < NV; ++v) store(c + i * ld + 8 * v, acc[i][v]);
}

// Turns a tile's scores (n positions from first_pos) into weights against the running max,
// rescaling the sums and leaving the accumulators' correction. Lane i is the row at position
// row_pos + i, which sees position p in its lanes from p - row_pos on: the mask touches only a
// diagonal tile's positions.
void transposed_softmax(int n, int64_t first_pos, int64_t row_pos, PromptScratch& s) {
  const int64_t heads = static_cast<int64_t>(s.max.size()), M = heads * kChunkRows;
  const float inf = std::numeric_limits<float>::infinity();
  const auto masked_lanes = [&](int t) {
    return static_cast<int>(std::max<int64_t>(0, first_pos + t - row_pos));
  };
  for (int64_t g = 0; g < heads; ++g) {
    float* column = s.scores.data() + g * kChunkRows;
    Vec tile_max = splat(-inf);
    for (int t = 0; t < n; ++t)
      tile_max = max(tile_max, from_lane(load(column + t * M), masked_lanes(t), -inf));
    const Vec new_max = max(s.max[g], tile_max);
    s.correction[g] = exp_nonpositive(sub(s.max[g], new_max));  // 0 on the first tile
    s.max[g] = new_max;
    s.sum[g] = mul(s.sum[g], s.correction[g]);
    for (int t = 0; t < n; ++t) {
      const Vec p = exp_nonpositive(sub(load(column + t * M), new_max));
      const Vec weight = from_lane(p, masked_lanes(t), 0.f);
      s.sum[g] = add(s.sum[g], weight);
      store(column + t * M, weight);
    }
  }
}

// The tile's rows from the cursor as float32: in place for a float32 cache, else converted once
// into scratch (a broadcast element at a time would convert each element once per use).
template <typename kv_t>
void tile_rows(const kv_t* half, const int64_t* rows, int filled, int64_t D, float* scratch,
               const float** out) {
  for (int t = 0; t < filled; ++t) {
    if constexpr (std::is_same_v<kv_t, float>) {
      out[t] = half + rows[t];
    } else {
      float* row = scratch + t * D;
      for (int64_t d = 0; d < D; d += 8) store(row + d, load(half + rows[t] + d));
      out[t] = row;
    }
  }
}

// The chunk of n_rows query rows from row_pos on, for one KV head: query and out point at the
// first row's first query head of the group, keys and values at the KV head's place in a row.
template <typename kv_t>
void attend_chunk(const float* query, int64_t query_stride, const kv_t* keys, const kv_t* values,
                  const int32_t* block_table, int64_t row_pos, int n_rows, float scale,
                  float* out, int64_t out_stride, const Shape& shape, PromptScratch& s) {
  const int64_t G = shape.group(), D = shape.head_dim, M = G * kChunkRows;
  s.query_t.assign(D * M, 0.f);
  for (int i = 0; i < n_rows; ++i)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d)
        s.query_t[d * M + g * kChunkRows + i] = scale * query[i * query_stride + g * D + d];
  s.scores.resize(kPromptTile * M);
  s.acc_t.assign(D * M, 0.f);
  s.tile_rows.resize(2 * kPromptTile * D);
  s.max.assign(G, splat(-std::numeric_limits<float>::infinity()));
  s.sum.assign(G, splat(0.f));
  s.correction.resize(G);

  // the lanes past n_rows see every position the chunk's last row sees, and are not written
  const int64_t end = row_pos + n_rows;
  TileCursor cursor(block_table, end, shape);
  int64_t rows[kPromptTile];
  const float* key_rows[kPromptTile];
  const float* value_rows[kPromptTile];
  for (int64_t first_pos = 0; first_pos < end; first_pos += kPromptTile) {
    int n = 0;
    for (int got = kTile; got == kTile && n < kPromptTile; n += got) got = cursor.next(rows + n);
    // the cursor fills a tile of kTile rows past n with the last one: blocks of scores fit in
    const int filled = (n + kTile - 1) / kTile * kTile;
    tile_rows(keys, rows, filled, D, s.tile_rows.data(), key_rows);
    tile_rows(values, rows, n, D, s.tile_rows.data() + kPromptTile * D, value_rows);
    for (int t = 0; t < n; t += kProductRows)
      for_head_blocks(G, [&](int64_t g, auto nv) {
        const auto key = [&](int i, int64_t d) { return key_rows[t + i][d]; };
        broadcast_products<kProductRows, decltype(nv)::value>(
            key, D, s.query_t.data() + g * kChunkRows, M, nullptr,
            s.scores.data() + t * M + g * kChunkRows);
      });
    transposed_softmax(n, first_pos, row_pos, s);
    for (int64_t d = 0; d < D; d += kProductRows)
      for_head_blocks(G, [&](int64_t g, auto nv) {
        const auto value = [&](int i, int64_t t) { return value_rows[t][d + i]; };
        broadcast_products<kProductRows, decltype(nv)::value>(
            value, n, s.scores.data() + g * kChunkRows, M, s.correction.data() + g,
            s.acc_t.data() + d * M + g * kChunkRows);
      });
  }
  for (int64_t g = 0; g < G; ++g) store(s.scores.data() + g * kChunkRows, s.sum[g]);
  for (int i = 0; i < n_rows; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = g * kChunkRows + i;
      const float inv_sum = 1.f / s.scores[m];
      for (int64_t d = 0; d < D; ++d)
        out[i * out_stride + g * D + d] = s.acc_t[d * M + m] * inv_sum;
    }
}

// Work items are (request, KV head, chunk of kChunkRows query rows), in that order so that a
// thread's consecutive chunks reread one head's keys and values from its caches; a thread takes
// a part of about equal positions attended.
template <typename kv_t>
void attend_prompts(const at::Tensor& query, const at::Tensor& kv_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens,
                    const at::Tensor& query_starts, const at::Tensor& query_lens, float scale,
                    const at::Tensor& out, const Shape& s) {
  struct Item {
    int64_t request, kv_head, first_row;
  };
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* starts = query_starts.const_data_ptr<int32_t>();
  const int32_t* rows = query_lens.const_data_ptr<int32_t>();
  std::vector<Item> items;
  std::vector<int64_t> ends;
  int64_t total = 0;
  for (int64_t r = 0; r < s.num_reqs; ++r)
    for (int64_t h = 0; h < s.num_kv_heads; ++h)
      for (int64_t i = 0; i < rows[r]; i += kChunkRows) {
        items.push_back({r, h, i});
        const int64_t positions = lens[r] - rows[r] + std::min<int64_t>(i + kChunkRows, rows[r]);
        ends.push_back(total += positions + kPromptTile);
      }
  if (items.empty()) return;
  const float* q = query.const_data_ptr<float>();
  const kv_t* keys = kv_cache.const_data_ptr<kv_t>();
  const kv_t* values = keys + kv_cache.stride(0);
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  float* o = out.mutable_data_ptr<float>();
  const int64_t head_span = s.group() * s.head_dim;
  const int64_t threads = at::get_num_threads();
  const std::vector<int64_t> parts = split_by_cost(ends, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    PromptScratch scratch;
    for (int64_t index = parts[begin]; index < parts[end]; ++index) {
      const Item& item = items[index];
      const int64_t r = item.request, h = item.kv_head, row = starts[r] + item.first_row;
      attend_chunk(q + row * query.stride(0) + h * head_span, query.stride(0),
                   keys + h * s.head_dim, values + h * s.head_dim, tables + r * s.max_blocks,
                   lens[r] - rows[r] + item.first_row,
                   static_cast<int>(std::min<int64_t>(kChunkRows, rows[r] - item.first_row)),
                   scale, o + row * out.stride(0) + h * head_span, out.stride(0), s, scratch);
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

Shape check_inputs(const char* op, const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& out) {
  for (const at::Tensor* t : {&query, &kv_cache, &block_tables, &seq_lens, &out})
    TORCH_CHECK(t->device().is_cpu(), op, ": every tensor must be on the CPU");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "query must be float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "query and out must share a dtype");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() ||
                  kv_cache.scalar_type() == at::kBFloat16,
              "kv_cache must be of query's dtype, or bfloat16");
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
  TORCH_CHECK(s.head_dim % 8 == 0, "head_dim must be a multiple of 8");
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  check_contexts(block_tables, seq_lens, s, kv_cache.size(1));
  return s;
}

void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, const at::Tensor& out) {
  const Shape s = check_inputs("paged_decode_attention", query, kv_cache, block_tables, seq_lens,
                               out);
  using BF16 = c10::BFloat16;
  const bool bf16_query = query.scalar_type() == at::kBFloat16;
  const bool bf16_cache = kv_cache.scalar_type() == at::kBFloat16;
  if (bf16_query)
    attend_all<BF16, BF16>(query, kv_cache, block_tables, seq_lens, scale, out, s);
  else if (bf16_cache)
    attend_all<float, BF16>(query, kv_cache, block_tables, seq_lens, scale, out, s);
  else
    attend_all<float, float>(query, kv_cache, block_tables, seq_lens, scale, out, s);
}

// Request r's query rows are query_starts[r] .. + query_lens[r], the last of its seq_lens[r]
// positions.
void check_prompt_rows(const at::Tensor& query, const at::Tensor& seq_lens,
                       const at::Tensor& query_starts, const at::Tensor& query_lens) {
  for (const at::Tensor* t : {&query_starts, &query_lens})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->scalar_type() == at::kInt &&
                    t->is_contiguous() && t->size(0) == seq_lens.size(0),
                "query_starts and query_lens: contiguous int32 [num_reqs] on the CPU");
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* starts = query_starts.const_data_ptr<int32_t>();
  const int32_t* rows = query_lens.const_data_ptr<int32_t>();
  for (int64_t r = 0; r < seq_lens.size(0); ++r) {
    TORCH_CHECK(rows[r] >= 1 && rows[r] <= lens[r], "query_lens[", r, "] = ", rows[r],
                " is outside 1..seq_lens[", r, "] = ", lens[r]);
    TORCH_CHECK(starts[r] >= 0 && starts[r] + int64_t{rows[r]} <= query.size(0),
                "the rows of request ", r, " lie outside query");
  }
}

void paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_starts, const at::Tensor& query_lens,
                             double scale, const at::Tensor& out) {
  const Shape s = check_inputs("paged_prefill_attention", query, kv_cache, block_tables, seq_lens,
                               out);
  TORCH_CHECK(query.scalar_type() == at::kFloat, "paged_prefill_attention: query must be float32");
  check_prompt_rows(query, seq_lens, query_starts, query_lens);
  if (kv_cache.scalar_type() == at::kBFloat16)
    attend_prompts<c10::BFloat16>(query, kv_cache, block_tables, seq_lens, query_starts,
                                  query_lens, scale, out, s);
  else
    attend_prompts<float>(query, kv_cache, block_tables, seq_lens, query_starts, query_lens,
                          scale, out, s);
}

}  // namespace

TORCH_LIBRARY(asyncllm_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
  m.def(
      "paged_prefill_attention(Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_starts, Tensor query_lens, float scale, "
      "Tensor(a!) out) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
}
