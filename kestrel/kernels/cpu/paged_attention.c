/* Paged attention on the CPU, read straight from the block cache: `paged_attention_ref`'s semantics
 * (kestrel/kernels/attention.py) for float32 queries and output and a float32 or bfloat16 cache.
 *
 * Work item: one sequence, one KV head, the query heads of its group and up to ROW_TILE / group consecutive query
 * rows of the sequence. The item walks its keys in tiles (at most TILE keys, never crossing a block); each tile is
 * read from the cache once (bf16 widened to float once) and used by all the item's rows while it is in L1. Each
 * packed row (query row, head) keeps an online softmax: running max, running sum and a D-float accumulator.
 *
 * Two ways through a tile:
 * - few packed rows (decodes, short chunks): one row at a time, scoring eight visible keys at a time (`row_scores`);
 *   a row visits only the keys it may see (its causal end, the window's start), so nothing is masked, and the
 *   item asks for its next block while it works on this one;
 * - prefill chunks (at least a third of ROW_TILE packed rows): the rows are the vector lanes. The item's queries are
 *   transposed once (`qt[dim][row]`), a tile's scores are 32-lane multiply-adds with no sum across lanes, and the
 *   softmax runs across rows too, invisible keys getting probability 0 through a select.
 *
 * Loops run over D or over rows innermost, with restrict pointers or GNU C vector types (the accumulators that must
 * stay in registers), so they vectorize without reassociating any sum: the result does not depend on fast-math
 * flags, nor on the thread count (an item is one thread's). exp is a range-reduced polynomial written as plain
 * arithmetic, so the score loops vectorize too (libm's expf is a scalar call).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define TILE 16     /* keys per step */
#define ROW_TILE 32 /* packed rows (query rows x group heads) per work item */
#define LANES 16
#define MAX_D 512

/* GNU C vectors one register wide: 16 floats with AVX-512, else 8 (AVX2's). Accumulators that are plain arrays
 * stay in memory, each update a store and a reload; these stay in registers. The unaligned variant loads and stores
 * at any float address. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vfw __attribute__((vector_size(VW * 4)));
typedef float vfwu __attribute__((vector_size(VW * 4), aligned(4)));
typedef float vf8 __attribute__((vector_size(32)));
#define VMAX_D 256 /* head sizes up to this, multiples of VW, take the vector paths */
#define ROW_VECTORS (ROW_TILE / VW) /* vectors of one key's scores over the packed rows */
#define ROW_KEYS (8 / ROW_VECTORS)  /* keys a step of scores_by_rows takes: eight accumulators in all */

/* q . k over d floats where the vector path does not apply: LANES independent partial sums, so the loop vectorizes
 * without reassociating a sum. */
static inline float dot(const float *restrict a, const float *restrict b, int d) {
    float part[LANES] = {0};
    int i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int l = 0; l < LANES; l++)
            part[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (; i < d; i++)
        s += a[i] * b[i];
    for (int l = 0; l < LANES; l++)
        s += part[l];
    return s;
}

/* The decode path scores eight keys at a time, each key's products summed in a register's lanes, the eight keys'
 * lane sums then formed together by shuffles (one vector of eight scores), instead of spilling each key's lanes to
 * memory to add them one by one. */
static inline vf8 fold_to8(vfw x) {
#if VW == 16
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return x;
#endif
}

/* [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] (x86's horizontal add) */
static inline vf8 pair_sums(vf8 a, vf8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* lane j: the sum of the lanes of a_j */
static inline vf8 lane_sums8(vf8 a0, vf8 a1, vf8 a2, vf8 a3, vf8 a4, vf8 a5, vf8 a6, vf8 a7) {
    const vf8 u = pair_sums(pair_sums(a0, a1), pair_sums(a2, a3));
    const vf8 v = pair_sums(pair_sums(a4, a5), pair_sums(a6, a7));
    return __builtin_shufflevector(u, v, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u, v, 4, 5, 6, 7, 12, 13, 14, 15);
}

static inline float lane_sum(vfw x) {
    vf8 y = fold_to8(x);
    y += __builtin_shufflevector(y, y, 4, 5, 6, 7, 0, 1, 2, 3);
    y += __builtin_shufflevector(y, y, 2, 3, 0, 1, 6, 7, 4, 5);
    y += __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6);
    return y[0];
}

/* p[j] = (q . k_j) * scale for n keys k_j = k_rows + j * k_stride */
static inline __attribute__((always_inline)) void row_scores(float *restrict p, const float *restrict q,
                                                             const float *restrict k_rows, long k_stride, int n,
                                                             const int d, float scale) {
    if (d % VW != 0 || d > VMAX_D) {
        for (int j = 0; j < n; j++)
            p[j] = dot(q, k_rows + j * k_stride, d) * scale;
        return;
    }
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const float *restrict k = k_rows + j * k_stride;
        vfw a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
        for (int c = 0; c < d; c += VW) {
            const vfw qc = *(const vfwu *)(q + c);
            a0 += qc * *(const vfwu *)(k + c);
            a1 += qc * *(const vfwu *)(k + k_stride + c);
            a2 += qc * *(const vfwu *)(k + 2 * k_stride + c);
            a3 += qc * *(const vfwu *)(k + 3 * k_stride + c);
            a4 += qc * *(const vfwu *)(k + 4 * k_stride + c);
            a5 += qc * *(const vfwu *)(k + 5 * k_stride + c);
            a6 += qc * *(const vfwu *)(k + 6 * k_stride + c);
            a7 += qc * *(const vfwu *)(k + 7 * k_stride + c);
        }
        const vf8 s = lane_sums8(fold_to8(a0), fold_to8(a1), fold_to8(a2), fold_to8(a3), fold_to8(a4), fold_to8(a5),
                                 fold_to8(a6), fold_to8(a7)) * scale;
        memcpy(p + j, &s, sizeof s);
    }
    for (; j < n; j++) {
        const float *restrict k = k_rows + j * k_stride;
        vfw acc = {0};
        for (int c = 0; c < d; c += VW)
            acc += *(const vfwu *)(q + c) * *(const vfwu *)(k + c);
        p[j] = lane_sum(acc) * scale;
    }
}

/* cap * tanh(x / cap): an odd Taylor polynomial near 0, where 1 - 2 / (exp(2y) + 1) would cancel, that form
 * elsewhere (saturating to +-cap, never NaN). Both are computed so the loop vectorizes with a select. */
static inline float soft_cap_score(float x, float cap, float inv_cap) {
    const float y = x * inv_cap;
    const float y2 = y * y;
    float p = -929569.0f / 638512875.0f;
    p = p * y2 + 21844.0f / 6081075.0f;
    p = p * y2 - 1382.0f / 155925.0f;
    p = p * y2 + 62.0f / 2835.0f;
    p = p * y2 - 17.0f / 315.0f;
    p = p * y2 + 2.0f / 15.0f;
    p = p * y2 - 1.0f / 3.0f;
    const float near = y + y * y2 * p;
    const float far = 1.0f - 2.0f / (exp_poly(2.0f * y) + 1.0f);
    return cap * (y2 < 0.16f ? near : far);
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void widen_bf16(float *restrict dst, const uint16_t *restrict src, int n_tok, long tok_stride, int d) {
    for (int j = 0; j < n_tok; j++)
        for (int i = 0; i < d; i++)
            dst[(long)j * d + i] = bf16_to_float(src[j * tok_stride + i]);
}

typedef struct {
    const float *q;
    float *out;
    const void *k_cache;
    const void *v_cache;
    int cache_bf16;
    long stride_block; /* elements */
    long stride_tok;
    const int32_t *query_start_loc;
    const int32_t *seq_lens;
    const int32_t *block_tables;
    long table_stride;
    int num_heads;
    int num_kv_heads;
    int head_size;
    int block_size;
    float scale; /* times k_scale */
    float v_scale;
    int window;    /* 0: none */
    float soft_cap; /* 0: none */
} Args;

typedef struct {
    int seq;
    int kv_head;
    int row0;
    int row1;
} Item;

/* Scratch of one thread: the item's accumulators and softmax state, its transposed queries, one tile's scores and
 * one tile of widened keys and values. */
typedef struct {
    float *acc;        /* [max(ROW_TILE, group)][d] */
    float *m;          /* [max(ROW_TILE, group)] */
    float *l;          /* [max(ROW_TILE, group)] */
    float *qt;         /* [d][ROW_TILE] */
    float *scores;     /* [TILE][ROW_TILE] */
    float *row_scores; /* [TILE] */
    float *k_tile;     /* [TILE][d] */
    float *v_tile;     /* [TILE][d] */
    float alpha[ROW_TILE];
    int pos[ROW_TILE];    /* packed row r's position: it sees keys <= pos[r] ... */
    int pos_lo[ROW_TILE]; /* ... and > pos_lo[r] (its window's start - 1, or -1) */
} Scratch;

/* Starts a row's online softmax over a tile: the new running max from the tile's scores `s` (n of them, all
 * visible), the scores turned into probabilities in place, and the factor the old sum and accumulator take. */
static inline float softmax_step(float *restrict s, int n, float *m, float *l) {
    float mx = s[0];
    for (int j = 1; j < n; j++)
        mx = s[j] > mx ? s[j] : mx;
    const float m_old = *m;
    const float m_new = mx > m_old ? mx : m_old;
    for (int j = 0; j < n; j++)
        s[j] = exp_poly(s[j] - m_new);
    float sum = 0.0f;
    for (int j = 0; j < n; j++)
        sum += s[j];
    const float alpha = m_old == -INFINITY ? 0.0f : exp_poly(m_old - m_new);
    *m = m_new;
    *l = *l * alpha + sum;
    return alpha;
}

/* acc = acc * alpha + sum_j p[j * p_stride] * v[j]: the row's accumulator is read and written once per tile and
 * held in registers in between, eight registers of it at a time (d a multiple of VW up to VMAX_D; the compiler
 * unrolls the loops over them). */
static inline __attribute__((always_inline)) void accumulate(float *restrict acc, float alpha, const float *restrict p,
                                                             long p_stride, const float *restrict v_rows,
                                                             long v_stride, int n, const int d) {
    if (d % VW == 0 && d <= VMAX_D) {
        for (int c0 = 0; c0 < d; c0 += 8 * VW) {
            const int w = d - c0 < 8 * VW ? (d - c0) / VW : 8;
            vfw t[8];
            for (int c = 0; c < w; c++)
                t[c] = *(const vfwu *)(acc + c0 + VW * c) * alpha;
            for (int j = 0; j < n; j++) {
                const float pj = p[j * p_stride];
                const float *restrict vv = v_rows + j * v_stride + c0;
                for (int c = 0; c < w; c++)
                    t[c] += pj * *(const vfwu *)(vv + VW * c);
            }
            for (int c = 0; c < w; c++)
                *(vfwu *)(acc + c0 + VW * c) = t[c];
        }
        return;
    }
    float t[MAX_D];
    for (int i = 0; i < d; i++)
        t[i] = acc[i] * alpha;
    for (int j = 0; j < n; j++) {
        const float pj = p[j * p_stride];
        const float *restrict vv = v_rows + j * v_stride;
        for (int i = 0; i < d; i++)
            t[i] += pj * vv[i];
    }
    for (int i = 0; i < d; i++)
        acc[i] = t[i];
}

/* Scores of the ROW_TILE (32) packed rows against n keys: s[j * ROW_TILE + r] = k_j . qt[:, r], with the queries
 * transposed (`qt[i * ROW_TILE + r]`) so the rows are the vector lanes and no sum runs across lanes. ROW_KEYS keys at
 * a time keep eight independent vector accumulators in registers. */
static inline __attribute__((always_inline)) void scores_by_rows(float *restrict s, const float *restrict qt,
                                                                 const float *restrict k_rows, long k_stride, int n,
                                                                 const int d) {
    int j = 0;
    for (; j + ROW_KEYS <= n; j += ROW_KEYS) {
        vfw acc[ROW_KEYS][ROW_VECTORS];
        for (int u = 0; u < ROW_KEYS; u++)
            for (int r = 0; r < ROW_VECTORS; r++)
                acc[u][r] = (vfw){0};
        for (int i = 0; i < d; i++) {
            vfw q[ROW_VECTORS];
            for (int r = 0; r < ROW_VECTORS; r++)
                q[r] = *(const vfwu *)(qt + i * ROW_TILE + r * VW);
            for (int u = 0; u < ROW_KEYS; u++) {
                const float k = k_rows[(j + u) * k_stride + i];
                for (int r = 0; r < ROW_VECTORS; r++)
                    acc[u][r] += k * q[r];
            }
        }
        for (int u = 0; u < ROW_KEYS; u++)
            for (int r = 0; r < ROW_VECTORS; r++)
                *(vfwu *)(s + (j + u) * ROW_TILE + r * VW) = acc[u][r];
    }
    for (; j < n; j++) {
        vfw acc[ROW_VECTORS];
        for (int r = 0; r < ROW_VECTORS; r++)
            acc[r] = (vfw){0};
        for (int i = 0; i < d; i++)
            for (int r = 0; r < ROW_VECTORS; r++)
                acc[r] += k_rows[j * k_stride + i] * *(const vfwu *)(qt + i * ROW_TILE + r * VW);
        for (int r = 0; r < ROW_VECTORS; r++)
            *(vfwu *)(s + j * ROW_TILE + r * VW) = acc[r];
    }
}

/* The online-softmax step of ROW_TILE packed rows over one tile's scores s[j * ROW_TILE + r] (n keys from t0), with
 * the rows as vector lanes: key t0 + j is visible to row r when pos_lo[r] < t0 + j <= pos[r]; invisible scores
 * become probability 0 (padded rows have pos -1: they see nothing and stay at m = -inf, l = 0). Scores turn into
 * probabilities in place; alpha[r] is what the row's sum and accumulator are multiplied by first. */
static inline void softmax_by_rows(float *restrict s, int n, int t0, const int *restrict pos,
                                   const int *restrict pos_lo, float *restrict m, float *restrict l,
                                   float *restrict alpha, float soft_cap) {
    if (soft_cap > 0.0f) {
        const float inv_cap = 1.0f / soft_cap;
        for (int i = 0; i < n * ROW_TILE; i++)
            s[i] = soft_cap_score(s[i], soft_cap, inv_cap);
    }
    float mx[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++)
        mx[r] = -INFINITY;
    for (int j = 0; j < n; j++) {
        const int key = t0 + j;
        for (int r = 0; r < ROW_TILE; r++) {
            const float x = s[j * ROW_TILE + r];
            const float v = (key <= pos[r]) & (key > pos_lo[r]) ? x : -INFINITY;
            s[j * ROW_TILE + r] = v;
            mx[r] = v > mx[r] ? v : mx[r];
        }
    }
    float m_new[ROW_TILE], sum[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) {
        m_new[r] = mx[r] > m[r] ? mx[r] : m[r];
        alpha[r] = m[r] == -INFINITY ? 0.0f : exp_poly(m[r] - m_new[r]);
        sum[r] = 0.0f;
    }
    for (int j = 0; j < n; j++)
        for (int r = 0; r < ROW_TILE; r++) {
            const float v = s[j * ROW_TILE + r];
            const float p = v == -INFINITY ? 0.0f : exp_poly(v - m_new[r]);
            s[j * ROW_TILE + r] = p;
            sum[r] += p;
        }
    for (int r = 0; r < ROW_TILE; r++) {
        l[r] = l[r] * alpha[r] + sum[r];
        m[r] = m_new[r];
    }
}

/* Asks for the keys and values of one KV head in `block` (its first n tokens) ahead of their use: blocks lie
 * anywhere in the cache, so the hardware's stride prefetchers cannot see the next one coming. */
static inline void prefetch_block(const Args *a, long block, long head_off, int n, int d) {
    const long elem = a->cache_bf16 ? 2 : 4;
    const char *k = (const char *)a->k_cache + (block * a->stride_block + head_off) * elem;
    const char *v = (const char *)a->v_cache + (block * a->stride_block + head_off) * elem;
    for (int j = 0; j < n; j++)
        for (long i = 0; i < d * elem; i += 64) {
            __builtin_prefetch(k + j * a->stride_tok * elem + i, 0, 3);
            __builtin_prefetch(v + j * a->stride_tok * elem + i, 0, 3);
        }
}

/* Inlined into one copy per common head size, where d is a constant and the loops over it unroll. */
static inline __attribute__((always_inline)) void run_item_d(const Args *a, const Item *it, Scratch *sc, const int d) {
    const int group = a->num_heads / a->num_kv_heads;
    const int q_start = a->query_start_loc[it->seq];
    const int q_len = a->query_start_loc[it->seq + 1] - q_start;
    const int seq_len = a->seq_lens[it->seq];
    const int n_rows = (it->row1 - it->row0) * group;
    const int32_t *table = a->block_tables + (long)it->seq * a->table_stride;
    const long head_off = (long)it->kv_head * d;
    /* Packed rows as vector lanes pay off once they fill most of a ROW_TILE; decodes (a group's heads, one token)
     * take one row at a time. */
    const int by_rows = n_rows * 3 >= ROW_TILE && n_rows <= ROW_TILE;

    for (int r = 0; r < n_rows; r++) {
        sc->m[r] = -INFINITY;
        sc->l[r] = 0.0f;
    }
    memset(sc->acc, 0, sizeof(float) * (size_t)n_rows * d);
    if (by_rows) {
        /* queries times the scale, transposed; padded lanes are zeros and never read back */
        memset(sc->qt, 0, sizeof(float) * (size_t)ROW_TILE * d);
        for (int r = 0; r < n_rows; r++) {
            const int qr = it->row0 + r / group;
            const float *restrict qv = a->q + ((long)(q_start + qr) * a->num_heads + (long)it->kv_head * group + r % group) * d;
            for (int i = 0; i < d; i++)
                sc->qt[i * ROW_TILE + r] = qv[i] * a->scale;
            sc->pos[r] = seq_len - q_len + qr;
            sc->pos_lo[r] = a->window > 0 ? sc->pos[r] - a->window : -1;
        }
        for (int r = n_rows; r < ROW_TILE; r++) {
            sc->pos[r] = -1;
            sc->pos_lo[r] = -1;
            sc->m[r] = -INFINITY;
            sc->l[r] = 0.0f;
        }
    }

    const int first_pos = seq_len - q_len + it->row0;
    const int last_pos = seq_len - q_len + it->row1 - 1;
    int key_lo = 0;
    if (a->window > 0 && first_pos - a->window + 1 > 0)
        key_lo = first_pos - a->window + 1;
    const int key_hi = last_pos + 1; /* exclusive */

    for (int t0 = key_lo; t0 < key_hi;) {
        const int blk_idx = t0 / a->block_size;
        int t1 = (blk_idx + 1) * a->block_size;
        if (t1 > key_hi)
            t1 = key_hi;
        if (t1 > t0 + TILE)
            t1 = t0 + TILE;
        const int n_tok = t1 - t0;
        const long base = (long)table[blk_idx] * a->stride_block + (long)(t0 % a->block_size) * a->stride_tok + head_off;
        if (!by_rows && t0 % a->block_size == 0 && (blk_idx + 1) * a->block_size < key_hi) {
            const int nt = key_hi - (blk_idx + 1) * a->block_size;
            prefetch_block(a, table[blk_idx + 1], head_off, nt < a->block_size ? nt : a->block_size, d);
        }
        const float *k_rows;
        const float *v_rows;
        long kv_stride;
        if (a->cache_bf16) {
            widen_bf16(sc->k_tile, (const uint16_t *)a->k_cache + base, n_tok, a->stride_tok, d);
            widen_bf16(sc->v_tile, (const uint16_t *)a->v_cache + base, n_tok, a->stride_tok, d);
            k_rows = sc->k_tile;
            v_rows = sc->v_tile;
            kv_stride = d;
        } else {
            k_rows = (const float *)a->k_cache + base;
            v_rows = (const float *)a->v_cache + base;
            kv_stride = a->stride_tok;
        }

        if (by_rows) {
            float *restrict s = sc->scores; /* [TILE][ROW_TILE] */
            scores_by_rows(s, sc->qt, k_rows, kv_stride, n_tok, d);
            softmax_by_rows(s, n_tok, t0, sc->pos, sc->pos_lo, sc->m, sc->l, sc->alpha, a->soft_cap);
            for (int r = 0; r < n_rows; r++)
                accumulate(sc->acc + (long)r * d, sc->alpha[r], s + r, ROW_TILE, v_rows, kv_stride, n_tok, d);
        } else {
            for (int qr = it->row0; qr < it->row1; qr++) {
                const int pos = seq_len - q_len + qr;
                int lo = t0;
                if (a->window > 0 && pos - a->window + 1 > lo)
                    lo = pos - a->window + 1;
                const int hi = pos + 1 < t1 ? pos + 1 : t1;
                if (lo >= hi)
                    continue;
                const int j0 = lo - t0, n = hi - lo;
                for (int g = 0; g < group; g++) {
                    const int row = (qr - it->row0) * group + g;
                    const float *restrict qv = a->q + ((long)(q_start + qr) * a->num_heads + (long)it->kv_head * group + g) * d;
                    float *restrict p = sc->row_scores;
                    row_scores(p, qv, k_rows + (long)j0 * kv_stride, kv_stride, n, d, a->scale);
                    if (a->soft_cap > 0.0f) {
                        const float cap = a->soft_cap, inv_cap = 1.0f / a->soft_cap;
                        for (int j = 0; j < n; j++)
                            p[j] = soft_cap_score(p[j], cap, inv_cap);
                    }
                    const float alpha = softmax_step(p, n, &sc->m[row], &sc->l[row]);
                    accumulate(sc->acc + (long)row * d, alpha, p, 1, v_rows + j0 * kv_stride, kv_stride, n, d);
                }
            }
        }
        t0 = t1;
    }

    for (int r = 0; r < n_rows; r++) {
        const int qr = it->row0 + r / group, g = r % group;
        float *restrict o = a->out + ((long)(q_start + qr) * a->num_heads + (long)it->kv_head * group + g) * d;
        const float *restrict acc = sc->acc + (long)r * d;
        const float f = a->v_scale / sc->l[r]; /* every row sees at least its own key: l > 0 */
        for (int i = 0; i < d; i++)
            o[i] = acc[i] * f;
    }
}

static void run_item_64(const Args *a, const Item *it, Scratch *sc) { run_item_d(a, it, sc, 64); }
static void run_item_128(const Args *a, const Item *it, Scratch *sc) { run_item_d(a, it, sc, 128); }
static void run_item_any(const Args *a, const Item *it, Scratch *sc) { run_item_d(a, it, sc, a->head_size); }

/* Returns 0, or -1 when scratch memory cannot be had, -2 when a sequence needs more blocks than its table row holds
 * or a block id is outside the cache, -3 on inconsistent lengths. Nothing is written on -2 / -3. */
int kestrel_paged_attention(const float *q, float *out, const void *k_cache, const void *v_cache, int cache_bf16,
                            long num_cache_blocks, int block_size, int num_heads, int num_kv_heads, int head_size,
                            const int32_t *query_start_loc, const int32_t *seq_lens, const int32_t *block_tables,
                            long table_stride, int table_width, int num_seqs, float scale, int window,
                            float k_scale, float v_scale, float soft_cap, int num_threads) {
    Args a = {q, out, k_cache, v_cache, cache_bf16, (long)block_size * num_kv_heads * head_size,
              (long)num_kv_heads * head_size, query_start_loc, seq_lens, block_tables, table_stride,
              num_heads, num_kv_heads, head_size, block_size, scale * k_scale, v_scale, window, soft_cap};
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_size <= 0 || head_size > MAX_D || block_size <= 0)
        return -3;
    const int group = num_heads / num_kv_heads;
    /* a work item's query rows: as many as fill ROW_TILE packed rows (one if a group alone is wider) */
    const int rows_per_item = group <= ROW_TILE ? ROW_TILE / group : 1;

    long n_items = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        const int seq_len = seq_lens[s];
        if (q_len <= 0)
            continue;
        if (q_len > seq_len)
            return -3;
        const int n_blocks = (seq_len + block_size - 1) / block_size;
        if (n_blocks > table_width)
            return -2;
        const int32_t *table = block_tables + (long)s * table_stride;
        for (int b = 0; b < n_blocks; b++)
            if (table[b] < 0 || table[b] >= num_cache_blocks)
                return -2;
        n_items += (long)num_kv_heads * ((q_len + rows_per_item - 1) / rows_per_item);
    }
    if (n_items == 0)
        return 0;
    Item *items = malloc(sizeof(Item) * (size_t)n_items);
    if (!items)
        return -1;
    /* Longest items first (prefill chunks' last rows see the most keys): dynamic scheduling then ends evenly. */
    long k = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int q_len = query_start_loc[s + 1] - query_start_loc[s];
        for (int r0 = (q_len - 1) / rows_per_item * rows_per_item; q_len > 0 && r0 >= 0; r0 -= rows_per_item) {
            const int r1 = r0 + rows_per_item < q_len ? r0 + rows_per_item : q_len;
            for (int h = 0; h < num_kv_heads; h++)
                items[k++] = (Item){s, h, r0, r1};
        }
    }

    const size_t d = (size_t)head_size;
    /* an item's packed rows: at most ROW_TILE, or one query row of a group wider than that */
    const size_t max_rows = group > ROW_TILE ? (size_t)group : ROW_TILE;
    const size_t per_thread = max_rows * d + 2 * max_rows + d * ROW_TILE + TILE * ROW_TILE + TILE + 2 * TILE * d;
    int n_threads = num_threads > 1 ? num_threads : 1;
    if (n_threads > n_items)
        n_threads = (int)n_items;
    float *scratch = malloc(sizeof(float) * per_thread * (size_t)n_threads);
    if (!scratch) {
        free(items);
        return -1;
    }
    void (*run_item)(const Args *, const Item *, Scratch *) =
        head_size == 64 ? run_item_64 : (head_size == 128 ? run_item_128 : run_item_any);
#ifdef _OPENMP
#pragma omp parallel num_threads(n_threads) if (n_threads > 1)
#endif
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        Scratch sc;
        float *p = scratch + per_thread * (size_t)tid;
        sc.acc = p;
        p += max_rows * d;
        sc.m = p;
        p += max_rows;
        sc.l = p;
        p += max_rows;
        sc.qt = p;
        p += d * ROW_TILE;
        sc.scores = p;
        p += TILE * ROW_TILE;
        sc.row_scores = p;
        p += TILE;
        sc.k_tile = p;
        p += TILE * d;
        sc.v_tile = p;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (long i = 0; i < n_items; i++) {
            /* the next item's first block, a whole item ahead (a decode's: prefill items find theirs soon enough) */
            if (i + 1 < n_items) {
                const Item *nx = &items[i + 1];
                const int nq = query_start_loc[nx->seq + 1] - query_start_loc[nx->seq];
                if (nq == 1) {
                    const int nlen = seq_lens[nx->seq];
                    prefetch_block(&a, block_tables[(long)nx->seq * table_stride], (long)nx->kv_head * head_size,
                                   nlen < block_size ? nlen : block_size, head_size);
                }
            }
            run_item(&a, &items[i], &sc);
        }
    }
    free(scratch);
    free(items);
    return 0;
}
