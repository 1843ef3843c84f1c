/* float32 tile of paged_prefill.c (included by it; AVX-512F): the same function and work split
 * as the bf16 tile, for float32 models (query, cache and out float32), head_dim a multiple of 16.
 * Per 32-key chunk, K is staged transposed (lane = key) once for the tile's rows; four rows at a
 * time, q.k is two FMAs per query element (the element broadcast, 32 keys), with no reduction
 * across lanes; the online softmax is the bf16 tile's; p . V is one FMA per visible key and 16
 * elements, reading V rows straight from the cache. Every step is float32: the result equals
 * the reference up to the order of float32 additions. */

/* ktf[d * CHUNK + t] = element d of key t; keys at or past `valid` are zero. */
static inline void stage_keys_f32(const float *const *krow, int64_t valid, int64_t D, float *ktf) {
  for (int64_t t = 0; t < CHUNK; ++t) {
    if (t < valid)
      for (int64_t d = 0; d < D; ++d) ktf[d * CHUNK + t] = krow[t][d];
    else
      for (int64_t d = 0; d < D; ++d) ktf[d * CHUNK + t] = 0.f;
  }
}

static inline __attribute__((always_inline)) void scores_rows_f32(const float *const *qr,
                                                                  const float *ktf, int64_t D,
                                                                  int R, __m512 *s) {
  for (int i = 0; i < 2 * R; ++i) s[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_load_ps(ktf + d * CHUNK), k1 = _mm512_load_ps(ktf + d * CHUNK + 16);
    for (int i = 0; i < R; ++i) {
      const __m512 qd = _mm512_set1_ps(qr[i][d]);
      s[2 * i] = _mm512_fmadd_ps(qd, k0, s[2 * i]);
      s[2 * i + 1] = _mm512_fmadd_ps(qd, k1, s[2 * i + 1]);
    }
  }
}

/* softmax_step, then p . V in float32 from the V rows in the cache (visible keys only). */
static inline __attribute__((always_inline)) void update_row_f32(
    __m512 s0, __m512 s1, int64_t n, float scale, float *m, float *l, float *a,
    const float *const *vrow, int64_t NV) {
  float p[CHUNK] __attribute__((aligned(64)));
  __m512 p0, p1;
  float corr;
  softmax_step(s0, s1, n, scale, m, l, &p0, &p1, &corr);
  _mm512_store_ps(p, p0);
  _mm512_store_ps(p + 16, p1);
  const int64_t keys = n < CHUNK ? n : CHUNK; /* the row's visible keys of this chunk */
  const __m512 cv = _mm512_set1_ps(corr);
  for (int64_t v0 = 0; v0 < NV; v0 += 4) { /* 4 accumulator vectors at a time in registers */
    const int64_t nv = NV - v0 < 4 ? NV - v0 : 4;
    if (nv == 4) {
      __m512 a0 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0), cv);
      __m512 a1 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0 + 16), cv);
      __m512 a2 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0 + 32), cv);
      __m512 a3 = _mm512_mul_ps(_mm512_load_ps(a + 16 * v0 + 48), cv);
      for (int64_t t = 0; t < keys; ++t) {
        const __m512 pt = _mm512_set1_ps(p[t]);
        const float *vt = vrow[t] + 16 * v0;
        a0 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt), a0);
        a1 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt + 16), a1);
        a2 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt + 32), a2);
        a3 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt + 48), a3);
      }
      _mm512_store_ps(a + 16 * v0, a0);
      _mm512_store_ps(a + 16 * v0 + 16, a1);
      _mm512_store_ps(a + 16 * v0 + 32, a2);
      _mm512_store_ps(a + 16 * v0 + 48, a3);
    } else {
      for (int64_t v = 0; v < nv; ++v) {
        __m512 av = _mm512_mul_ps(_mm512_load_ps(a + 16 * (v0 + v)), cv);
        for (int64_t t = 0; t < keys; ++t)
          av = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(vrow[t] + 16 * (v0 + v)), av);
        _mm512_store_ps(a + 16 * (v0 + v), av);
      }
    }
  }
}

static void tile_f32(const float *query, int64_t q_stride, const float *kv, const int32_t *blocks,
                     int64_t first_pos, int64_t t0, int64_t nt, int64_t kvh, int64_t group,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                     float *out, int64_t out_stride) {
  const int64_t D = head_dim, NV = head_dim / 16;
  const int64_t row_elems = num_kv_heads * head_dim;
  const int64_t block_stride = 2 * block_size * row_elems;
  const int64_t rows = nt * group;
  float acc[MAX_ROWS * MAX_D] __attribute__((aligned(64)));
  float m[MAX_ROWS], l[MAX_ROWS];
  float ktf[MAX_D * CHUNK] __attribute__((aligned(64)));
  const float *qrow[MAX_ROWS], *krow[CHUNK], *vrow[CHUNK];
  int64_t qpos[MAX_ROWS];
  memset(acc, 0, sizeof(float) * (size_t)(rows * D));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group, g = r % group;
    m[r] = -1e30f;
    l[r] = 0.f;
    qrow[r] = query + (t0 + i) * q_stride + (kvh * group + g) * D;
    qpos[r] = first_pos + t0 + i;
  }
  const int64_t last_pos = first_pos + t0 + nt - 1;
  const int64_t nchunks = last_pos / CHUNK + 1;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t c0 = c * CHUNK;
    const int64_t valid = last_pos - c0 + 1 < CHUNK ? last_pos - c0 + 1 : CHUNK;
    for (int64_t t = 0; t < valid; ++t) {
      const int64_t pos = c0 + t;
      krow[t] = kv + (int64_t)blocks[pos / block_size] * block_stride +
                (pos % block_size) * row_elems + kvh * D;
      vrow[t] = krow[t] + block_size * row_elems;
    }
    stage_keys_f32(krow, valid, D, ktf);
    int64_t r = 0;
    while (r < rows && qpos[r] < c0) ++r;
    for (; r < rows; r += 4) {
      const int R = rows - r < 4 ? (int)(rows - r) : 4;
      __m512 s[8];
      switch (R) {
        case 4: scores_rows_f32(qrow + r, ktf, D, 4, s); break;
        case 3: scores_rows_f32(qrow + r, ktf, D, 3, s); break;
        case 2: scores_rows_f32(qrow + r, ktf, D, 2, s); break;
        default: scores_rows_f32(qrow + r, ktf, D, 1, s); break;
      }
      for (int i = 0; i < R; ++i) {
        const int64_t n = qpos[r + i] - c0 + 1 < CHUNK ? qpos[r + i] - c0 + 1 : CHUNK;
        update_row_f32(s[2 * i], s[2 * i + 1], n, scale, m + r + i, l + r + i, acc + (r + i) * D,
                       vrow, NV);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / group, g = r % group;
    float *o = out + (t0 + i) * out_stride + (kvh * group + g) * D;
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int64_t v = 0; v < NV; ++v)
      _mm512_storeu_ps(o + 16 * v, _mm512_mul_ps(_mm512_load_ps(acc + r * D + 16 * v), inv));
  }
}
