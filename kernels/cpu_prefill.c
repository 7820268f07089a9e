// eagleray: a prefill's causal attention on a CPU, fp32, AVX-512 or AVX2 (kernels/cpu_prefill.py; reference:
// cpu_decode.paged_attention_reference, row by row).
//
// A block is up to 16 / G consecutive rows of one sequence (G query heads per kv head), every key of each row already
// in the paged cache: row t sees keys 0..ctx[t]-1. One item is a block and a kv head: its n * G <= 16 query vectors
// are the 16 lanes of a vector (q transposed, qt[d][lane]), so each key costs D FMAs for the scores of all of them
// (the key's values broadcast) and D FMAs for their outputs (acc[d][lane] += p[lane] * v[d]), with no horizontal sum;
// the softmax is online, lane-wise, over tiles of 16 keys. A lane is one query vector alone: keys past its row's
// ctx get probability exactly 0 and leave it untouched, unused lanes are never stored, so a row's output does not
// depend on the other rows of its block (the tiles start at key 0 for every row).
#define _GNU_SOURCE
#include "cpu_decode.h"
#include <limits.h>
#include <string.h>

#define LANES 16
#define TILE 16
#define PV_DIMS 8  // output dims a pass of the probabilities x values: 8 chains hide the FMA latency, 16 + 8 registers

// s[jj] (lanes: query vectors) = qt . k_jj for the tile's keys kt [TILE][D].
static inline void tile_scores(const float (*qt)[LANES], const float* kt, int64_t D, vf s[TILE]) {
#pragma GCC unroll 16
    for (int jj = 0; jj < TILE; jj++) s[jj] = vf_zero();
    for (int64_t d = 0; d < D; d++) {
        vf qd = vf_load(qt[d]);
#pragma GCC unroll 16
        for (int jj = 0; jj < TILE; jj++) s[jj] = vf_fmadd(qd, vf_set1(kt[jj * D + d]), s[jj]);
    }
}

void prefill_attn_block(const void* vctx, int64_t item) {
    const prefill_attn_t* pa = (const prefill_attn_t*)vctx;
    const attn_t* a = pa->a;
    int64_t Hkv = a->Hkv, G = a->Hq / Hkv, D = a->D, bs = a->bs;
    int64_t b = item / Hkv, kvh = item % Hkv, t0 = pa->blocks[2 * b], n = pa->blocks[2 * b + 1], nq = n * G;
    int64_t nkeys = a->ctx[t0 + n - 1];
    const int32_t* table = a->bt + a->seq[t0] * a->bt_w;
    static __thread float qt[MAX_D][LANES] __attribute__((aligned(64)));  // q transposed: [d][lane]
    static __thread float acc[MAX_D][LANES] __attribute__((aligned(64)));  // outputs, unnormalised: [d][lane]
    static __thread float kt[TILE * MAX_D] __attribute__((aligned(64)));   // the tile's keys, values: [key][d]
    static __thread float vt[TILE * MAX_D] __attribute__((aligned(64)));
    int32_t lim[LANES];
    for (int64_t lane = 0; lane < LANES; lane++) {
        const float* q = lane < nq ? a->q + (t0 + lane / G) * a->ldq + (kvh * G + lane % G) * D : NULL;
        for (int64_t d = 0; d < D; d++) qt[d][lane] = q ? q[d] : 0.f;
        lim[lane] = lane < nq ? (int32_t)a->ctx[t0 + lane / G] : INT32_MAX;  // an unused lane: scores 0, finite
    }
    memset(acc, 0, sizeof(float) * LANES * D);
    const vi limv = vi_loadu(lim);
    const vf scale = vf_set1(a->scale), neg_inf = vf_set1(-INFINITY);
    vf m = neg_inf, l = vf_zero();
    for (int64_t j0 = 0; j0 < nkeys; j0 += TILE) {
        int64_t nk = nkeys - j0 < TILE ? nkeys - j0 : TILE;
        for (int64_t jj = 0; jj < TILE; jj++) {  // past nk: key j0 again, its probability masked to 0 below
            int64_t j = j0 + (jj < nk ? jj : 0), slot = (int64_t)table[j / bs] * bs + j % bs;
            memcpy(kt + jj * D, a->kc + (slot * Hkv + kvh) * D, (size_t)D * sizeof(float));
            memcpy(vt + jj * D, a->vc + (slot * Hkv + kvh) * D, (size_t)D * sizeof(float));
        }
        vf s[TILE];
        vmask vis[TILE];
        tile_scores((const float (*)[LANES])qt, kt, D, s);
        vf mx = neg_inf;
        for (int64_t jj = 0; jj < TILE; jj++) {
            vis[jj] = jj < nk ? vi_cmplt(vi_set1((int32_t)(j0 + jj)), limv) : 0;
            s[jj] = vf_mask_mov(neg_inf, vis[jj], vf_mul(s[jj], scale));
            mx = vf_max(mx, s[jj]);
        }
        vf m_new = vf_max(m, mx);  // finite in every lane: key 0 is visible to every row
        vf alpha = vf_maskz_mov(vf_cmp(m, neg_inf, _CMP_NEQ_OQ), vf_exp(vf_sub(m, m_new)));
        l = vf_mul(l, alpha);
        for (int jj = 0; jj < TILE; jj++) {
            s[jj] = vf_maskz_mov(vis[jj], vf_exp(vf_sub(s[jj], m_new)));  // probabilities, 0 if unseen
            l = vf_add(l, s[jj]);
        }
        for (int64_t d0 = 0; d0 < D; d0 += PV_DIMS) {  // PV_DIMS independent FMA chains (D is a multiple of 16)
            vf ad[PV_DIMS];
            for (int u = 0; u < PV_DIMS; u++) ad[u] = vf_mul(vf_load(acc[d0 + u]), alpha);
#pragma GCC unroll 16
            for (int jj = 0; jj < TILE; jj++)
#pragma GCC unroll 8
                for (int u = 0; u < PV_DIMS; u++) ad[u] = vf_fmadd(s[jj], vf_set1(vt[jj * D + d0 + u]), ad[u]);
            for (int u = 0; u < PV_DIMS; u++) vf_store(acc[d0 + u], ad[u]);
        }
        m = m_new;
    }
    float inv[LANES];
    vf_storeu(inv, vf_div(vf_set1(1.f), l));
    for (int64_t lane = 0; lane < nq; lane++) {
        float* o = a->out + ((t0 + lane / G) * a->Hq + kvh * G + lane % G) * D;
        for (int64_t d = 0; d < D; d++) o[d] = acc[d][lane] * inv[lane];
    }
}
