/* Paged causal prefill attention on the CPU for bfloat16 models: every multi-token request of a
 * step (a fresh prompt or a chunk after cached context) attends over its cached keys 0..pos for
 * each of its query tokens, reading K and V straight from the paged cache (the step's new K/V
 * are written to the cache before attention runs).
 *
 * Reference: kernels/cpu/paged_prefill.py::paged_prefill_reference (plain PyTorch, the same
 * function: softmax(q K^T * scale + causal mask) V per request, GQA-aware).
 * Layout: query / out [tokens, num_heads, head_dim] bf16 (token strides q_stride / out_stride),
 *         kv_cache [num_blocks, 2, block_size, num_kv_heads, head_dim] bf16,
 *         block_table [num_reqs, max_blocks] int32; per request: q_start (first row of its
 *         queries), q_len, seq_len (its queries are positions seq_len - q_len .. seq_len - 1).
 * Work item = one kv head of one tile of QT query tokens of one request: its QT x group query
 * rows walk the keys in chunks of 32 tokens. Per chunk, staged once for all the tile's rows:
 * K transposed into bf16 pairs (lane = key) and V interleaved into pairs of keys (lane =
 * element). Then, four rows at a time, q.k is one vdpbf16ps per query pair and 16 keys (the
 * row's pair broadcast; bf16 products are exact, sums in float32), with no reduction across
 * lanes; an online softmax updates each row's max and sum; and p . V is one vdpbf16ps per pair
 * of keys and 16 elements, with the weights rounded to bf16 (PyTorch's bf16 flash attention on
 * CPU rounds them the same way for its p . V GEMM) into float32 accumulators. The diagonal
 * chunk is masked per row; chunks after a row's position are skipped. 1.6-1.7x the previous
 * row-at-a-time kernel (q.k summed across lanes by a transpose tree, p . V in float32 FMAs).
 * Requires AVX-512 with AVX512-BF16, head_dim a multiple of 32 up to 256 and block_size a
 * multiple of 16; paged_prefill_supported() says whether this build has it (else the Python
 * side keeps SDPA). float32 models take paged_prefill_f32.h's tile (AVX-512F, head_dim a
 * multiple of 16), same work items. Built with -ffast-math for vectorized expf; masked scores are -1e30, never
 * infinities; a row's first chunk (keys 0..31) always holds an unmasked key.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#include "simd_math.h"
#define PF_F32_OK 1
#else
#define PF_F32_OK 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PF_OK 1
#else
#define PF_OK 0
#endif

#define QT 16          /* query tokens per work item */
#define MAX_ROWS 128   /* QT x group rows at most (a larger group takes fewer tokens per tile) */
#define MAX_D 256
#define CHUNK 32      /* keys per step of the online softmax: two 16-lane score vectors */

/* f32 = 1: the float32 tile (AVX-512F, head_dim a multiple of 16); else the bf16 one. */
int paged_prefill_supported(int64_t head_dim, int64_t block_size, int f32) {
  if (f32) return PF_F32_OK && head_dim % 16 == 0 && head_dim <= MAX_D && block_size >= 1;
  return PF_OK && head_dim % 32 == 0 && head_dim <= MAX_D && block_size % 16 == 0;
}

#if PF_F32_OK
static inline __mmask16 first_lanes(int64_t n) { /* lanes 0 .. n - 1 of 16 */
  return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* The online-softmax step of one row over a 32-key chunk, shared by both tiles: scores s0
 * (keys 0..15) and s1 (16..31), unscaled, of which keys n and after are masked (keys after the
 * row's position and, past the sequence's end, whatever the block holds: their scores never
 * reach the max and their weights are exactly 0). Updates the row's max m and sum l; the
 * weights come back in p0 / p1 and the factor the accumulator is to be scaled by in *corr. */
static inline __attribute__((always_inline)) void softmax_step(__m512 s0, __m512 s1, int64_t n,
                                                               float scale, float *m, float *l,
                                                               __m512 *p0, __m512 *p1, float *corr) {
  const __mmask16 live0 = first_lanes(n), live1 = first_lanes(n - 16);
  const __m512 sc = _mm512_set1_ps(scale), masked = _mm512_set1_ps(-1e30f);
  s0 = _mm512_mask_blend_ps(live0, masked, _mm512_mul_ps(s0, sc));
  s1 = _mm512_mask_blend_ps(live1, masked, _mm512_mul_ps(s1, sc));
  const float mx_chunk = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
  const float mx = mx_chunk > *m ? mx_chunk : *m;
  *corr = mx > *m ? _mm512_cvtss_f32(exp512(_mm512_set1_ps(*m - mx))) : 1.f;
  const __m512 mv = _mm512_set1_ps(mx);
  *p0 = _mm512_maskz_mov_ps(live0, exp512(_mm512_sub_ps(s0, mv)));
  *p1 = _mm512_maskz_mov_ps(live1, exp512(_mm512_sub_ps(s1, mv)));
  *l = *l * *corr + _mm512_reduce_add_ps(_mm512_add_ps(*p0, *p1));
  *m = mx;
}
#include "paged_prefill_f32.h"
#endif

#if PF_OK
/* Token t of the chunk starting at key c0: its K row (kv head kvh) in the paged cache; its V row
 * is block_size rows further. */
static inline const uint16_t *key_row(const uint16_t *kv, const int32_t *blocks, int64_t c0,
                                      int64_t t, int64_t block_size, int64_t block_stride,
                                      int64_t row_elems, int64_t kvh, int64_t D) {
  const int64_t pos = c0 + t;
  return kv + (int64_t)blocks[pos / block_size] * block_stride + (pos % block_size) * row_elems +
         kvh * D;
}

/* The chunk's keys in pair-interleaved order for vdpbf16ps with keys in lanes: kt[p * CHUNK + t]
 * holds key t's elements 2p and 2p + 1 (one 32-bit word). Keys at or past `valid` are zero. */
static inline void stage_keys(const uint16_t *const *krow, int64_t valid, int64_t np, uint32_t *kt) {
  for (int64_t t = 0; t < CHUNK; ++t) {
    if (t < valid) {
      const uint32_t *src = (const uint32_t *)krow[t];
      for (int64_t p = 0; p < np; ++p) kt[p * CHUNK + t] = src[p];
    } else {
      for (int64_t p = 0; p < np; ++p) kt[p * CHUNK + t] = 0u;
    }
  }
}

/* The chunk's values in pair-interleaved order for vdpbf16ps with dimensions in lanes:
 * vp[j * D + d] holds element d of keys 2j and 2j + 1 (one 32-bit word). Keys at or past
 * `valid` are zero. */
static inline void stage_values(const uint16_t *const *vrow, int64_t valid, int64_t D,
                                uint32_t *vp) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                      55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int64_t j = 0; j < CHUNK / 2; ++j) {
    for (int64_t h = 0; h < D; h += 32) {
      const __m512i a = 2 * j < valid ? _mm512_loadu_si512(vrow[2 * j] + h) : _mm512_setzero_si512();
      const __m512i b = 2 * j + 1 < valid ? _mm512_loadu_si512(vrow[2 * j + 1] + h)
                                          : _mm512_setzero_si512();
      _mm512_store_si512(vp + j * D + h, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(vp + j * D + h + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

/* Unscaled scores of R query rows (pointers qr[0..R-1]) against the chunk's staged keys: lane t
 * of s[2i + h] is row i's q . k for key 16h + t. Each key vector is loaded once for the R rows;
 * each row's query pair is broadcast. Inlined with constant R. */
static inline __attribute__((always_inline)) void scores_rows(const uint16_t *const *qr,
                                                              const uint32_t *kt, int64_t np,
                                                              int R, __m512 *s) {
  for (int i = 0; i < 2 * R; ++i) s[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + p * CHUNK);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + p * CHUNK + 16);
    for (int i = 0; i < R; ++i) {
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(((const int32_t *)qr[i])[p]);
      s[2 * i] = _mm512_dpbf16_ps(s[2 * i], qp, k0);
      s[2 * i + 1] = _mm512_dpbf16_ps(s[2 * i + 1], qp, k1);
    }
  }
}

/* Online-softmax update of one row with the chunk's scores (softmax_step), then its p . V into
 * the row's float32 accumulator a. The weights enter p . V rounded to bf16 (as PyTorch's bf16
 * flash attention on CPU feeds its p . V GEMM), summed in float32; l sums them unrounded. */
static inline __attribute__((always_inline)) void update_row(
    __m512 s0, __m512 s1, int64_t n, float scale, float *m, float *l, float *a, const uint32_t *vp,
    int64_t NV, int64_t D) {
  uint32_t p2[CHUNK / 2] __attribute__((aligned(64)));
  __m512 p0, p1;
  float corr;
  softmax_step(s0, s1, n, scale, m, l, &p0, &p1, &corr);
  _mm512_store_si512(p2, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  const int64_t pairs = n >= CHUNK ? CHUNK / 2 : (n + 1) / 2; /* pairs past the row's keys: 0 */
  const __m512 cv = _mm512_set1_ps(corr);
  for (int64_t v0 = 0; v0 < NV; v0 += 4) { /* 4 accumulator vectors at a time in registers */
    const int64_t nv = NV - v0 < 4 ? NV - v0 : 4;
    if (nv == 4) {
      __m512 a0 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0), cv);
      __m512 a1 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0 + 16), cv);
      __m512 a2 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0 + 32), cv);
      __m512 a3 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0 + 48), cv);
      for (int64_t j = 0; j < pairs; ++j) {
        const __m512bh pj = (__m512bh)_mm512_set1_epi32((int32_t)p2[j]);
        const uint32_t *vj = vp + j * D + 16 * v0;
        a0 = _mm512_dpbf16_ps(a0, pj, (__m512bh)_mm512_load_si512(vj));
        a1 = _mm512_dpbf16_ps(a1, pj, (__m512bh)_mm512_load_si512(vj + 16));
        a2 = _mm512_dpbf16_ps(a2, pj, (__m512bh)_mm512_load_si512(vj + 32));
        a3 = _mm512_dpbf16_ps(a3, pj, (__m512bh)_mm512_load_si512(vj + 48));
      }
      _mm512_store_ps(a + 16 * v0, a0);
      _mm512_store_ps(a + 16 * v0 + 16, a1);
      _mm512_store_ps(a + 16 * v0 + 32, a2);
      _mm512_store_ps(a + 16 * v0 + 48, a3);
    } else {
      for (int64_t v = 0; v < nv; ++v) {
        __m512 av = _mm512_mul_ps(_mm512_load_ps(a + 16 * (v0 + v)), cv);
        for (int64_t j = 0; j < pairs; ++j)
          av = _mm512_dpbf16_ps(av, (__m512bh)_mm512_set1_epi32((int32_t)p2[j]),
                                (__m512bh)_mm512_load_si512(vp + j * D + 16 * (v0 + v)));
        _mm512_store_ps(a + 16 * (v0 + v), av);
      }
    }
  }
}

/* Rows r = token i * group + g of tile [t0, t0 + nt) of one request, kv head kvh. */
static void tile(const uint16_t *query, int64_t q_stride, const uint16_t *kv, const int32_t *blocks,
                 int64_t first_pos, int64_t t0, int64_t nt, int64_t kvh, int64_t group,
                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                 uint16_t *out, int64_t out_stride) {
  const int64_t D = head_dim, NP = head_dim / 2, NV = head_dim / 16;
  const int64_t row_elems = num_kv_heads * head_dim; /* one token's K (or V), all kv heads */
  const int64_t block_stride = 2 * block_size * row_elems;
  const int64_t rows = nt * group;
  float acc[MAX_ROWS * MAX_D] __attribute__((aligned(64)));
  float m[MAX_ROWS], l[MAX_ROWS];
  uint32_t vp[CHUNK / 2 * MAX_D] __attribute__((aligned(64)));
  uint32_t kt[MAX_D / 2 * CHUNK] __attribute__((aligned(64)));
  const uint16_t *qrow[MAX_ROWS], *krow[CHUNK], *vrow[CHUNK];
  int64_t qpos[MAX_ROWS];
  memset(acc, 0, sizeof(float) * (size_t)(rows * D));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group, g = r % group;
    m[r] = -1e30f;
    l[r] = 0.f;
    qrow[r] = query + (t0 + i) * q_stride + (kvh * group + g) * D;
    qpos[r] = first_pos + t0 + i;
  }
  const int64_t last_pos = first_pos + t0 + nt - 1; /* the tile's last query position */
  const int64_t nchunks = last_pos / CHUNK + 1;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t c0 = c * CHUNK;
    const int64_t valid = last_pos - c0 + 1 < CHUNK ? last_pos - c0 + 1 : CHUNK; /* keys to read */
    for (int64_t t = 0; t < valid; ++t) {
      krow[t] = key_row(kv, blocks, c0, t, block_size, block_stride, row_elems, kvh, D);
      vrow[t] = krow[t] + block_size * row_elems;
    }
    stage_keys(krow, valid, NP, kt);
    stage_values(vrow, valid, D, vp);
    /* Rows before the first that sees this chunk are skipped (positions grow with r). */
    int64_t r = 0;
    while (r < rows && qpos[r] < c0) ++r;
    for (; r < rows; r += 4) {
      const int R = rows - r < 4 ? (int)(rows - r) : 4;
      __m512 s[8];
      switch (R) { /* constant row counts keep the scores in registers */
        case 4: scores_rows(qrow + r, kt, NP, 4, s); break;
        case 3: scores_rows(qrow + r, kt, NP, 3, s); break;
        case 2: scores_rows(qrow + r, kt, NP, 2, s); break;
        default: scores_rows(qrow + r, kt, NP, 1, s); break;
      }
      for (int i = 0; i < R; ++i) {
        const int64_t n = qpos[r + i] - c0 + 1 < CHUNK ? qpos[r + i] - c0 + 1 : CHUNK;
        update_row(s[2 * i], s[2 * i + 1], n, scale, m + r + i, l + r + i, acc + (r + i) * D, vp,
                   NV, D);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group, g = r % group;
    uint16_t *o = out + (t0 + i) * out_stride + (kvh * group + g) * D;
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int64_t v = 0; v < NV; ++v)
      _mm256_storeu_si256((__m256i *)(o + 16 * v),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + r * D + 16 * v), inv)));
  }
}
#endif

/* Returns 0, or 2 when this build or these sizes are not supported (check first). Request k
 * uses row k of block_table; its queries are rows q_start[k] .. q_start[k] + q_len[k] - 1 of
 * query and out. f32 = 1: query, cache and out are float32, else bf16. */
int paged_prefill(const void *query, int64_t q_stride, const void *kv_cache,
                  const int32_t *block_table, int64_t max_blocks, const int64_t *q_start,
                  const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, void *out,
                  int64_t out_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                  int64_t block_size, float scale, int num_threads, int f32) {
  if (!paged_prefill_supported(head_dim, block_size, f32)) return 2;
#if PF_F32_OK
  const int64_t group = num_heads / num_kv_heads;
  if (group > MAX_ROWS) return 2;
  const int64_t qt = group * QT <= MAX_ROWS ? QT : MAX_ROWS / group;
  /* Work items: (request, tile, kv head), longest tiles first so the threads end together. */
  int64_t total = 0;
  for (int64_t k = 0; k < num_reqs; ++k) total += (q_len[k] + qt - 1) / qt * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t item = 0; item < total; ++item) {
    int64_t k = 0, rest = item;
    for (; k < num_reqs; ++k) {
      const int64_t n = (q_len[k] + qt - 1) / qt * num_kv_heads;
      if (rest < n) break;
      rest -= n;
    }
    const int64_t tiles = (q_len[k] + qt - 1) / qt;
    const int64_t tile_id = tiles - 1 - rest / num_kv_heads, kvh = rest % num_kv_heads;
    const int64_t t0 = tile_id * qt;
    const int64_t nt = q_len[k] - t0 < qt ? q_len[k] - t0 : qt;
    const int64_t first_pos = seq_len[k] - q_len[k];
    if (f32)
      tile_f32((const float *)query + q_start[k] * q_stride, q_stride, (const float *)kv_cache,
               block_table + k * max_blocks, first_pos, t0, nt, kvh, group, num_kv_heads, head_dim,
               block_size, scale, (float *)out + q_start[k] * out_stride, out_stride);
#if PF_OK
    else
      tile((const uint16_t *)query + q_start[k] * q_stride, q_stride, (const uint16_t *)kv_cache,
           block_table + k * max_blocks, first_pos, t0, nt, kvh, group, num_kv_heads, head_dim,
           block_size, scale, (uint16_t *)out + q_start[k] * out_stride, out_stride);
#endif
  }
  return 0;
#else
  (void)query; (void)q_stride; (void)kv_cache; (void)block_table; (void)max_blocks;
  (void)q_start; (void)q_len; (void)seq_len; (void)num_reqs; (void)out; (void)out_stride;
  (void)num_heads; (void)num_kv_heads; (void)scale; (void)num_threads;
  return 2;
#endif
}
