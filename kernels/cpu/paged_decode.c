/* Paged decode attention on the CPU, float32: one query token per request over its block table.
 *
 * Reference: kernels/cpu/paged_decode.py::paged_decode_reference (plain PyTorch, same function).
 * Layout: kv_cache [num_blocks, 2, block_size, num_kv_heads, head_dim] (0 = K, 1 = V),
 *         query / out [num_reqs, num_heads, head_dim] (token stride q_stride / out_stride),
 *         block_table [num_reqs, max_blocks] int32, seq_lens [num_reqs] int32.
 * Work item = (request, kv head): its `group` query heads share one pass over the context, so
 * every K/V row is read from memory once. Scores are kept for the whole context (two passes:
 * scores, then softmax-weighted V), which is exact and cheap for CPU context lengths.
 * Why C and not Triton: Triton runs on CPUs only in its interpreter; this is the CPU fast path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

static inline void axpy(float *y, float w, const float *x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

int paged_decode_f32(const float *query, int64_t q_stride, const float *kv_cache,
                     const int32_t *block_table, const int32_t *seq_lens, float *out,
                     int64_t out_stride, int64_t num_reqs, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                     int64_t max_blocks, float scale, int num_threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim;      /* one token's K (or V), all heads */
  const int64_t block_stride = 2 * block_size * row; /* one block, K and V */
  int failed = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t b = 0; b < num_reqs; ++b) {
    for (int64_t kh = 0; kh < num_kv_heads; ++kh) {
      const int64_t len = seq_lens[b];
      const int32_t *blocks = block_table + b * max_blocks;
      const float *q = query + b * q_stride + kh * group * head_dim;
      float *o = out + b * out_stride + kh * group * head_dim;
      float *scores = (float *)malloc(sizeof(float) * (size_t)(group * (len > 0 ? len : 1)));
      if (scores == NULL) { failed = 1; continue; }
      for (int64_t t = 0; t < len; ++t) {
        const float *k = kv_cache + blocks[t / block_size] * block_stride +
                         (t % block_size) * row + kh * head_dim;
        for (int64_t g = 0; g < group; ++g)
          scores[g * len + t] = dot(q + g * head_dim, k, head_dim) * scale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float *s = scores + g * len;
        float m = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < len; ++t) { s[t] = expf(s[t] - m); sum += s[t]; }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
        memset(o + g * head_dim, 0, sizeof(float) * (size_t)head_dim);
      }
      for (int64_t t = 0; t < len; ++t) {
        const float *v = kv_cache + blocks[t / block_size] * block_stride + block_size * row +
                         (t % block_size) * row + kh * head_dim;
        for (int64_t g = 0; g < group; ++g) axpy(o + g * head_dim, scores[g * len + t], v, head_dim);
      }
      free(scores);
    }
  }
  return failed;
}
