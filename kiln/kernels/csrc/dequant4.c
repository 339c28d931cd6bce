/* kiln::dequant4: NF4 / FP4 (bitsandbytes layout) to float32 / bf16 / fp16 in one pass, equal bit for bit to
   kiln.hub.bnb4's torch path. The binding, its checks and the op: kiln/kernels/dequant4.py. Plain C (no torch
   headers), built by kiln/kernels/build.py with -march=native -ffp-contract=off on first use. */

#include <stdint.h>
#include <string.h>
#include <pthread.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KILN_AVX512 1
#endif

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_F16 = 2 };

typedef struct {
    const uint8_t *packed; int64_t n, bs;
    const float *code, *absmax;                                   /* absmax: float32 per block, or NULL */
    const uint8_t *absmax8; const float *code8, *nested; int64_t nbs; float offset;   /* nested absmax */
    void *out; int kind, vector; int64_t b0, b1;
} job_t;

static uint16_t bf16_of(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return 0xFFFF;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static uint16_t f16_of(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return sign | 0x7E00u | ((a >> 13) & 0x3FFu);   /* NaN: quiet, top of the payload */
    if (a >= 0x477FF000u) return sign | 0x7C00u;                       /* 65520 and up (and inf): inf */
    if (a >= 0x38800000u) {                                            /* normal: rebias, round 13 bits */
        uint32_t r = a - 0x38000000u;
        r += 0xFFFu + ((r >> 13) & 1u);
        return sign | (uint16_t)(r >> 13);
    }
    if (a < 0x33000000u) return sign;                                  /* under 2^-25: zero */
    uint32_t shift = 126u - (a >> 23), m = (a & 0x7FFFFFu) | 0x800000u; /* subnormal: m * 2^-shift units */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

static float block_absmax(const job_t *j, int64_t b) {
    if (j->absmax) return j->absmax[b];
    float s = j->code8[j->absmax8[b]] * j->nested[b / j->nbs];
    return s + j->offset;
}

/* the block's 16 values, rounded to the output dtype: t16 (bf16 / fp16 bits) or t32 */
static void table(const job_t *j, float a, uint16_t *t16, float *t32) {
    for (int i = 0; i < 16; i++) {
        float v = j->code[i] * a;
        if (j->kind == OUT_F32) t32[i] = v;
        else t16[i] = j->kind == OUT_BF16 ? bf16_of(v) : f16_of(v);
    }
}

/* bytes [k0, k1) of block b: values 2k (high nibble) and 2k + 1 (low), the last one only if below n */
static void scalar(const job_t *j, int64_t k0, int64_t k1, const uint16_t *t16, const float *t32) {
    for (int64_t k = k0; k < k1; k++) {
        uint8_t x = j->packed[k];
        int two = 2 * k + 1 < j->n;
        if (j->kind == OUT_F32) {
            float *o = (float *)j->out + 2 * k;
            o[0] = t32[x >> 4]; if (two) o[1] = t32[x & 15];
        } else {
            uint16_t *o = (uint16_t *)j->out + 2 * k;
            o[0] = t16[x >> 4]; if (two) o[1] = t16[x & 15];
        }
    }
}

static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    int64_t half = j->bs / 2, nbytes = (j->n + 1) / 2;
    uint16_t t16[32]; float t32[16];
    for (int64_t b = j->b0; b < j->b1; b++) {
        float a = block_absmax(j, b);
        int64_t k0 = b * half, k1 = k0 + half < nbytes ? k0 + half : nbytes;
#ifdef KILN_AVX512
        if (j->vector) {
            __m512 tv = _mm512_mul_ps(_mm512_loadu_ps(j->code), _mm512_set1_ps(a));
            __m512i tab;
            if (j->kind == OUT_BF16) {
                __m512i u = _mm512_castps_si512(tv);
                __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
                __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
                r = _mm512_srli_epi32(r, 16);                       /* bf16_of's rounding, 16 at once */
                r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(tv, tv, _CMP_ORD_Q), _mm512_set1_epi32(0xFFFF), r);
                tab = _mm512_zextsi256_si512(_mm512_cvtepi32_epi16(r));
            } else if (j->kind == OUT_F16) {
                tab = _mm512_zextsi256_si512(_mm512_cvtps_ph(tv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            } else {
                tab = _mm512_castps_si512(tv);
            }
            _mm512_storeu_si512((void *)t32, tab);                  /* the tail's scalar table */
            memcpy(t16, t32, sizeof t32);
            const __m512i low = _mm512_set1_epi32(15);
            int64_t k = k0;
            for (; k + 16 <= k1 && 2 * (k + 16) <= j->n; k += 16) {
                __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(j->packed + k)));
                /* 32 16-bit indices in value order: high nibble, then low, per byte */
                __m512i idx = _mm512_or_si512(_mm512_srli_epi32(x, 4), _mm512_slli_epi32(_mm512_and_si512(x, low), 16));
                if (j->kind == OUT_F32) {
                    float *o = (float *)j->out + 2 * k;
                    _mm512_storeu_ps(o, _mm512_permutexvar_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(idx)), tv));
                    _mm512_storeu_ps(o + 16, _mm512_permutexvar_ps(
                        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(idx, 1)), tv));
                } else {
                    _mm512_storeu_si512((void *)((uint16_t *)j->out + 2 * k), _mm512_permutexvar_epi16(idx, tab));
                }
            }
            scalar(j, k, k1, t16, t32);
            continue;
        }
#endif
        table(j, a, t16, t32);
        scalar(j, k0, k1, t16, t32);
    }
    return NULL;
}

/* Dequantize all n values. Returns 0, or -1 for arguments it does not take (the caller uses torch). */
int kiln_dequant4(const uint8_t *packed, int64_t n, int64_t bs, const float *code, const float *absmax,
                  const uint8_t *absmax8, const float *code8, const float *nested, int64_t nbs, float offset,
                  void *out, int kind, int nthreads, int vector) {
    if (n < 0 || bs <= 0 || bs % 2 || kind < 0 || kind > 2 || (!absmax && (!absmax8 || !code8 || !nested || nbs <= 0)))
        return -1;
    int64_t blocks = (n + bs - 1) / bs;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    if ((int64_t)nthreads > blocks / 64) nthreads = blocks >= 128 ? (int)(blocks / 64) : 1;
    job_t jobs[64];
    pthread_t tid[64];
    int started[64] = {0};
    for (int t = 0; t < nthreads; t++) {
        job_t j = {packed, n, bs, code, absmax, absmax8, code8, nested, nbs, offset, out, kind, vector,
                   blocks * t / nthreads, blocks * (t + 1) / nthreads};
        jobs[t] = j;
    }
    for (int t = 1; t < nthreads; t++)
        started[t] = pthread_create(&tid[t], NULL, run, &jobs[t]) == 0;
    run(&jobs[0]);
    for (int t = 1; t < nthreads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        else run(&jobs[t]);
    }
    return 0;
}
