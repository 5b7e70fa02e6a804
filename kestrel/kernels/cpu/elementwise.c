/* A decoder layer's elementwise ops on the CPU in one pass each, float32: `rms_norm_ref`'s RMSNorm (with the
 * residual add, and Gemma's unit offset) and `act_mul_ref`'s SiLU-and-multiply (kestrel/kernels/norm.py,
 * kestrel/kernels/activation.py). The PyTorch references make four to six passes over a row, each allocating.
 *
 * Rows run in parallel on torch's OpenMP pool (see native.py); a row is one thread's, and its sum of squares uses 16
 * independent partial sums combined in a fixed order, so results depend neither on the thread count nor on
 * fast-math flags. exp is the same range-reduced polynomial as paged_attention.c's (within ~2 ulp).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define PARALLEL_FROM 32768 /* elements: smaller calls stay on the calling thread */

static inline float exp_poly(float x) {
    x = x > -87.0f ? x : -87.0f;
    x = x < 88.0f ? x : 88.0f;
    const float fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const int n = (int)fn;
    float r = x - fn * 0.693145751953125f;
    r = r - fn * 1.428606765330187045e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = (int32_t)((uint32_t)(n + 127) << 23);
    float scale_f;
    memcpy(&scale_f, &bits, sizeof scale_f);
    return p * scale_f;
}

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
        for (int j = 0; j < inter; j++)
            o[j] = gate[j] / (1.0f + exp_poly(-gate[j])) * up[j];
    }
    return 0;
}
