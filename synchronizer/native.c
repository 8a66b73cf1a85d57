/* The Synchronizer's outer-step kernels in plain C (and its crc32, at the end): each does in
 * one pass over memory what torch does in several (see synchronizer/native.py, which builds
 * and loads this file).
 *
 * Built with -O3 -fno-fast-math -ffp-contract=off: every operation is one IEEE-754 single
 * precision operation in the order written (no fused multiply-add, no reassociation), and no
 * kernel reduces across elements except by max, which is exact. The same inputs therefore give
 * the same bits on every machine, vectorised or not, which log replay and the update chain's
 * checksums rely on. No threads, no allocation, no global state: the caller releases the GIL.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define RUN 4096 /* elements per run: a run of every array a kernel touches stays in L1/L2 */

/* On x86-64 each kernel is also compiled for AVX2 and the loader picks the copy the CPU runs
 * (the numbers are the same: element-wise IEEE operations, and no FMA in either copy). */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define KERNEL __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef KERNEL
#define KERNEL
#endif

/* Helpers are inlined into each kernel, so each kernel's AVX2 copy has their loops in AVX2 too
 * (a helper left out of line is compiled once, for the baseline target). */
#if defined(__GNUC__) || defined(__clang__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

/* Round to nearest, ties to even, for |x| < 2^22 (codes are at most 127 in magnitude): adding
 * and subtracting 1.5 * 2^23 leaves x rounded in the current rounding mode (nearest even), as
 * torch.round does. */
INLINE float round_even(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (x + magic) - magic;
}

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even into bfloat16, as torch's conversion does for finite values. */
INLINE uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* The code values of elements [start, stop) of a blockwise payload's codes into q: int8, or
 * int4 two per byte, low nibble first, stored as code + 8 (nibble 0 is never written and reads
 * as -7). `start` is even. */
INLINE void codes_of(const uint8_t *codes, int int4, int64_t start, int64_t stop,
                    int8_t *restrict q) {
    int64_t m = stop - start;
    if (!int4) {
        memcpy(q, codes + start, (size_t)m);
        return;
    }
    const uint8_t *p = codes + (start >> 1);
    int64_t pairs = m >> 1;
    for (int64_t j = 0; j < pairs; j++) {
        int8_t lo = (int8_t)((p[j] & 15) - 8), hi = (int8_t)((p[j] >> 4) - 8);
        q[2 * j] = lo < -7 ? -7 : lo;
        q[2 * j + 1] = hi < -7 ? -7 : hi;
    }
    if (m & 1) {
        int8_t lo = (int8_t)((p[pairs] & 15) - 8);
        q[m - 1] = lo < -7 ? -7 : lo;
    }
}

/* What a push is, to the kernels that add pushes: INT8 codes, INT4 codes two per byte, or
 * values in bfloat16 or FP32. Codes come with one scale per block of `bs`; values with one
 * weight. */
enum { PUSH_INT8 = 0, PUSH_INT4 = 1, PUSH_BF16 = 2, PUSH_FP32 = 3 };

/* o[j] = (write) or += (not) the push's value of element start + j times its scale (codes: their
 * block's, s[i / bs]; values: the one weight s[0]) over [start, stop), each product rounded
 * before its add. `q` holds stop - start codes. */
INLINE void push_into(const void *data, int kind, const float *s, int64_t start, int64_t stop,
                      int64_t bs, float *restrict o, int write, int8_t *restrict q) {
    int64_t m = stop - start;
    if (kind == PUSH_BF16) {
        const uint16_t *v = (const uint16_t *)data + start;
        float w = s[0];
        if (write)
            for (int64_t j = 0; j < m; j++) o[j] = bf16_to_f32(v[j]) * w;
        else
            for (int64_t j = 0; j < m; j++) o[j] = o[j] + bf16_to_f32(v[j]) * w;
        return;
    }
    if (kind == PUSH_FP32) {
        const float *v = (const float *)data + start;
        float w = s[0];
        if (write)
            for (int64_t j = 0; j < m; j++) o[j] = v[j] * w;
        else
            for (int64_t j = 0; j < m; j++) o[j] = o[j] + v[j] * w;
        return;
    }
    codes_of((const uint8_t *)data, kind == PUSH_INT4, start, stop, q);
    for (int64_t i = start; i < stop;) {
        int64_t b = i / bs;
        int64_t end = (b + 1) * bs < stop ? (b + 1) * bs : stop;
        float sc = s[b];
        const int8_t *qi = q + (i - start);
        float *oi = o + (i - start);
        int64_t k = end - i;
        if (write)
            for (int64_t j = 0; j < k; j++) oi[j] = (float)qi[j] * sc;
        else
            for (int64_t j = 0; j < k; j++) oi[j] = oi[j] + (float)qi[j] * sc;
        i = end;
    }
}

/* out[i] = sum over pushes k, in order, of push k's value of element i times its scale
 * (`push_into`) over [0, n): the first push written (overwrite) or added, each later one
 * added: ((a0 + a1) + a2) ... with every product rounded before its add. Walked run by run so
 * `out` is read and written once. */
KERNEL void diloco_accumulate(int npush, const void *const *data, const int *kind,
                       const float *const *scales, int64_t n, int64_t bs, float *out,
                       int overwrite) {
    int8_t q[RUN];
    for (int64_t start = 0; start < n; start += RUN) {
        int64_t stop = start + RUN < n ? start + RUN : n;
        for (int k = 0; k < npush; k++)
            push_into(data[k], kind[k], scales[k], start, stop, bs, out + start,
                      overwrite && k == 0, q);
    }
}

#define LANES 16 /* partial sums of squares: independent adds, so a pass runs at memory speed */
typedef float v8f __attribute__((vector_size(32)));

/* The greatest |x| over n values, bfloat16 (`bf16`) or FP32, taken on the bits (NaN or Inf
 * where one is not finite): what bounds a push of values in the merged delta. With `squares`,
 * also the sum of their squares into *squares, in the same pass (a received push's check and
 * norm): run by run, squared and summed in FP32 in LANES lanes, each lane's sum then added
 * into a double lane (a run whose FP32 sums overflow, which takes values beyond about 1e17,
 * summed in double instead), and the lanes added in order at the end: a fixed order, the same
 * bits on every machine. */
KERNEL float diloco_absmax(const void *data, int bf16, int64_t n, double *squares) {
    uint32_t top = 0;
    double lanes[LANES] = {0};
    const uint16_t *v16 = (const uint16_t *)data;
    const uint32_t *v32 = (const uint32_t *)data;
    for (int64_t start = 0; start < n; start += RUN) {
        int64_t stop = start + RUN < n ? start + RUN : n;
        if (bf16) {
            uint16_t top16 = 0;
            for (int64_t i = start; i < stop; i++) {
                uint16_t bits = v16[i] & 0x7FFFu;
                top16 = bits > top16 ? bits : top16;
            }
            top = ((uint32_t)top16 << 16) > top ? (uint32_t)top16 << 16 : top;
        } else
            for (int64_t i = start; i < stop; i++) {
                uint32_t bits = v32[i] & 0x7FFFFFFFu;
                top = bits > top ? bits : top;
            }
        if (!squares) continue;
        float buf[RUN];
        const float *f = (const float *)data + start;
        int64_t m = stop - start;
        if (bf16) {
            for (int64_t j = 0; j < m; j++) buf[j] = bf16_to_f32(v16[start + j]);
            f = buf;
        }
        /* two vectors of 8 partial sums (GCC and clang vector types: element-wise IEEE
         * operations, as the loop they replace; the loop itself is not vectorised) */
        v8f p0 = {0}, p1 = {0};
        int64_t j = 0;
        for (; j + LANES <= m; j += LANES) {
            v8f a, b;
            memcpy(&a, f + j, sizeof a);
            memcpy(&b, f + j + 8, sizeof b);
            p0 = p0 + a * a;
            p1 = p1 + b * b;
        }
        float part[LANES];
        memcpy(part, &p0, sizeof p0);
        memcpy(part + 8, &p1, sizeof p1);
        for (; j < m; j++) part[0] = part[0] + f[j] * f[j];
        uint32_t worst = 0; /* a part that overflowed (squares beyond FP32): the run in double */
        for (int l = 0; l < LANES; l++) {
            uint32_t bits;
            memcpy(&bits, &part[l], sizeof bits);
            worst = (bits & 0x7FFFFFFFu) > worst ? bits & 0x7FFFFFFFu : worst;
        }
        if (worst < 0x7F800000u)
            for (int l = 0; l < LANES; l++) lanes[l] = lanes[l] + (double)part[l];
        else
            for (j = 0; j < m; j++) lanes[0] = lanes[0] + (double)f[j] * (double)f[j];
    }
    if (squares) {
        double sum = 0.0;
        for (int l = 0; l < LANES; l++) sum = sum + lanes[l];
        *squares = sum;
    }
    float amax;
    memcpy(&amax, &top, sizeof amax);
    return amax;
}

/* s[i] / total over [0, n), in place; returns the greatest |result| (NaN or Inf where one is
 * not finite): the merged delta and what `unappliable` judges it by, in one pass. */
KERNEL float diloco_merge(float *s, int64_t n, float total) {
    uint32_t top = 0;
    for (int64_t i = 0; i < n; i++) {
        float g = s[i] / total;
        s[i] = g;
        uint32_t bits;
        memcpy(&bits, &g, sizeof bits);
        bits &= 0x7FFFFFFFu; /* |g|: finite ones order as integers, Inf and NaN above them */
        top = bits > top ? bits : top;
    }
    float amax;
    memcpy(&amax, &top, sizeof amax);
    return amax;
}

/* One Nesterov outer step taken through an INT8 update chain, block by block:
 *
 *     m <- mu * m + g;  d <- g + nu * m          (Nesterov; d <- g without: SGD)
 *     u <- r + factor * d                        (the update, with the carried residual r)
 *     codes, scale <- INT8 absmax encoding of u  (scale = max|u| / 127 per block)
 *     p <- p + codes * scale;  r <- u - codes * scale
 *
 * `params`, `momentum` (unused without `nesterov`) and `grad` are FP32; the residual is bfloat16
 * (`residual_bf16`) or FP32; `codes` (n bytes) and `scales` (ceil(n / bs)) are the link's
 * encoding. nu is mu for a whole outer step; a partial one (`synchronizer.shares`) decays the
 * momentum less and looks ahead less (mu = mu0^s, nu = s * mu0). `scratch` holds one block of u
 * (bs floats). Returns 0, or -1 if some block of u is
 * not finite (parameters and state are then partly written, as the torch path leaves them). */
INLINE int chain_block(float *params, float *momentum, const float *grad,
                       uint16_t *r16, float *r32, int8_t *codes, float *scale_out,
                       int64_t m, float factor, int nesterov, int bf16, float mu,
                       float nu, float *restrict u) {
    if (nesterov)
        for (int64_t j = 0; j < m; j++) {
            float g = grad[j];
            float mom = mu * momentum[j] + g;
            momentum[j] = mom;
            u[j] = g + nu * mom;
        }
    else
        for (int64_t j = 0; j < m; j++) u[j] = grad[j];
    if (bf16)
        for (int64_t j = 0; j < m; j++) u[j] = bf16_to_f32(r16[j]) + factor * u[j];
    else
        for (int64_t j = 0; j < m; j++) u[j] = r32[j] + factor * u[j];
    /* max |u| on the bits: for finite floats of one sign, integer order is float order */
    uint32_t top = 0;
    for (int64_t j = 0; j < m; j++) {
        uint32_t bits;
        memcpy(&bits, &u[j], sizeof bits);
        bits &= 0x7FFFFFFFu;
        top = bits > top ? bits : top;
    }
    if (top >= 0x7F800000u) return -1; /* Inf or NaN */
    float amax;
    memcpy(&amax, &top, sizeof amax);
    float scale = amax / 127.0f;
    float div = scale > 0.0f ? scale : 1.0f;
    *scale_out = scale;
    for (int64_t j = 0; j < m; j++) {
        float q = round_even(u[j] / div);
        codes[j] = (int8_t)q;
        float v = q * scale;
        params[j] = params[j] + v;
        u[j] = u[j] - v;
    }
    if (bf16)
        for (int64_t j = 0; j < m; j++) r16[j] = f32_to_bf16(u[j]);
    else
        for (int64_t j = 0; j < m; j++) r32[j] = u[j];
    return 0;
}

/* chain_block with its branches resolved: one call per combination, so each inlined copy has
 * no branch in its loops. */
INLINE int chain_dispatch(float *params, float *momentum, const float *grad, uint16_t *r16,
                          float *r32, int8_t *codes, float *scale_out, int64_t m,
                          float factor, int nesterov, int bf16, float mu,
                          float nu, float *restrict u) {
    if (nesterov && bf16)
        return chain_block(params, momentum, grad, r16, NULL, codes, scale_out, m, factor, 1, 1,
                           mu, nu, u);
    if (nesterov)
        return chain_block(params, momentum, grad, NULL, r32, codes, scale_out, m, factor, 1, 0,
                           mu, nu, u);
    if (bf16)
        return chain_block(params, momentum, grad, r16, NULL, codes, scale_out, m, factor, 0, 1,
                           mu, nu, u);
    return chain_block(params, momentum, grad, NULL, r32, codes, scale_out, m, factor, 0, 0, mu,
                       nu, u);
}

KERNEL int diloco_chain_int8(const float *grad, float *params, float *momentum, void *residual,
                      int residual_bf16, int8_t *codes, float *scales, int64_t n, int64_t bs,
                      float factor, int nesterov, float mu, float nu, float *scratch) {
    uint16_t *r16 = (uint16_t *)residual;
    float *r32 = (float *)residual;
    for (int64_t start = 0, b = 0; start < n; start += bs, b++) {
        int64_t m = start + bs < n ? bs : n - start;
        float *mom = nesterov ? momentum + start : momentum;
        if (chain_dispatch(params + start, mom, grad + start,
                           residual_bf16 ? r16 + start : NULL, residual_bf16 ? NULL : r32 + start,
                           codes + start, scales + b, m, factor, nesterov, residual_bf16, mu,
                           nu, scratch))
            return -1;
    }
    return 0;
}

/* A whole round's outer step from its pushes, block by block, with no FP32 sums in memory:
 * each block of the merged delta is made in `scratch` exactly as `diloco_accumulate` (pushes
 * 0..nsum-1, the first written), `diloco_merge` (divided by `total`) and then
 * `diloco_accumulate` again (pushes nsum..npush-1 added: the re-anchoring links) make it, and
 * taken through `diloco_chain_int8`'s step at once. Pushes of codes have block size `bs` (at
 * most RUN), the chain's own. The caller has shown the merged delta appliable from the scales
 * and weights alone (nothing here checks its range). `scratch` holds 2 * bs floats. Returns
 * as `diloco_chain_int8`. */
KERNEL int diloco_step_int8(int npush, int nsum, const void *const *data, const int *kind,
                     const float *const *scales, float total, float *params, float *momentum,
                     void *residual, int residual_bf16, int8_t *out_codes, float *out_scales,
                     int64_t n, int64_t bs, float factor, int nesterov, float mu,
                     float nu, float *scratch) {
    uint16_t *r16 = (uint16_t *)residual;
    float *r32 = (float *)residual;
    float *g = scratch, *u = scratch + bs;
    int8_t q[RUN];
    if (bs > RUN || npush < 1 || nsum < 1 || nsum > npush) return -2;
    for (int64_t start = 0, b = 0; start < n; start += bs, b++) {
        int64_t m = start + bs < n ? bs : n - start;
        for (int k = 0; k < npush; k++) {
            push_into(data[k], kind[k], scales[k], start, start + m, bs, g, k == 0, q);
            if (k == nsum - 1)
                for (int64_t j = 0; j < m; j++) g[j] = g[j] / total;
        }
        float *mom = nesterov ? momentum + start : momentum;
        if (chain_dispatch(params + start, mom, g, residual_bf16 ? r16 + start : NULL,
                           residual_bf16 ? NULL : r32 + start, out_codes + start, out_scales + b,
                           m, factor, nesterov, residual_bf16, mu, nu, u))
            return -1;
    }
    return 0;
}

/* crc32 as zlib computes it (the reflected polynomial 0xEDB88320, `value` the crc of what came
 * before, 0 to start), by folding 64 bytes at a time with carry-less multiplication where the
 * CPU has it (x86-64 with PCLMULQDQ and SSE4.1): the checksums of the write-ahead log and of a
 * version's parameters, several times faster than zlib's tables. The constants are x^d mod P,
 * bit-reflected, for d = 544 and 480 (folding 64 bytes ahead), 160 and 96 (16 bytes) and 64,
 * then Barrett's mu and P, as in Intel's "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ". `diloco_crc32_fast` says whether the folding path is there; without it the
 * caller uses zlib (the bitwise loop below only takes the bytes around the folded ones). */
INLINE uint32_t crc_bits(uint32_t c, const uint8_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    }
    return c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CRC_FOLD 1

#define CRC_FOLD_INTO(x, k, next)                                                             \
    do {                                                                                      \
        __m128i lo_ = _mm_clmulepi64_si128((x), (k), 0x00);                                   \
        (x) = _mm_clmulepi64_si128((x), (k), 0x11);                                           \
        (x) = _mm_xor_si128(_mm_xor_si128((x), lo_), (next));                                 \
    } while (0)

/* The crc state (not inverted) after `len` bytes, len >= 64 and a multiple of 16. */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_fold(uint32_t c, const uint8_t *p,
                                                                   int64_t len) {
    __m128i x1 = _mm_loadu_si128((const __m128i *)p);
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)c));
    __m128i k = _mm_set_epi64x(0x00000001c6e41596LL, 0x0000000154442bd4LL);
    p += 64;
    len -= 64;
    while (len >= 64) {
        CRC_FOLD_INTO(x1, k, _mm_loadu_si128((const __m128i *)p));
        CRC_FOLD_INTO(x2, k, _mm_loadu_si128((const __m128i *)(p + 16)));
        CRC_FOLD_INTO(x3, k, _mm_loadu_si128((const __m128i *)(p + 32)));
        CRC_FOLD_INTO(x4, k, _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        len -= 64;
    }
    k = _mm_set_epi64x(0x00000000ccaa009eLL, 0x00000001751997d0LL);
    CRC_FOLD_INTO(x1, k, x2);
    CRC_FOLD_INTO(x1, k, x3);
    CRC_FOLD_INTO(x1, k, x4);
    while (len >= 16) {
        CRC_FOLD_INTO(x1, k, _mm_loadu_si128((const __m128i *)p));
        p += 16;
        len -= 16;
    }
    /* 128 bits to 64 (appending 32 zero bits), then to 32, then Barrett's reduction */
    const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
    __m128i t = _mm_clmulepi64_si128(x1, k, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), t);
    t = _mm_srli_si128(x1, 4);
    x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32),
                              _mm_set_epi64x(0, 0x0000000163cd6124LL), 0x00);
    x1 = _mm_xor_si128(x1, t);
    const __m128i poly = _mm_set_epi64x(0x00000001f7011641LL, 0x00000001db710641LL);
    t = x1;
    x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x10);
    x1 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x00);
    x1 = _mm_xor_si128(x1, t);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}
#endif

int diloco_crc32_fast(void) {
#ifdef CRC_FOLD
    __builtin_cpu_init();
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#else
    return 0;
#endif
}

uint32_t diloco_crc32(uint32_t value, const uint8_t *p, int64_t len) {
    uint32_t c = ~value;
#ifdef CRC_FOLD
    if (len >= 64 && diloco_crc32_fast()) {
        int64_t folded = len & ~(int64_t)15;
        c = crc_fold(c, p, folded);
        p += folded;
        len -= folded;
    }
#endif
    return ~crc_bits(c, p, len);
}
