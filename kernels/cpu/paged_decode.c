/* Paged decode attention on the CPU: one query token per request over its block table, the KV
 * cache in float32 or bfloat16 (widened to float32 as it is read; all arithmetic in float32).
 *
 * Reference: kernels/cpu/paged_decode.py::paged_decode_reference (plain PyTorch, same function).
 * Bodies: paged_decode_avx512.h (AVX-512, head_dim 16..256 in powers of two; with a bf16 cache
 * and AVX512-BF16, q.k runs on vdpbf16ps with the query rounded to bf16, which a bf16 model's
 * query already is) and paged_decode_attend.h (portable, every other case).
 * The loop itself is paged_decode_attend.h, included once per cache element type.
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
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_HEADS 128
#define MAX_DIM 256
#define MAX_BLOCK 64

int paged_decode_max_heads(void) { return MAX_HEADS; }
int paged_decode_max_dim(void) { return MAX_DIM; }
int paged_decode_max_block(void) { return MAX_BLOCK; }

/* bfloat16 is the top half of a float32: widen by a 16-bit shift (vectorizes to a zero-extend
 * and a shift under -march=native). */
static inline float bf16_to_f32(uint16_t x) {
  union { uint32_t u; float f; } c;
  c.u = (uint32_t)x << 16;
  return c.f;
}

#define NAME attend_f32
#define KV_T float
#define LOAD(p, i) ((p)[i])
#include "paged_decode_attend.h"
#undef NAME
#undef KV_T
#undef LOAD

#define NAME attend_bf16
#define KV_T uint16_t
#define LOAD(p, i) bf16_to_f32((p)[i])
#include "paged_decode_attend.h"
#undef NAME
#undef KV_T
#undef LOAD

#ifdef __AVX512F__
/* Vectorized bodies for head_dim = 16, 32, 64, 128, 256 (paged_decode_avx512.h). */
#define LOADV_F32(p) _mm512_loadu_ps(p)
#define LOADV_BF16(p) \
  _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define KV_T float
#define LOADV LOADV_F32
#define QK_DPBF16 0
#define NV 1
#define NAME vec_f32_1
#include "paged_decode_avx512.h"
#undef NAME
#undef NV
#define NV 2
#define NAME vec_f32_2
#include "paged_decode_avx512.h"
#undef NAME
#undef NV
#define NV 4
#define NAME vec_f32_4
#include "paged_decode_avx512.h"
#undef NAME
#undef NV
#define NV 8
#define NAME vec_f32_8
#include "paged_decode_avx512.h"
#undef NAME
#undef NV
#define NV 16
#define NAME vec_f32_16
#include "paged_decode_avx512.h"
#undef NAME
#undef NV
#undef KV_T
#undef LOADV
#undef QK_DPBF16
#define KV_T uint16_t
#define LOADV LOADV_BF16
#define QK_DPBF16 0 /* head_dim 16 widens K; the others take q.k with vdpbf16ps where present */
#define NV 1
#define NAME vec_bf16_1
#include "paged_decode_avx512.h"
#undef NAME
#undef NV
#undef QK_DPBF16
#ifdef __AVX512BF16__
#define QK_DPBF16 1
#else
#define QK_DPBF16 0
#endif
#define NV 2
#define NAME vec_bf16_2
#include "paged_decode_avx512.h"
#undef NAME
#undef NV
#define NV 4
#define NAME vec_bf16_4
#include "paged_decode_avx512.h"
#undef NAME
#undef NV
#define NV 8
#define NAME vec_bf16_8
#include "paged_decode_avx512.h"
#undef NAME
#undef NV
#define NV 16
#define NAME vec_bf16_16
#include "paged_decode_avx512.h"
#undef NAME
#undef NV
#undef KV_T
#undef LOADV
#undef QK_DPBF16

typedef void (*vec_fn)(const float *, const void *, const int32_t *, int64_t, float *, int64_t,
                       int64_t, int64_t, int64_t, int64_t, float, int64_t, float);
/* The vectorized body for this head_dim and cache type, or NULL (use the generic loop). */
static vec_fn vec_body(int64_t head_dim, int kv_bf16) {
  switch (head_dim) {
    case 16: return kv_bf16 ? vec_bf16_1 : vec_f32_1;
    case 32: return kv_bf16 ? vec_bf16_2 : vec_f32_2;
    case 64: return kv_bf16 ? vec_bf16_4 : vec_f32_4;
    case 128: return kv_bf16 ? vec_bf16_8 : vec_f32_8;
    case 256: return kv_bf16 ? vec_bf16_16 : vec_f32_16;
    default: return NULL;
  }
}
#else
typedef void (*vec_fn)(void);
static vec_fn vec_body(int64_t head_dim, int kv_bf16) { (void)head_dim; (void)kv_bf16; return NULL; }
#endif

int paged_decode_vectorized(int64_t head_dim, int kv_bf16) { return vec_body(head_dim, kv_bf16) != NULL; }

/* float32 to bfloat16, nearest-even (NaN to the quiet NaN 0x7FC0), as PyTorch rounds. */
static inline uint16_t f32_to_bf16(float f) {
  union { float f; uint32_t u; } c;
  c.f = f;
  if ((c.u & 0x7fffffffu) > 0x7f800000u) return 0x7FC0;
  return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* Returns 0, or 2 when a size is over the MAX_* limits (the Python wrapper checks first).
 * window: sliding window in tokens, 0 = none; softcap: logit soft cap, 0 = none.
 * kv_bf16: 0 = kv_cache holds float32, 1 = bfloat16.
 * q_bf16: 0 = query and out are float32, 1 = bfloat16 (strides in elements either way): each
 * work item widens its query rows into a float32 buffer and rounds its float32 output to bf16
 * (nearest-even), the same values as widening and rounding around a float32 call, without the
 * two extra tensors per layer. */
int paged_decode(const void *query, int64_t q_stride, const void *kv_cache,
                 const int32_t *block_table, const int32_t *seq_lens, void *out,
                 int64_t out_stride, int64_t num_reqs, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 int64_t max_blocks, float scale, int64_t window, float softcap,
                 int num_threads, int kv_bf16, int use_generic, int q_bf16) {
  if (num_heads > MAX_HEADS || head_dim > MAX_DIM || block_size > MAX_BLOCK) return 2;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * head_dim; /* one token's K (or V), all kv heads */
  const int64_t splits = num_reqs >= num_threads ? 1 : num_kv_heads;
  const vec_fn vec = use_generic ? NULL : vec_body(head_dim, kv_bf16);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t item = 0; item < num_reqs * splits; ++item) {
    const int64_t b = item / splits, c = item % splits;
    const int64_t per = num_heads / splits;
    /* this item's rows: heads [c * per, (c + 1) * per) of request b, elements [e0, e1) */
    const int64_t e0 = c * per * head_dim, e1 = (c + 1) * per * head_dim;
    float qbuf[q_bf16 ? MAX_HEADS * MAX_DIM : 1] __attribute__((aligned(64)));
    float obuf[q_bf16 ? MAX_HEADS * MAX_DIM : 1] __attribute__((aligned(64)));
    const float *q = (const float *)query + b * q_stride;
    float *o = (float *)out + b * out_stride;
    if (q_bf16) {
      const uint16_t *qs = (const uint16_t *)query + b * q_stride;
      for (int64_t i = e0; i < e1; ++i) qbuf[i] = bf16_to_f32(qs[i]);
      q = qbuf;
      o = obuf;
    }
#ifdef __AVX512F__
    if (vec) {
      vec(q, kv_cache, block_table + b * max_blocks, seq_lens[b], o, c * per, (c + 1) * per,
          group, row, block_size, scale, window, softcap);
    } else
#endif
    if (kv_bf16)
      attend_bf16(q, (const uint16_t *)kv_cache, block_table + b * max_blocks, seq_lens[b], o,
                  c * per, (c + 1) * per, group, row, head_dim, block_size, scale, window, softcap);
    else
      attend_f32(q, (const float *)kv_cache, block_table + b * max_blocks, seq_lens[b], o,
                 c * per, (c + 1) * per, group, row, head_dim, block_size, scale, window, softcap);
    if (q_bf16) {
      uint16_t *os = (uint16_t *)out + b * out_stride;
      for (int64_t i = e0; i < e1; ++i) os[i] = f32_to_bf16(obuf[i]);
    }
  }
  return 0;
}
