/* Paged decode attention on the CPU, float32: one query token per request over its block table.
 *
 * Reference: kernels/cpu/paged_decode.py::paged_decode_reference (plain PyTorch, same function).
 * Layout: kv_cache [num_blocks, 2, block_size, num_kv_heads, head_dim] (0 = K, 1 = V),
 *         query / out [num_reqs, num_heads, head_dim] (token stride q_stride / out_stride),
 *         block_table [num_reqs, max_blocks] int32, seq_lens [num_reqs] int32.
 * Work item = one request (or, when there are fewer requests than threads, one kv head of a
 * request). An item streams its blocks once, K then V of each block (adjacent in memory, and the
 * next block is prefetched), with an online softmax: per block, scores of every query head,
 * running max and sum updated, accumulators rescaled. Reading whole contiguous blocks instead of
 * one kv head's strided slice measured 1.7x faster on 2 cores (decode is bound by KV reads).
 * Built with -ffast-math for vectorized expf; the running max starts at -FLT_MAX and the first
 * block sets the accumulators outright, so nothing depends on infinities.
 * Sliding window (window > 0): only the last `window` tokens are attended to, positions
 * max(0, len - window) .. len - 1; blocks before the first of them are never read (the cache
 * manager may have freed them and pointed their table entries at the null block).
 * Soft cap (softcap > 0): scores become softcap * tanhf(q.k * scale / softcap) (Gemma 2).
 * The two options only change where the block loop starts and add one pass over the scores.
 * Why C and not Triton: Triton runs on CPUs only in its interpreter; this is the CPU fast path.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEADS 128
#define MAX_DIM 256
#define MAX_BLOCK 64

int paged_decode_max_heads(void) { return MAX_HEADS; }
int paged_decode_max_dim(void) { return MAX_DIM; }
int paged_decode_max_block(void) { return MAX_BLOCK; }

/* Attention of query heads [h0, h1) of request b (all sharing kv heads h0/group..). */
static void attend(const float *q, const float *kv_cache, const int32_t *blocks, int64_t len,
                   float *o, int64_t h0, int64_t h1, int64_t group, int64_t row,
                   int64_t head_dim, int64_t block_size, float scale, int64_t window,
                   float softcap) {
  float acc[MAX_HEADS * MAX_DIM];
  float m[MAX_HEADS], l[MAX_HEADS];
  float s[MAX_HEADS * MAX_BLOCK];
  const int64_t nh = h1 - h0;
  const int64_t block_stride = 2 * block_size * row;
  for (int64_t h = 0; h < nh; ++h) { m[h] = -FLT_MAX; l[h] = 0.f; }
  memset(acc, 0, sizeof(float) * (size_t)(nh * head_dim));
  const int64_t nblk = (len + block_size - 1) / block_size;
  const int64_t first = window > 0 && len > window ? len - window : 0; /* first attended token */
  const int64_t j0 = first / block_size;
  const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;
  for (int64_t j = j0; j < nblk; ++j) {
    const float *kb = kv_cache + (int64_t)blocks[j] * block_stride;
    const float *vb = kb + block_size * row;
    const int64_t n = (j + 1) * block_size <= len ? block_size : len - j * block_size;
    const int64_t t0 = j == j0 ? first - j * block_size : 0; /* window start inside the block */
    if (j + 1 < nblk) {
      const char *next = (const char *)(kv_cache + (int64_t)blocks[j + 1] * block_stride);
      const int64_t bytes = block_stride * (int64_t)sizeof(float);
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(next + off, 0, 3);
    }
    for (int64_t t = t0; t < n; ++t) {
      const float *k = kb + t * row;
      for (int64_t h = 0; h < nh; ++h) {
        const float *kk = k + ((h0 + h) / group) * head_dim;
        const float *qq = q + (h0 + h) * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < head_dim; ++i) dot += qq[i] * kk[i];
        s[h * MAX_BLOCK + t] = dot * scale;
      }
    }
    for (int64_t h = 0; h < nh; ++h) {
      float *sh = s + h * MAX_BLOCK;
      float mx = m[h];
      if (softcap > 0.f)
        for (int64_t t = t0; t < n; ++t) sh[t] = softcap * tanhf(sh[t] * inv_cap);
      for (int64_t t = t0; t < n; ++t) mx = sh[t] > mx ? sh[t] : mx;
      const float corr = j == j0 ? 0.f : expf(m[h] - mx);
      float sum = 0.f;
      for (int64_t t = t0; t < n; ++t) { sh[t] = expf(sh[t] - mx); sum += sh[t]; }
      l[h] = l[h] * corr + sum;
      m[h] = mx;
      if (j > j0 && corr != 1.f) {
        float *a = acc + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) a[i] *= corr;
      }
    }
    for (int64_t t = t0; t < n; ++t) {
      const float *v = vb + t * row;
      for (int64_t h = 0; h < nh; ++h) {
        const float *vv = v + ((h0 + h) / group) * head_dim;
        float *a = acc + h * head_dim;
        const float p = s[h * MAX_BLOCK + t];
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) a[i] += p * vv[i];
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    float *oo = o + (h0 + h) * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) oo[i] = acc[h * head_dim + i] * inv;
  }
}

/* Returns 0, or 2 when a size is over the MAX_* limits (the Python wrapper checks first).
 * window: sliding window in tokens, 0 = none; softcap: logit soft cap, 0 = none. */
int paged_decode_f32(const float *query, int64_t q_stride, const float *kv_cache,
                     const int32_t *block_table, const int32_t *seq_lens, float *out,
                     int64_t out_stride, int64_t num_reqs, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                     int64_t max_blocks, float scale, int64_t window, float softcap,
                     int num_threads) {
  if (num_heads > MAX_HEADS || head_dim > MAX_DIM || block_size > MAX_BLOCK) return 2;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim; /* one token's K (or V), all kv heads */
  const int64_t splits = num_reqs >= num_threads ? 1 : num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t item = 0; item < num_reqs * splits; ++item) {
    const int64_t b = item / splits, c = item % splits;
    const int64_t per = num_heads / splits;
    attend(query + b * q_stride, kv_cache, block_table + b * max_blocks, seq_lens[b],
           out + b * out_stride, c * per, (c + 1) * per, group, row, head_dim, block_size, scale,
           window, softcap);
  }
  return 0;
}
