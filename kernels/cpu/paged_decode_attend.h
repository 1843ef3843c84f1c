/* The body of paged_decode.c's attention loop, included once per KV cache element type with
 * NAME (the function's name), KV_T (the cache's element type) and LOAD(p, i) (element i of p as
 * a float) defined. Query, scores, accumulators and output are float32 in both. */
/* Attention of query heads [h0, h1) of request b (all sharing kv heads h0/group..). */
static void NAME(const float *q, const KV_T *kv_cache, const int32_t *blocks, int64_t len,
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
    const KV_T *kb = kv_cache + (int64_t)blocks[j] * block_stride;
    const KV_T *vb = kb + block_size * row;
    const int64_t n = (j + 1) * block_size <= len ? block_size : len - j * block_size;
    const int64_t t0 = j == j0 ? first - j * block_size : 0; /* window start inside the block */
    if (j + 1 < nblk) {
      const char *next = (const char *)(kv_cache + (int64_t)blocks[j + 1] * block_stride);
      const int64_t bytes = block_stride * (int64_t)sizeof(KV_T);
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(next + off, 0, 3);
    }
    for (int64_t t = t0; t < n; ++t) {
      const KV_T *k = kb + t * row;
      for (int64_t h = 0; h < nh; ++h) {
        const KV_T *kk = k + ((h0 + h) / group) * head_dim;
        const float *qq = q + (h0 + h) * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < head_dim; ++i) dot += qq[i] * LOAD(kk, i);
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
      const KV_T *v = vb + t * row;
      for (int64_t h = 0; h < nh; ++h) {
        const KV_T *vv = v + ((h0 + h) / group) * head_dim;
        float *a = acc + h * head_dim;
        const float p = s[h * MAX_BLOCK + t];
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) a[i] += p * LOAD(vv, i);
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    float *oo = o + (h0 + h) * head_dim;
    for (int64_t i = 0; i < head_dim; ++i) oo[i] = acc[h * head_dim + i] * inv;
  }
}

