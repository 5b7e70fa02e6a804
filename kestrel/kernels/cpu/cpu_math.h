/* Scalar math shared by the C kernels of kestrel/kernels/cpu/ (each compiled as its own library by native.py,
 * whose build key covers this header too). Written as plain arithmetic so that loops calling it vectorize. */
#ifndef KESTREL_CPU_MATH_H
#define KESTREL_CPU_MATH_H

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 88, within ~2 ulp; inputs below -87 give ~1e-38 (only soft-cap's tanh and the max-subtracted
 * scores use it, where such values are zeros to float32 rounding). */
static inline float exp_poly(float x) {
    x = x > -87.0f ? x : -87.0f; /* written so that NaN (a masked lane's -inf - -inf) also becomes finite */
    x = x < 88.0f ? x : 88.0f;
    /* round to nearest by adding and removing 1.5 * 2^23 (|x * log2 e| < 2^22) */
    const float fn = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const int n = (int)fn;
    float r = x - fn * 0.693145751953125f;
    r = r - fn * 1.428606765330187045e-06f;
    /* |r| <= ln2/2: Taylor to degree 7 (relative error < 2e-9 before rounding) */
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

#endif
