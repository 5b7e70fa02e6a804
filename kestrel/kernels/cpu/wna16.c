/* The weight-only GEMM with 4-bit integer weights (int4 / uint4, kestrel/kernels/wna16.py's layout) on the CPU.
 *
 * `wna16_gemm_ref`, the PyTorch path, unpacks and scales the whole weight into a float32 copy on every call (eight
 * shifts and masks over the int32 words, a gather of the group scales): at one activation row it took 11-92x the
 * time of a bfloat16 `F.linear` of Qwen2-0.5B's linear shapes (benchmarks/results/cpu-w4a16/). Here:
 *
 * - `kestrel_w4_gemv` (a few rows, decode): reads the packed words, BLOCK_N columns at a time, and multiplies each
 *   nibble's value `c - z` by the row's x in float32, summing a group's products before its scale; rows one after
 *   another (the block's words stay in cache). Column blocks run in parallel on torch's OpenMP pool.
 * - `kestrel_w4_dequant` (more rows): writes a column chunk of the float32 weight in one pass, for the caller's
 *   matmul of that chunk.
 *
 * Layout (see wna16.py): `qweight` int32 `[K / 8, N]`, word (j, n) holding rows 8j .. 8j+7 of column n at bits
 * 4 (k - 8j); `scales` float32 `[K / group, N]`; `zeros` int8 `[K / group, N]` or NULL (int4: the codes minus 8).
 * `x` float32 `[M, K]`, already gathered by the act-order permutation; `out` float32 `[M, N]`.
 *
 * Numerics: every product (c - z) * x is exact in float32 when x came from a 16-bit dtype; the gemv sums them in
 * float32 per group and scales each group's sum once, where the reference rounds every x * s * (c - z): both
 * float32-accurate, not bit-identical. The dequantized weight is the reference's, value for value.
 */
#include <stdint.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define BLOCK_N 64
#define PARALLEL_FROM (1 << 20) /* values of the whole weight: smaller weights stay on the calling thread */

/* Nibble s of `word` minus its zero point: c - z, exact in float32. The code goes through int32 on its way to
 * float: AVX2 converts signed integers only. */
static inline float nibble_value(int32_t word, int s, float zero) {
    return (float)(int32_t)(((uint32_t)word >> (4 * s)) & 15u) - zero;
}

/* The zero points of group g for columns [col, col + width): the checkpoint's, or `default_zero` for all. */
static inline void group_zeros(float *restrict zero, const int8_t *restrict zeros, float default_zero, long g,
                               long N, long col, int width) {
    for (int i = 0; i < width; i++)
        zero[i] = zeros != NULL ? (float)zeros[g * N + col + i] : default_zero;
}

/* Every row of x times columns [n0, n0 + width), one row at a time (a version sharing each decode across up to
 * eight rows measured slower here). */
static void gemv_block(const float *restrict x, const int32_t *restrict qweight, const float *restrict scales,
                       const int8_t *restrict zeros, float default_zero, float *restrict out, long M, long K,
                       long N, long group, long n0, int width) {
    const long words_per_group = group / 8;
    for (long m = 0; m < M; m++) {
        const float *xm = x + m * K;
        float total[BLOCK_N] = {0};
        for (long g = 0; g < K / group; g++) {
            float zero[BLOCK_N];
            group_zeros(zero, zeros, default_zero, g, N, n0, width);
            float acc[BLOCK_N] = {0};
            for (long j = g * words_per_group; j < (g + 1) * words_per_group; j++) {
                const int32_t *row = qweight + j * N + n0;
                const float *xs = xm + 8 * j;
                for (int s = 0; s < 8; s++) {
                    const float xv = xs[s];
                    for (int i = 0; i < width; i++)
                        acc[i] += xv * nibble_value(row[i], s, zero[i]);
                }
            }
            const float *sc = scales + g * N + n0;
            for (int i = 0; i < width; i++)
                total[i] += acc[i] * sc[i];
        }
        memcpy(out + m * N + n0, total, (size_t)width * sizeof(float));
    }
}

int kestrel_w4_gemv(const float *x, const int32_t *qweight, const float *scales, const int8_t *zeros,
                    float default_zero, float *out, long M, long K, long N, long group, int threads) {
    if (M < 0 || K <= 0 || N <= 0 || group <= 0 || group % 8 || K % group)
        return 1;
    const long blocks = (N + BLOCK_N - 1) / BLOCK_N;
    const int parallel = K * N >= PARALLEL_FROM && threads > 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (long b = 0; b < blocks; b++) {
        const long n0 = b * BLOCK_N;
        const int width = (int)(N - n0 < BLOCK_N ? N - n0 : BLOCK_N);
        gemv_block(x, qweight, scales, zeros, default_zero, out, M, K, N, group, n0, width);
    }
    return 0;
}

/* Columns [n0, n0 + width) of the float32 weight `[K, N]`, written as `out [K, width]` (a caller's column chunk, so
 * the weight is never materialized whole). */
int kestrel_w4_dequant(const int32_t *qweight, const float *scales, const int8_t *zeros, float default_zero,
                       float *out, long K, long N, long group, long n0, long width, int threads) {
    if (K <= 0 || N <= 0 || group <= 0 || group % 8 || K % group || n0 < 0 || width <= 0 || n0 + width > N)
        return 1;
    const int parallel = K * N >= PARALLEL_FROM && threads > 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (long j = 0; j < K / 8; j++) {
        const long g = (8 * j) / group;
        const int32_t *row = qweight + j * N + n0;
        const float *sc = scales + g * N + n0;
        float zero[BLOCK_N];
        for (long c0 = 0; c0 < width; c0 += BLOCK_N) {
            const int w = (int)(width - c0 < BLOCK_N ? width - c0 : BLOCK_N);
            group_zeros(zero, zeros, default_zero, g, N, n0 + c0, w);
            for (int s = 0; s < 8; s++) {
                float *dst = out + (8 * j + s) * width + c0;
                for (int i = 0; i < w; i++)
                    dst[i] = sc[c0 + i] * nibble_value(row[c0 + i], s, zero[i]);
            }
        }
    }
    return 0;
}
