/* Fused CPU ops: bfloat16 RMSNorm (with an optional residual add), rotary embedding and
 * SwiGLU's silu(gate) * up, and the KV cache write (a row copy, any element type).
 *
 * References: kernels/cpu/fused_ops.py (rms_norm_reference, add_rms_norm_reference,
 * rotary_reference, silu_and_mul_reference, write_kv_reference), which are the engine's
 * PyTorch code paths. The KV write is a copy and exact; for the bf16 ops: Each function here
 * reproduces that code's roundings step by step (every bf16 intermediate the PyTorch code
 * materialises is rounded to nearest-even here too), so outputs match it bit for bit except
 * where the float32 sum of squares is added in another order (RMSNorm) or exp differs in its
 * last bits (silu): at most two bf16 ulps, on under 1% of elements. One call replaces 6-10 PyTorch ops and their allocations: a decode step of the
 * default model calls these 150 times on 64 rows, where per-op overhead, not arithmetic, was
 * the cost.
 *
 * bf16 values are uint16_t; widening is a 16-bit shift, narrowing rounds to nearest-even
 * (NaN stays NaN). With AVX-512 BF16 the bodies are hand-vectorized (narrowing by
 * vcvtneps2bf16, which also flushes float32 denormals, below 1.2e-38, to zero); elsewhere
 * they are plain loops. Rows are parallel over OpenMP threads when there are enough of them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include "simd_math.h"
#define FO_SIMD 1 /* hand-vectorized bodies; bf16 rounding by vcvtneps2bf16 (nearest-even) */
#else
#define FO_SIMD 0
#endif

static inline float widen(uint16_t x) {
  union { uint32_t u; float f; } c;
  c.u = (uint32_t)x << 16;
  return c.f;
}

static inline uint16_t narrow(float f) {
  union { uint32_t u; float f; } c;
  c.f = f;
  if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u); /* NaN */
  c.u += 0x7fffu + ((c.u >> 16) & 1u);
  return (uint16_t)(c.u >> 16);
}

#define PAR_MIN_ELEMS 262144 /* below this, one thread: the fork costs more than it saves */

#if FO_SIMD
/* 16 bf16 at p (the first n of them; the rest read as 0) as floats, and back. */
static inline __m512 ld16(const uint16_t *p, int64_t n) {
  const __m256i raw = n >= 16 ? _mm256_loadu_si256((const __m256i *)p)
                              : _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
static inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
static inline __m512 round_bf16(__m512 v) { /* v rounded to bf16, as a float */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}
static inline void st16(uint16_t *p, __m512 v, int64_t n) {
  if (n >= 16) _mm256_storeu_si256((__m256i *)p, to_bf16(v));
  else _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1u), to_bf16(v));
}

static void norm_row_simd(const uint16_t *xr, const uint16_t *ar, uint16_t *sr, const uint16_t *w,
                          uint16_t *orow, int64_t hidden, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 16) {
    const int64_t n = hidden - i;
    __m512 f = ld16(xr + i, n);
    if (ar) {
      f = round_bf16(_mm512_add_ps(f, ld16(ar + i, n)));
      st16(sr + i, f, n);
    }
    ss = _mm512_fmadd_ps(f, f, ss);
  }
  if (ar) xr = sr;
  const float inv = 1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)hidden + eps);
  const __m512 iv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < hidden; i += 16) {
    const int64_t n = hidden - i;
    st16(orow + i, _mm512_mul_ps(ld16(w + i, n), round_bf16(_mm512_mul_ps(ld16(xr + i, n), iv))), n);
  }
}
#endif

/* out[r] = w * bf16(r32 * rsqrt(mean(r32^2) + eps)) for each row r, where r32 is the row in
 * float32 and r is x[r] (+ add[r], rounded to bf16 and stored to sum[r] when add is given).
 * Strides are in elements; rows are contiguous. */
void add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *add, int64_t add_stride,
                       uint16_t *sum, const uint16_t *w, uint16_t *out, int64_t rows,
                       int64_t hidden, float eps, int num_threads) {
  const int par = rows * hidden >= PAR_MIN_ELEMS && num_threads > 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (par)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t *xr = x + r * x_stride;
    uint16_t *orow = out + r * hidden;
#if FO_SIMD
    norm_row_simd(xr, add ? add + r * add_stride : NULL, add ? sum + r * hidden : NULL, w, orow,
                  hidden, eps);
    continue;
#endif
    float ss = 0.f;
    if (add) {
      const uint16_t *ar = add + r * add_stride;
      uint16_t *sr = sum + r * hidden;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) {
        const uint16_t s = narrow(widen(xr[i]) + widen(ar[i]));
        sr[i] = s;
        const float f = widen(s);
        ss += f * f;
      }
      xr = sr;
    } else {
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) {
        const float f = widen(xr[i]);
        ss += f * f;
      }
    }
    const float inv = 1.f / sqrtf(ss / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i)
      orow[i] = narrow(widen(w[i]) * widen(narrow(widen(xr[i]) * inv)));
  }
}

/* NeoX ("rotate half") rotary embedding in place on x [tokens, heads, head_dim] (token stride
 * x_stride elements, heads contiguous), the first rotary_dim dims of each head, with float32
 * tables cos/sin [*, rotary_dim / 2] indexed by rows[token]. Rounds as the PyTorch bf16 code:
 * c = bf16(cos), s = bf16(sin); y1 = bf16(bf16(x1 c) - bf16(x2 s)), y2 = bf16(bf16(x2 c) + bf16(x1 s)). */
void rotary_bf16(uint16_t *x, int64_t x_stride, int64_t tokens, int64_t heads, int64_t head_dim,
                 int64_t rotary_dim, const float *cos_table, const float *sin_table,
                 const int64_t *rows, int num_threads) {
  const int64_t half = rotary_dim / 2;
  const int par = tokens * heads * rotary_dim >= PAR_MIN_ELEMS && num_threads > 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (par)
  for (int64_t t = 0; t < tokens; ++t) {
    const float *ct = cos_table + rows[t] * half, *st = sin_table + rows[t] * half;
    float c[512 + 16], s[512 + 16]; /* + 16: whole vectors are read past half (then unused) */
    for (int64_t i = 0; i < half; ++i) { c[i] = widen(narrow(ct[i])); s[i] = widen(narrow(st[i])); }
#if FO_SIMD
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t *p = x + t * x_stride + h * head_dim;
      for (int64_t i = 0; i < half; i += 16) {
        const int64_t n = half - i;
        const __m512 x1 = ld16(p + i, n), x2 = ld16(p + i + half, n);
        const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
        const __m512 y1 = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, cv)), round_bf16(_mm512_mul_ps(x2, sv)));
        const __m512 y2 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, cv)), round_bf16(_mm512_mul_ps(x1, sv)));
        st16(p + i, y1, n);
        st16(p + i + half, y2, n);
      }
    }
    continue;
#endif
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t *p = x + t * x_stride + h * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = widen(p[i]), x2 = widen(p[i + half]);
        const float y1 = widen(narrow(x1 * c[i])) - widen(narrow(x2 * s[i]));
        const float y2 = widen(narrow(x2 * c[i])) + widen(narrow(x1 * s[i]));
        p[i] = narrow(y1);
        p[i + half] = narrow(y2);
      }
    }
  }
}

int fused_ops_max_half(void) { return 512; }

/* Writes each token's K and V rows (row_bytes each: kv_heads x head_dim elements) to its slot
 * (block = slot / block_size, offset = slot % block_size) of the cache [blocks, 2, block_size,
 * row]; slot -1 skips the token. A pure copy, so exact for every element type. Strides are in
 * bytes. */
void write_kv_rows(const char *key, int64_t key_stride, const char *value, int64_t value_stride,
                   char *cache, const int64_t *slots, int64_t tokens, int64_t block_size,
                   int64_t row_bytes, int num_threads) {
  const int par = tokens * row_bytes >= 4 * PAR_MIN_ELEMS && num_threads > 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (par)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    char *k = cache + ((slot / block_size) * 2 * block_size + slot % block_size) * row_bytes;
    memcpy(k, key + t * key_stride, (size_t)row_bytes);
    memcpy(k + block_size * row_bytes, value + t * value_stride, (size_t)row_bytes);
  }
}

/* out[t] = bf16(bf16(silu(g)) * u) for SwiGLU's gate g and up u rows (bf16, element strides
 * gate_stride / up_stride), out [tokens, inter] contiguous: the roundings of PyTorch's
 * F.silu(gate).mul_(up) in bf16 (silu computed in float32). */
void silu_and_mul_bf16(const uint16_t *gate, int64_t gate_stride, const uint16_t *up,
                       int64_t up_stride, uint16_t *out, int64_t tokens, int64_t inter,
                       int num_threads) {
  const int par = tokens * inter >= PAR_MIN_ELEMS && num_threads > 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (par)
  for (int64_t t = 0; t < tokens; ++t) {
    const uint16_t *g = gate + t * gate_stride, *u = up + t * up_stride;
    uint16_t *o = out + t * inter;
#if FO_SIMD
    for (int64_t i = 0; i < inter; i += 16) {
      const int64_t n = inter - i;
      const __m512 x = ld16(g + i, n);
      const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
      st16(o + i, _mm512_mul_ps(round_bf16(silu), ld16(u + i, n)), n);
    }
    continue;
#endif
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float x = widen(g[i]);
      o[i] = narrow(widen(narrow(x / (1.f + expf(-x)))) * widen(u[i]));
    }
  }
}
