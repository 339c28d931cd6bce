/* kiln::lora_forward / kiln::lora_backward: the float32 LoRA update over a bf16 base (QLoRA's fast path), each
   pass reading the bf16 activations once. The binding, its checks and the ops: kiln/kernels/lora_update.py.
   Plain C (no torch headers), built by kiln/kernels/build.py with -march=native -ffp-contract=off on first use. */

#include <stdint.h>
#include <string.h>
#include <pthread.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define KILN_AVX512 1
#endif

#define NB 8  /* rows per block: BLOCK in the Python wrapper */

static inline float f32_of(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t bf16_of(float f) {  /* round to nearest even; every NaN 0xFFFF, as torch on x86 */
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return 0xFFFF;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return f32_of(bf16_of(f)); }

#ifdef KILN_AVX512
/* masked loads and stores: m = lanes(left), computed outside the loops (a branch per load kept 16 accumulators
   spilling to the stack) */
static inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u); }
static inline __m512 load16(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void store16(float *p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m256i bf16_bits(__m512 v) {  /* nearest even, as bf16_of (a NaN stays a NaN) */
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xFFFF), r);
    return _mm512_cvtepi32_epi16(r);
#endif
}
static inline __m512 round16(__m512 v) {  /* v rounded to bf16, as float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
}
static inline void store_bf16(uint16_t *p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, bf16_bits(v)); }
#endif

typedef struct {
    const uint16_t *x, *g; uint16_t *y, *gx;
    const float *a, *at, *b, *bt, *down_in; float *down, *gd, *part, *buf;   /* buf: NB rows, the thread's */
    int64_t t0, t1, in, out, r; float s1, s2; int vector;
} job_t;

#define INLINE static inline __attribute__((always_inline))

/* Each pass works on blocks of nb rows (NB, then one row at a time for the tail) in three shapes of product,
   each vectorized over a contiguous dimension so no lane ever needs a horizontal sum:
     rowdot:  dst[t, :r]  = s * sum_i buf[t, i] m[i, :r]          (m: n x r; over r)
     rowexp:  v[t, c]     =     sum_k d[t, k] mt[k, c]            (mt: r x n; over c, a tile of rows x 32 c)
     colacc:  part[c, :r] +=    sum_t buf[t, c] d[t, :r]          (part: n x r; over r, 8 c at a time)
   Every accumulator of a tile is its own chain, so a block keeps the multiply-add units busy. */

INLINE void rows_f32(const job_t *j, const uint16_t *src, int64_t n, int64_t t0, const int nb, float s, float *buf) {
    for (int t = 0; t < nb; t++) {
        const uint16_t *row = src + (t0 + t) * n;
        int64_t i = 0;
#ifdef KILN_AVX512
        if (j->vector)
            for (; i < n; i += 16) {
                __mmask16 m = lanes(n - i);
                store16(buf + t * n + i, _mm512_mul_ps(load_bf16(row + i, m), _mm512_set1_ps(s)), m);
            }
#endif
        for (; i < n; i++) buf[t * n + i] = f32_of(row[i]) * s;
    }
}

INLINE void rowdot(const job_t *j, const float *buf, int64_t n, const int nb, const float *m, float s, float *dst) {
    int64_t r = j->r;
#ifdef KILN_AVX512
    if (j->vector) {
        for (int64_t k0 = 0; k0 < r; k0 += 16) {
            __mmask16 mk = lanes(r - k0);
            __m512 acc[NB];
            for (int t = 0; t < nb; t++) acc[t] = _mm512_setzero_ps();
            for (int64_t i = 0; i < n; i++) {
                __m512 mv = load16(m + i * r + k0, mk);
                for (int t = 0; t < nb; t++) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(buf[t * n + i]), mv, acc[t]);
            }
            for (int t = 0; t < nb; t++) store16(dst + t * r + k0, _mm512_mul_ps(acc[t], _mm512_set1_ps(s)), mk);
        }
        return;
    }
#endif
    for (int t = 0; t < nb; t++)
        for (int64_t k = 0; k < r; k++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < n; i++) acc += buf[t * n + i] * m[i * r + k];
            dst[t * r + k] = acc * s;
        }
}

/* mode 0: y[t, c] = bf16(y + bf16(v s)) (the forward's update); mode 1: out[t, c] = bf16(v) (a gradient) */
INLINE void rowexp(const job_t *j, const float *d, int64_t n, int64_t t0, const int nb, const float *mt, float s,
                   uint16_t *dst, const int mode) {
    int64_t r = j->r;
#ifdef KILN_AVX512
    if (j->vector) {
        for (int64_t c = 0; c < n; c += 32) {
            __mmask16 m0 = lanes(n - c), m1 = n - c > 16 ? lanes(n - c - 16) : 0;
            __m512 u0[NB], u1[NB];
            for (int t = 0; t < nb; t++) { u0[t] = _mm512_setzero_ps(); u1[t] = _mm512_setzero_ps(); }
            for (int64_t k = 0; k < r; k++) {
                __m512 v0 = load16(mt + k * n + c, m0), v1 = load16(mt + k * n + c + 16, m1);
                for (int t = 0; t < nb; t++) {
                    __m512 dk = _mm512_set1_ps(d[t * r + k]);
                    u0[t] = _mm512_fmadd_ps(dk, v0, u0[t]);
                    u1[t] = _mm512_fmadd_ps(dk, v1, u1[t]);
                }
            }
            for (int t = 0; t < nb; t++) {
                uint16_t *o = dst + (t0 + t) * n + c;
                if (mode == 0) {
                    __m512 sv = _mm512_set1_ps(s);
                    store_bf16(o, _mm512_add_ps(load_bf16(o, m0), round16(_mm512_mul_ps(u0[t], sv))), m0);
                    store_bf16(o + 16, _mm512_add_ps(load_bf16(o + 16, m1), round16(_mm512_mul_ps(u1[t], sv))), m1);
                } else {
                    store_bf16(o, u0[t], m0);
                    store_bf16(o + 16, u1[t], m1);
                }
            }
        }
        return;
    }
#endif
    for (int t = 0; t < nb; t++) {
        uint16_t *o = dst + (t0 + t) * n;
        for (int64_t c = 0; c < n; c++) {
            float v = 0.0f;
            for (int64_t k = 0; k < r; k++) v += d[t * r + k] * mt[k * n + c];
            o[c] = mode == 0 ? bf16_of(f32_of(o[c]) + round_bf16(v * s)) : bf16_of(v);
        }
    }
}

#ifdef KILN_AVX512
INLINE void colacc_tile(const job_t *j, const float *buf, int64_t n, const int nb, const float *d, float *part,
                        int64_t c0, const int nc, int64_t k0) {
    int64_t r = j->r;
    __mmask16 mk = lanes(r - k0);
    __m512 p[8];
    for (int c = 0; c < nc; c++) p[c] = load16(part + (c0 + c) * r + k0, mk);
    for (int t = 0; t < nb; t++) {
        __m512 dv = load16(d + t * r + k0, mk);
        for (int c = 0; c < nc; c++) p[c] = _mm512_fmadd_ps(_mm512_set1_ps(buf[t * n + c0 + c]), dv, p[c]);
    }
    for (int c = 0; c < nc; c++) store16(part + (c0 + c) * r + k0, p[c], mk);
}
#endif

INLINE void colacc(const job_t *j, const float *buf, int64_t n, const int nb, const float *d, float *part) {
    int64_t r = j->r;
#ifdef KILN_AVX512
    if (j->vector) {
        for (int64_t k0 = 0; k0 < r; k0 += 16) {
            int64_t c0 = 0;
            for (; c0 + 8 <= n; c0 += 8) colacc_tile(j, buf, n, nb, d, part, c0, 8, k0);
            for (; c0 < n; c0++) colacc_tile(j, buf, n, nb, d, part, c0, 1, k0);
        }
        return;
    }
#endif
    for (int64_t c = 0; c < n; c++)
        for (int t = 0; t < nb; t++)
            for (int64_t k = 0; k < r; k++) part[c * r + k] += buf[t * n + c] * d[t * r + k];
}

/* forward, rows [t0, t0 + nb): down = (x A^T) s1; y = bf16(y + bf16((down B^T) s2)), PEFT's two roundings */
INLINE void fwd_block(const job_t *j, int64_t t0, const int nb, float *xb) {
    float *d = j->down + t0 * j->r;
    rows_f32(j, j->x, j->in, t0, nb, 1.0f, xb);
    rowdot(j, xb, j->in, nb, j->at, j->s1, d);
    rowexp(j, d, j->out, t0, nb, j->bt, j->s2, j->y, 0);
}

/* backward over g, rows [t0, t0 + nb): gd = ((g s1) B) s2; part (out, r) += (g s1)^T down */
INLINE void bwd_out_block(const job_t *j, int64_t t0, const int nb, float *gb) {
    rows_f32(j, j->g, j->out, t0, nb, j->s1, gb);
    rowdot(j, gb, j->out, nb, j->b, j->s2, j->gd + t0 * j->r);
    colacc(j, gb, j->out, nb, j->down_in + t0 * j->r, j->part);
}

/* backward over x, rows [t0, t0 + nb): part (in, r) += x^T gd (when part); gx = bf16(gd A) (when gx) */
INLINE void bwd_in_block(const job_t *j, int64_t t0, const int nb, float *xb) {
    const float *gd = j->gd + t0 * j->r;
    if (j->part) {
        rows_f32(j, j->x, j->in, t0, nb, 1.0f, xb);
        colacc(j, xb, j->in, nb, gd, j->part);
    }
    if (j->gx) rowexp(j, gd, j->in, t0, nb, j->a, 1.0f, j->gx, 1);
}

/* a thread's rows [t0, t1): blocks of NB, then the tail one row at a time */
#define OVER_ROWS(name, block) \
    static void *name(void *arg) { \
        const job_t *j = (const job_t *)arg; \
        int64_t t = j->t0; \
        for (; t + NB <= j->t1; t += NB) block(j, t, NB, j->buf); \
        for (; t < j->t1; t++) block(j, t, 1, j->buf); \
        return NULL; \
    }
OVER_ROWS(fwd, fwd_block)
OVER_ROWS(bwd_out, bwd_out_block)
OVER_ROWS(bwd_in, bwd_in_block)

/* rows split over nthreads; thread t uses buf + t * NB * width and (if any) part + t * part_size */
static void spread(void *(*fn)(void *), job_t base, int64_t rows, int nthreads, int64_t part_size, int64_t width) {
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 16) nthreads = 16;
    job_t jobs[16];
    pthread_t tid[16];
    int started[16] = {0};
    for (int t = 0; t < nthreads; t++) {
        jobs[t] = base;
        jobs[t].t0 = rows * t / nthreads;
        jobs[t].t1 = rows * (t + 1) / nthreads;
        if (base.part) jobs[t].part = base.part + t * part_size;
        jobs[t].buf = base.buf + t * NB * width;
    }
    for (int t = 1; t < nthreads; t++) started[t] = pthread_create(&tid[t], NULL, fn, &jobs[t]) == 0;
    fn(&jobs[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else fn(&jobs[t]);
    }
}

void kiln_lora_fwd(const uint16_t *x, const float *at, const float *bt, float *down, uint16_t *y, float *buf,
                  int64_t rows, int64_t in, int64_t out, int64_t r, float s1, float s2, int nthreads, int vector) {
    job_t j = {0};
    j.x = x; j.at = at; j.bt = bt; j.down = down; j.y = y; j.in = in; j.out = out; j.r = r; j.s1 = s1; j.s2 = s2;
    j.vector = vector; j.buf = buf;
    spread(fwd, j, rows, nthreads, 0, in);
}

void kiln_lora_bwd_out(const uint16_t *g, const float *b, const float *down, float *gd, float *part, float *buf,
                      int64_t rows, int64_t out, int64_t r, float s1, float s2, int nthreads, int vector) {
    job_t j = {0};
    j.g = g; j.b = b; j.down_in = down; j.gd = gd; j.part = part; j.out = out; j.r = r; j.s1 = s1; j.s2 = s2;
    j.vector = vector; j.buf = buf;
    spread(bwd_out, j, rows, nthreads, r * out, out);
}

void kiln_lora_bwd_in(const uint16_t *x, const float *a, float *gd, float *part, uint16_t *gx, float *buf,
                     int64_t rows, int64_t in, int64_t r, int nthreads, int vector) {
    job_t j = {0};
    j.x = x; j.a = a; j.gd = gd; j.part = part; j.gx = gx; j.in = in; j.r = r; j.vector = vector; j.buf = buf;
    spread(bwd_in, j, rows, nthreads, r * in, in);
}
