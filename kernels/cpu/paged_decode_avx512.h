/* AVX-512 body of paged_decode.c for head_dim = 16 * NV, included once per (cache type, NV)
 * with NAME, KV_T, NV and LOADV(p) (16 cache elements at p as a __m512 of floats) defined.
 * Same function as paged_decode_attend.h (the generic loop, kept for other sizes and CPUs
 * without AVX-512), computed in float32 with the same online softmax; only the order of the
 * additions inside a dot product differs.
 *
 * Why it is faster (2-3x on the default model, bf16 cache, 64 requests): the generic loop
 * converts each V row once per query head and keeps its accumulators in memory. Here each K and
 * V row of a kv head is loaded and widened once for all the query heads that share it (GQA), the
 * query and the accumulators of a sub-group of up to 16 / NV heads stay in registers for a whole
 * block, and sixteen tokens' dot products are summed across lanes together (a transpose-add
 * tree: 15 adds for 16 scores instead of a horizontal reduction per score). */
/* The 16 dot products of one head against 16 tokens' keys: partial sums p[t] (16 lanes each)
 * reduced so that lane t of the result is the sum of p[t]'s lanes. */
#ifndef PD_HSUM16_DEFINED
#define PD_HSUM16_DEFINED
/* Level 1: 16 vectors -> 8, each 32-bit lane pair summed (unpacklo/hi on 32-bit lanes). */
static inline __m512 pd_sum16(__m512 *p) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = p[2 * i], y = p[2 * i + 1];
    /* lanes: x0 y0 x1 y1 | ... per 128-bit quarter, summed pairwise */
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 x = a[2 * i], y = a[2 * i + 1];
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x), _mm512_castps_pd(y))));
  }
  /* Now b[i] holds, per 128-bit quarter q, the 4 partial sums of tokens 4i..4i+3 from quarter q. */
  for (int i = 0; i < 2; ++i) {
    const __m512 x = b[2 * i], y = b[2 * i + 1];
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
#endif

static void NAME(const float *q, const void *kv_void, const int32_t *blocks, int64_t len,
                 float *o, int64_t h0, int64_t h1, int64_t group, int64_t row,
                 int64_t block_size, float scale, int64_t window, float softcap) {
    enum { D = 16 * NV, GS = NV >= 16 ? 1 : 16 / NV };
  const KV_T *kv_cache = (const KV_T *)kv_void;
  float acc[MAX_HEADS * MAX_DIM] __attribute__((aligned(64)));
  float m[MAX_HEADS], l[MAX_HEADS];
  float s[GS * MAX_BLOCK] __attribute__((aligned(64)));
  const int64_t nh = h1 - h0;
  const int64_t block_stride = 2 * block_size * row;
  for (int64_t h = 0; h < nh; ++h) { m[h] = -FLT_MAX; l[h] = 0.f; }
  memset(acc, 0, sizeof(float) * (size_t)(nh * D));
  const int64_t nblk = (len + block_size - 1) / block_size;
  const int64_t first = window > 0 && len > window ? len - window : 0;
  const int64_t j0 = first / block_size;
  const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f;
  for (int64_t j = j0; j < nblk; ++j) {
    const KV_T *kb = kv_cache + (int64_t)blocks[j] * block_stride;
    const KV_T *vb = kb + block_size * row;
    const int64_t n = (j + 1) * block_size <= len ? block_size : len - j * block_size;
    const int64_t t0 = j == j0 ? first - j * block_size : 0;
    /* The next block, prefetched into L2 (locality 1) a row at a time below. */
    const char *next = j + 1 < nblk
        ? (const char *)(kv_cache + (int64_t)blocks[j + 1] * block_stride) : NULL;
    /* Sub-groups of at most GS query heads that share one kv head. */
    for (int64_t hs = 0; hs < nh;) {
      const int64_t kvh = (h0 + hs) / group;
      int64_t he = (kvh + 1) * group - h0;
      if (he > nh) he = nh;
      if (he - hs > GS) he = hs + GS;
      const int64_t ng = he - hs;
      const KV_T *kcol = kb + kvh * D, *vcol = vb + kvh * D;
      /* Whether this turn prefetches the next block's rows of its kv head (the first sub-group
       * of the kv head does). */
      const int prefetch = next != NULL && (hs == 0 || (h0 + hs) % group == 0);
      const int64_t rb = row * (int64_t)sizeof(KV_T), hb = kvh * D * (int64_t)sizeof(KV_T);
#if QK_DPBF16
      __m512bh qb[GS][NV / 2];
      for (int64_t g = 0; g < ng; ++g)
        for (int v = 0; v < NV / 2; ++v) {
          const float *qq = q + (h0 + hs + g) * D + 32 * v;
          qb[g][v] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qq + 16), _mm512_loadu_ps(qq));
        }
#else
      __m512 qv[GS][NV];
      for (int64_t g = 0; g < ng; ++g)
        for (int v = 0; v < NV; ++v) qv[g][v] = _mm512_loadu_ps(q + (h0 + hs + g) * D + 16 * v);
#endif
      /* Scores of tokens t0..n-1 for each head of the sub-group, 16 tokens at a time. */
      for (int64_t tb = 0; tb < n; tb += 16) {
        __m512 part[GS][16];
        const int64_t tn = n - tb < 16 ? n - tb : 16;
        for (int64_t t = 0; t < 16; ++t) {
          /* The next block's K rows of this kv head into L2, a row per key row read here (and
           * its V rows a row per value row read below): the prefetches spread over the whole
           * block's work. On 64 requests x 30 layers of scattered blocks
           * (benchmarks/bench_attention_cpu.py) a step took 24 ms, against 27.5 ms with K and V
           * both prefetched in this loop, 35 ms with a kv head's rows prefetched at the start of
           * its turn and 41-43 ms with the whole next block at the block's start (which had
           * beaten no prefetch, prefetch into L1 and two blocks ahead; two and three blocks
           * ahead lost again here: 27-31 ms). */
          if (prefetch && tb + t < block_size)
            for (int64_t off = 0; off < D * (int64_t)sizeof(KV_T); off += 64)
              __builtin_prefetch(next + hb + (tb + t) * rb + off, 0, 1);
          if (t < tn) {
#if QK_DPBF16
            __m512bh kv[NV / 2];
            for (int v = 0; v < NV / 2; ++v)
              kv[v] = (__m512bh)_mm512_loadu_si512(kcol + (tb + t) * row + 32 * v);
            for (int64_t g = 0; g < ng; ++g) {
              __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), qb[g][0], kv[0]);
              for (int v = 1; v < NV / 2; ++v) d = _mm512_dpbf16_ps(d, qb[g][v], kv[v]);
              part[g][t] = d;
            }
#else
            __m512 kv[NV];
            for (int v = 0; v < NV; ++v) kv[v] = LOADV(kcol + (tb + t) * row + 16 * v);
            for (int64_t g = 0; g < ng; ++g) {
              __m512 d = _mm512_mul_ps(qv[g][0], kv[0]);
              for (int v = 1; v < NV; ++v) d = _mm512_fmadd_ps(qv[g][v], kv[v], d);
              part[g][t] = d;
            }
#endif
          } else {
            for (int64_t g = 0; g < ng; ++g) part[g][t] = _mm512_setzero_ps();
          }
        }
        for (int64_t g = 0; g < ng; ++g)
          _mm512_store_ps(s + g * MAX_BLOCK + tb,
                          _mm512_mul_ps(pd_sum16(part[g]), _mm512_set1_ps(scale)));
      }
      /* Online softmax over this block, per head (same steps as the generic loop). */
      float corr[GS];
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t h = hs + g;
        float *sh = s + g * MAX_BLOCK;
        float mx = m[h];
        if (softcap > 0.f)
          for (int64_t t = t0; t < n; ++t) sh[t] = softcap * tanhf(sh[t] * inv_cap);
        for (int64_t t = t0; t < n; ++t) mx = sh[t] > mx ? sh[t] : mx;
        corr[g] = j == j0 ? 0.f : expf(m[h] - mx);
        float sum = 0.f;
        for (int64_t t = t0; t < n; ++t) { sh[t] = expf(sh[t] - mx); sum += sh[t]; }
        l[h] = l[h] * corr[g] + sum;
        m[h] = mx;
      }
      /* Accumulators of the sub-group in registers for the block's values. */
      __m512 av[GS][NV];
      for (int64_t g = 0; g < ng; ++g) {
        const __m512 c = _mm512_set1_ps(corr[g]);
        for (int v = 0; v < NV; ++v)
          av[g][v] = _mm512_mul_ps(_mm512_load_ps(acc + (hs + g) * D + 16 * v), c);
      }
      for (int64_t t = t0; t < n; ++t) {
        if (prefetch) /* the next block's V row t of this kv head, a row per V row read */
          for (int64_t off = 0; off < D * (int64_t)sizeof(KV_T); off += 64)
            __builtin_prefetch(next + block_size * rb + hb + t * rb + off, 0, 1);
        __m512 vv[NV];
        for (int v = 0; v < NV; ++v) vv[v] = LOADV(vcol + t * row + 16 * v);
        for (int64_t g = 0; g < ng; ++g) {
          const __m512 p = _mm512_set1_ps(s[g * MAX_BLOCK + t]);
          for (int v = 0; v < NV; ++v) av[g][v] = _mm512_fmadd_ps(p, vv[v], av[g][v]);
        }
      }
      for (int64_t g = 0; g < ng; ++g)
        for (int v = 0; v < NV; ++v) _mm512_store_ps(acc + (hs + g) * D + 16 * v, av[g][v]);
      hs = he;
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    float *oo = o + (h0 + h) * D;
    for (int64_t i = 0; i < D; ++i) oo[i] = acc[h * D + i] * inv;
  }
}
