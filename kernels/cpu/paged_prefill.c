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
 * rows walk the keys in chunks of 16 tokens. Per chunk: the 16 scores of a row are one vector
 * (q.k on vdpbf16ps: bf16 products are exact, sums in float32; 16 dot products summed across
 * lanes by one transpose-add tree), an online softmax updates the row's max and sum, and the
 * row's float32 accumulator takes p . V with V widened once per chunk for all rows. The
 * diagonal chunk is masked per row; chunks after a row's position are skipped.
 * Requires AVX-512 with AVX512-BF16, head_dim a multiple of 32 up to 256 and block_size a
 * multiple of 16; paged_prefill_supported() says whether this build has it (else the Python
 * side keeps SDPA). Built with -ffast-math for vectorized expf; masked scores are -1e30, never
 * infinities; a row's first chunk (keys 0..15) always holds an unmasked key.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include "simd_math.h"
#define PF_OK 1
#else
#define PF_OK 0
#endif

#define QT 16          /* query tokens per work item */
#define MAX_ROWS 128   /* QT x group rows at most (a larger group takes fewer tokens per tile) */
#define MAX_D 256
#define CHUNK 16

int paged_prefill_supported(int64_t head_dim, int64_t block_size) {
  return PF_OK && head_dim % 32 == 0 && head_dim <= MAX_D && block_size % CHUNK == 0;
}

#if PF_OK
static inline __m512 pf_sum16(__m512 *p) { /* lane t = sum of p[t]'s lanes */
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                         _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

static inline __m512 widen16(const uint16_t *p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The 16 scores (unscaled) of query row qr against the chunk's keys kb (token stride row_elems),
 * nb = head_dim / 32 bf16 vectors per row; inlined with a constant nb. Keys past the sequence's
 * end read whatever their block holds; the caller masks those lanes. */
static inline __attribute__((always_inline)) __m512 scores(const uint16_t *qr, const uint16_t *kb,
                                                          int64_t row_elems, int nb) {
  __m512bh qb[8];
  for (int v = 0; v < nb; ++v) qb[v] = (__m512bh)_mm512_loadu_si512(qr + 32 * v);
  __m512 part[CHUNK];
  for (int t = 0; t < CHUNK; ++t) {
    const uint16_t *kt = kb + t * row_elems;
    __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[0], (__m512bh)_mm512_loadu_si512(kt));
    for (int v = 1; v < nb; ++v)
      d = _mm512_dpbf16_ps(d, qb[v], (__m512bh)_mm512_loadu_si512(kt + 32 * v));
    part[t] = d;
  }
  return pf_sum16(part);
}

/* Rows r = token i * group + g of tile [t0, t0 + nt) of one request, kv head kvh. */
static void tile(const uint16_t *query, int64_t q_stride, const uint16_t *kv, const int32_t *blocks,
                 int64_t first_pos, int64_t t0, int64_t nt, int64_t kvh, int64_t group,
                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                 uint16_t *out, int64_t out_stride) {
  const int64_t D = head_dim, NB = head_dim / 32, NV = head_dim / 16; /* NB: 1..8 */
  const int64_t row_elems = num_kv_heads * head_dim; /* one token's K (or V), all kv heads */
  const int64_t block_stride = 2 * block_size * row_elems;
  const int64_t rows = nt * group;
  float acc[MAX_ROWS * MAX_D] __attribute__((aligned(64)));
  float m[MAX_ROWS], l[MAX_ROWS];
  float vbuf[CHUNK * MAX_D] __attribute__((aligned(64)));
  float p[CHUNK] __attribute__((aligned(64)));
  memset(acc, 0, sizeof(float) * (size_t)(rows * D));
  for (int64_t r = 0; r < rows; ++r) { m[r] = -1e30f; l[r] = 0.f; }
  const int64_t last_pos = first_pos + t0 + nt - 1; /* the tile's last query position */
  const int64_t nchunks = last_pos / CHUNK + 1;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t c0 = c * CHUNK;
    const int64_t blk = c0 / block_size, off = c0 % block_size;
    const uint16_t *kb = kv + (int64_t)blocks[blk] * block_stride + off * row_elems + kvh * D;
    const uint16_t *vb = kb + block_size * row_elems;
    const int64_t valid = last_pos - c0 + 1 < CHUNK ? last_pos - c0 + 1 : CHUNK; /* keys to read */
    for (int64_t t = 0; t < CHUNK; ++t)
      for (int64_t v = 0; v < NV; ++v)
        _mm512_store_ps(vbuf + t * D + 16 * v,
                        t < valid ? widen16(vb + t * row_elems + 16 * v) : _mm512_setzero_ps());
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r / group, g = r % group;
      const int64_t pos = first_pos + t0 + i;
      if (pos < c0) continue; /* every key of this chunk is after the row's position */
      const uint16_t *qr = query + (t0 + i) * q_stride + (kvh * group + g) * D;
      const int64_t n = pos - c0 + 1 < CHUNK ? pos - c0 + 1 : CHUNK; /* keys this row sees */
      __m512 s;
      switch (NB) { /* a constant trip count per head_dim keeps the 16 partial sums in registers */
        case 1: s = scores(qr, kb, row_elems, 1); break;
        case 2: s = scores(qr, kb, row_elems, 2); break;
        case 3: s = scores(qr, kb, row_elems, 3); break;
        case 4: s = scores(qr, kb, row_elems, 4); break;
        case 5: s = scores(qr, kb, row_elems, 5); break;
        case 6: s = scores(qr, kb, row_elems, 6); break;
        case 7: s = scores(qr, kb, row_elems, 7); break;
        default: s = scores(qr, kb, row_elems, 8); break;
      }
      s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
      /* Keys after the row's position (and, past the sequence's end, whatever the block holds)
       * are masked: their scores never reach the max, and their weights are exactly 0. */
      const __mmask16 live = n < CHUNK ? (__mmask16)((1u << n) - 1u) : (__mmask16)0xffff;
      s = _mm512_mask_blend_ps(live, _mm512_set1_ps(-1e30f), s);
      const float mx_chunk = _mm512_reduce_max_ps(s);
      const float mx = mx_chunk > m[r] ? mx_chunk : m[r];
      const float corr = mx > m[r] ? _mm512_cvtss_f32(exp512(_mm512_set1_ps(m[r] - mx))) : 1.f;
      const __m512 pv = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
      _mm512_store_ps(p, pv);
      l[r] = l[r] * corr + _mm512_reduce_add_ps(pv);
      m[r] = mx;
      float *a = acc + r * D;
      const __m512 cv = _mm512_set1_ps(corr);
      for (int64_t v0 = 0; v0 < NV; v0 += 4) { /* 4 accumulator vectors at a time in registers */
        const int64_t nv = NV - v0 < 4 ? NV - v0 : 4;
        if (nv == 4) {
          __m512 a0 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0), cv);
          __m512 a1 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0 + 16), cv);
          __m512 a2 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0 + 32), cv);
          __m512 a3 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0 + 48), cv);
          for (int t = 0; t < CHUNK; ++t) { /* masked keys: weight 0 and zeroed or real values */
            const __m512 pt = _mm512_set1_ps(p[t]);
            const float *vt = vbuf + t * D + 16 * v0;
            a0 = _mm512_fmadd_ps(pt, _mm512_load_ps(vt), a0);
            a1 = _mm512_fmadd_ps(pt, _mm512_load_ps(vt + 16), a1);
            a2 = _mm512_fmadd_ps(pt, _mm512_load_ps(vt + 32), a2);
            a3 = _mm512_fmadd_ps(pt, _mm512_load_ps(vt + 48), a3);
          }
          _mm512_store_ps(a + 16 * v0, a0);
          _mm512_store_ps(a + 16 * v0 + 16, a1);
          _mm512_store_ps(a + 16 * v0 + 32, a2);
          _mm512_store_ps(a + 16 * v0 + 48, a3);
        } else {
          for (int64_t v = 0; v < nv; ++v) {
            __m512 av = _mm512_mul_ps(_mm512_load_ps(a + 16 * (v0 + v)), cv);
            for (int t = 0; t < CHUNK; ++t)
              av = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_load_ps(vbuf + t * D + 16 * (v0 + v)), av);
            _mm512_store_ps(a + 16 * (v0 + v), av);
          }
        }
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
 * query and out. */
int paged_prefill(const uint16_t *query, int64_t q_stride, const uint16_t *kv_cache,
                  const int32_t *block_table, int64_t max_blocks, const int64_t *q_start,
                  const int64_t *q_len, const int64_t *seq_len, int64_t num_reqs, uint16_t *out,
                  int64_t out_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                  int64_t block_size, float scale, int num_threads) {
  if (!paged_prefill_supported(head_dim, block_size)) return 2;
#if PF_OK
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
    tile(query + q_start[k] * q_stride, q_stride, kv_cache, block_table + k * max_blocks,
         seq_len[k] - q_len[k], t0, nt, kvh, group, num_kv_heads, head_dim, block_size, scale,
         out + q_start[k] * out_stride, out_stride);
  }
  return 0;
#else
  (void)query; (void)q_stride; (void)kv_cache; (void)block_table; (void)max_blocks;
  (void)q_start; (void)q_len; (void)seq_len; (void)num_reqs; (void)out; (void)out_stride;
  (void)num_heads; (void)num_kv_heads; (void)scale; (void)num_threads;
  return 2;
#endif
}
