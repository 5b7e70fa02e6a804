/* A decoder layer's elementwise ops on the CPU in one pass each, float32: `rms_norm_ref`'s RMSNorm (with the
 * residual add, and Gemma's unit offset), `act_mul_ref`'s SiLU-and-multiply and `rope_store_kv_ref`'s RoPE with the
 * paged KV write (kestrel/kernels/norm.py, activation.py, rope_kv.py). The PyTorch references make four to six
 * passes over a row, each allocating.
 *
 * No multiply-add is contracted into an FMA (the pragmas below), so RoPE's `x1 * cos - x2 * sin` rounds as the
 * reference's separate tensor ops do and its results are bit-identical.
 *
 * Rows run in parallel on torch's OpenMP pool (see native.py); a row is one thread's, and its sum of squares uses 16
 * independent partial sums combined in a fixed order, so results depend neither on the thread count nor on
 * fast-math flags. exp is cpu_math.h's range-reduced polynomial (within ~2 ulp).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define PARALLEL_FROM 32768 /* elements: smaller calls stay on the calling thread */

static void rms_norm_row(const float *restrict x, const float *restrict residual, const float *restrict weight,
                         float *restrict out, float *restrict residual_out, int dim, float eps, int unit_offset) {
    float part[LANES] = {0};
    const float *src = x;
    if (residual != NULL) {
        for (int i = 0; i < dim; i++)
            residual_out[i] = x[i] + residual[i];
        src = residual_out;
    }
    int i = 0;
    for (; i + LANES <= dim; i += LANES)
        for (int l = 0; l < LANES; l++)
            part[l] += src[i + l] * src[i + l];
    float sum = 0.0f;
    for (; i < dim; i++)
        sum += src[i] * src[i];
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++)
            part[l] += part[l + w];
    sum += part[0];
    const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    if (unit_offset) {
        for (int j = 0; j < dim; j++)
            out[j] = (src[j] * inv) * (1.0f + weight[j]);
    } else {
        for (int j = 0; j < dim; j++)
            out[j] = weight[j] * (src[j] * inv);
    }
}

/* out[r] = norm(x[r] (+ residual[r])) * weight; with a residual, residual_out[r] = x[r] + residual[r]. Rows are
 * contiguous, `dim` floats each. */
int kestrel_rms_norm(const float *x, const float *residual, const float *weight, float *out, float *residual_out,
                     long rows, int dim, float eps, int unit_offset, int threads) {
    if (dim <= 0 || rows < 0 || (residual != NULL && residual_out == NULL))
        return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * (long)dim >= PARALLEL_FROM && threads > 1)
    for (long r = 0; r < rows; r++)
        rms_norm_row(x + r * dim, residual ? residual + r * dim : NULL, weight, out + r * dim,
                     residual ? residual_out + r * dim : NULL, dim, eps, unit_offset);
    return 0;
}

/* out[r, j] = silu(x[r, j]) * x[r, inter + j] for x rows of 2 * inter floats. */
int kestrel_silu_mul(const float *x, float *out, long rows, int inter, int threads) {
    if (inter <= 0 || rows < 0)
        return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * (long)inter >= PARALLEL_FROM && threads > 1)
    for (long r = 0; r < rows; r++) {
        const float *restrict gate = x + r * 2 * (long)inter;
        const float *restrict up = gate + inter;
        float *restrict o = out + r * (long)inter;
        /* The exps first, then the divisions, in chunks: in one loop GCC divides once per clamp case of the
         * inlined exp (3x slower). The same operations, so the same results, as `gate / (1 + e) * up` in one loop. */
        float denom[64];
        for (int j0 = 0; j0 < inter; j0 += 64) {
            const int m = inter - j0 < 64 ? inter - j0 : 64;
            for (int j = 0; j < m; j++)
                denom[j] = 1.0f + exp_poly(-gate[j0 + j]);
            for (int j = 0; j < m; j++)
                o[j0 + j] = gate[j0 + j] / denom[j] * up[j0 + j];
        }
    }
    return 0;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);       /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

static inline void store_row(void *cache, int cache_bf16, long offset, const float *restrict src, int n) {
    if (cache_bf16) {
        uint16_t *restrict dst = (uint16_t *)cache + offset;
        for (int i = 0; i < n; i++)
            dst[i] = float_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + offset, src, (size_t)n * sizeof(float));
    }
}

/* NeoX-style rotation of one head: the first rotary_dim / 2 features pair with the next rotary_dim / 2. */
static inline void rotate_head(const float *restrict x, float *restrict out, const float *restrict c,
                               const float *restrict s, int half, int rotary_dim, int head_size) {
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[half + i];
        out[i] = x1 * c[i] - x2 * s[i];
        out[half + i] = x2 * c[i] + x1 * s[i];
    }
    for (int i = rotary_dim; i < head_size; i++)
        out[i] = x[i];
}

/* Rotated q into q_out [tokens, heads * head_size]; rotated k and v into the caches [blocks, block_size, kv_heads,
 * head_size] (float32 or bf16) at slots[t] (-1: nowhere). q, k, v rows are `*_stride` floats apart. Returns 2 when
 * a position or a slot is out of range (nothing is then guaranteed written). */
int kestrel_rope_store_kv(const float *q, long q_stride, const float *k, long k_stride, const float *v,
                          long v_stride, const int64_t *positions, const float *cos_cache, const float *sin_cache,
                          long table_rows, float *q_out, void *k_cache, void *v_cache, int cache_bf16,
                          const int64_t *slots, long num_slots, long tokens, int heads, int kv_heads, int head_size,
                          int rotary_dim, int threads) {
    if (rotary_dim <= 0 || rotary_dim % 2 || rotary_dim > head_size || head_size > 1024)
        return 1;
    const int half = rotary_dim / 2;
    int status = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : status) \
    if (tokens * (long)(heads + 2 * kv_heads) * head_size >= PARALLEL_FROM && threads > 1)
    for (long t = 0; t < tokens; t++) {
        const int64_t pos = positions[t], slot = slots[t];
        if (pos < 0 || pos >= table_rows || slot >= num_slots) {
            status |= 2;
            continue;
        }
        const float *c = cos_cache + pos * half, *s = sin_cache + pos * half;
        for (int h = 0; h < heads; h++)
            rotate_head(q + t * q_stride + (long)h * head_size, q_out + (t * heads + h) * (long)head_size, c, s,
                        half, rotary_dim, head_size);
        if (slot < 0)
            continue;
        float rotated[1024];
        for (int h = 0; h < kv_heads; h++) {
            const long offset = (slot * kv_heads + h) * (long)head_size;
            rotate_head(k + t * k_stride + (long)h * head_size, rotated, c, s, half, rotary_dim, head_size);
            store_row(k_cache, cache_bf16, offset, rotated, head_size);
            store_row(v_cache, cache_bf16, offset, v + t * v_stride + (long)h * head_size, head_size);
        }
    }
    return status;
}
