"""The fast path of the float32 LoRA update over a bf16 base (QLoRA on CPU) as fused C kernels.

The exact path (common/qlora.py) computes what PEFT computes over bitsandbytes' Linear4bit, in torch:

    y += bf16(B(A(float32(x))) * s)        x, y bf16 (tokens, features); A (r, in), B (out, r) float32

and its backward, which goes through float32 copies of every (tokens, features) tensor: x, the update, the
output's gradient. On CPU those copies and the skinny float32 matmuls over them cost more than the bf16
base matmul's share of the step. Here each pass reads the bf16 activations once and writes bf16 once:

- `forward`: per block of rows, x to float32 in a small buffer, down = x A^T (float32, kept for backward),
  the update down B^T in registers, rounded to bf16 and added to y in place (PEFT's two roundings);
- `backward`: from the output's gradient g (bf16): the gradient of down (g B) and of B (g^T down) in one pass
  over g; from there the gradient of A (gdown^T x) and of x (gdown A, rounded to bf16) in one pass over x.

Same products as the exact path, summed in another order (AVX-512 lanes, fused multiply-add): within float32
rounding of it before the same bf16 roundings, so the fast path of `kiln train` (`train.exact = false`) takes
it; `exact = true` and every parity test keep the torch path. Rows split over torch's thread count; each
thread sums its own copy of the adapters' gradients, added together afterwards.

`runs` says whether the kernels take the operands (a compiled library: kiln.hub.native; CPU, bf16 activations,
float32 adapters); where not, the caller takes the torch path. The vector code needs AVX-512 (F, BW, VL); a
build without it runs the plain C loops.
"""

from __future__ import annotations

import ctypes

import torch

from kiln.hub import native
from kiln.models.common.quant4 import scratch

SOURCE = r"""
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
"""

_ROWS_PER_THREAD = 64
BLOCK = 8  # NB in the C source: rows per block, the size of each thread's float32 row buffer


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (a build of SOURCE) with its functions' argument types set."""
    if not getattr(lib, "_kiln_typed", False):
        p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        lib.kiln_lora_fwd.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, f32, f32, i32, i32]
        lib.kiln_lora_bwd_out.argtypes = [p, p, p, p, p, p, i64, i64, i64, f32, f32, i32, i32]
        lib.kiln_lora_bwd_in.argtypes = [p, p, p, p, p, p, i64, i64, i64, i32, i32]
        for f in (lib.kiln_lora_fwd, lib.kiln_lora_bwd_out, lib.kiln_lora_bwd_in):
            f.restype = None
        lib._kiln_typed = True
    return lib


def _lib():
    lib = native.load("lora_update", SOURCE)
    return typed(lib) if lib is not None else None


def _threads(rows: int) -> int:
    return max(1, min(torch.get_num_threads(), rows // _ROWS_PER_THREAD, 16))


def _rows_buffer(threads: int, width: int) -> torch.Tensor:
    """Each thread's float32 copy of a block of rows (the C code allocates nothing): a reused scratch buffer,
    as are the backward's other temporaries (quant4.scratch: fresh ones at every matmul fragment glibc's heap)."""
    return scratch("lora_native_rows", (threads, BLOCK * width), torch.float32)


def runs(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernels take these operands (else the caller's torch path runs): CPU, bf16 activations,
    float32 adapters, a contiguous output, and a compiled library."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and y.dtype == torch.bfloat16
            and a.dtype == torch.float32 and b.dtype == torch.float32 and y.is_contiguous()
            and not torch.compiler.is_compiling() and _lib() is not None)


def forward(x2: torch.Tensor, y2: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s1: float, s2: float,
            vector: bool = True) -> torch.Tensor:
    """y2 (rows, out) += the update ((x2 A^T) s1) B^T s2 rounded to bf16, in place (the sum rounded to bf16);
    returns down = (x2 A^T) s1 (rows, r), float32, for backward. x2 (rows, in) and y2 bf16, y2 contiguous."""
    rows, r = x2.shape[0], a.shape[0]
    x2, at, bt = x2.contiguous(), a.t().contiguous(), b.t().contiguous()
    down = torch.empty(rows, r, dtype=torch.float32)
    n = _threads(rows)
    buf = _rows_buffer(n, x2.shape[1])
    _lib().kiln_lora_fwd(x2.data_ptr(), at.data_ptr(), bt.data_ptr(), down.data_ptr(), y2.data_ptr(), buf.data_ptr(),
                         rows, x2.shape[1], y2.shape[1], r, s1, s2, n, int(vector))
    return down


def backward(g2: torch.Tensor, x2: torch.Tensor, a: torch.Tensor, b: torch.Tensor, down: torch.Tensor, s1: float,
             s2: float, need_a: bool, need_b: bool, need_x: bool, vector: bool = True):
    """(gx (rows, in) bf16 or None, gA (r, in), gB (out, r)) for the output's gradient g2 (rows, out) bf16:
    gdown = (g2 s1) B s2, gB = (g2 s1)^T down, gA = gdown^T x2, gx = bf16(gdown A)."""
    lib = _lib()
    rows, r, out, inn = g2.shape[0], a.shape[0], b.shape[0], a.shape[1]
    g2, x2, a, b = g2.contiguous(), x2.contiguous(), a.contiguous(), b.contiguous()
    n = _threads(rows)
    gd = scratch("lora_native_gd", (rows, r), torch.float32)
    part_b = scratch("lora_native_gb", (n, out, r), torch.float32).zero_()  # each thread's own sum (C adds into it)
    buf = _rows_buffer(n, max(out, inn))
    down = down.contiguous()
    lib.kiln_lora_bwd_out(g2.data_ptr(), b.data_ptr(), down.data_ptr(), gd.data_ptr(),
                          part_b.data_ptr(), buf.data_ptr(), rows, out, r, s1, s2, n, int(vector))
    gb = part_b.sum(0) if need_b else None
    if not (need_a or need_x):
        return None, None, gb
    part_a = scratch("lora_native_ga", (n, inn, r), torch.float32).zero_() if need_a else None
    gx = torch.empty(rows, inn, dtype=torch.bfloat16) if need_x else None
    lib.kiln_lora_bwd_in(x2.data_ptr(), a.data_ptr(), gd.data_ptr(), part_a.data_ptr() if need_a else None,
                         gx.data_ptr() if need_x else None, buf.data_ptr(), rows, inn, r, n, int(vector))
    return gx, part_a.sum(0).t().contiguous() if need_a else None, gb
