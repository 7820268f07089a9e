// eagleray CPU kernels for decode-sized steps (decode, verification, drafting) in fp32, AVX-512 or AVX2 (cpu_simd.h).
//
// linear: y = x w^T + b, y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]); x [M, K] (row stride ldx),
// y [M, N] (row stride ldy), the weight packed once as panels of PANEL output columns (p[panel][k][j] =
// w[panel * PANEL + j][k]; cpu_decode.h: 48 on AVX-512, 16 on AVX2). A register tile of up to PMT x rows by the
// panel's columns: per k, the panel's weight vectors and one broadcast x value per row (an outer product), so no
// horizontal sums. AVX-512: 8 rows x 48 columns (24 accumulators). AVX2 (16-column panels, at most 12 accumulators of
// the 16 ymm registers): a verification's or a draft's few rows (M <= 6) in tiles of 1 row over 3 adjacent panels or
// 2-3 rows over 2; more rows in tiles of up to 6 over one panel, the rows shared evenly (8 as 4 + 4) (tile_count,
// panel_group). Each y[m, n] is one FMA chain over k = 0..K-1 in order whatever M, the tile or the thread
// count is, so a token's logits are bitwise the same when it is decoded alone or verified beside k others. Each panel
// is streamed from memory once per call (the next ones prefetched into L2 during this one: prefetch_stride) and reused
// from L2 by every other tile.
// Built and loaded by kernels/cpu_decode.py; reference: torch.nn.functional.linear.
#define _GNU_SOURCE
#include "cpu_decode.h"
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>
// ---------------------------------------------------------------------------------------------
// Threads. Not OpenMP: an OpenMP region ends in a barrier that waits for every team thread, so one
// thread descheduled by another process (a Serve ingress, a test runner) stalls every call for a
// whole scheduler slice. Here the calling thread and up to MAX_HELPERS helper threads claim chunks
// (weight panels, attention rows) from one atomic counter; the caller returns when every chunk is done, so a helper
// that has not woken up simply gets no work. Helpers spin briefly, then sleep on a futex.
#define MAX_HELPERS 15
typedef struct { work_fn fn; const void* ctx; int64_t nchunks; } job_t;
static job_t job;
static _Atomic uint64_t state;     // (generation << 32) | next chunk
static _Atomic int64_t done;       // chunks finished in this generation
static _Atomic uint32_t wake_word; // futex word: bumped on every new generation
static _Atomic int sleepers;
static int nhelpers;
// Pauses a helper spins for the next call before it sleeps: long between the back-to-back native calls of a decode
// step, short where other threads need the cores between calls (a prefill's oneDNN GEMMs: a spinning helper takes
// the core from one of their threads). set_helper_spin() sets it.
static _Atomic int spin_limit = 20000;
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;  // one job at a time (calls from several Python threads)

static int claim(uint32_t gen, int64_t nchunks, int64_t* chunk) {
    uint64_t s = atomic_load_explicit(&state, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(s >> 32) != gen || (int64_t)(s & 0xffffffffu) >= nchunks) return 0;
        if (atomic_compare_exchange_weak_explicit(&state, &s, s + 1, memory_order_acq_rel, memory_order_acquire)) {
            *chunk = (int64_t)(s & 0xffffffffu);
            return 1;
        }
    }
}

static void* helper_main(void* arg) {
    (void)arg;
    uint32_t seen = atomic_load(&wake_word);
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&wake_word, memory_order_acquire) == seen) {
            if (++spins < atomic_load_explicit(&spin_limit, memory_order_relaxed)) { _mm_pause(); continue; }
            atomic_fetch_add(&sleepers, 1);
            if (atomic_load(&wake_word) == seen) syscall(SYS_futex, &wake_word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&sleepers, 1);
            spins = 0;
        }
        seen = atomic_load_explicit(&wake_word, memory_order_acquire);
        uint32_t gen = (uint32_t)(atomic_load_explicit(&state, memory_order_acquire) >> 32);
        int64_t c;
        // the job is read only after a successful claim: the caller cannot start the next job
        // before this chunk is counted done, so it belongs to this generation.
        while (claim(gen, job.nchunks, &c)) {
            job.fn(job.ctx, c);
            atomic_fetch_add_explicit(&done, 1, memory_order_acq_rel);
        }
    }
    return NULL;
}

static void ensure_helpers(int want) {
    if (want > MAX_HELPERS) want = MAX_HELPERS;
    if (want <= nhelpers) return;
    pthread_mutex_lock(&start_lock);
    while (nhelpers < want) {
        pthread_t t;
        if (pthread_create(&t, NULL, helper_main, NULL) != 0) break;
        pthread_detach(t);
        nhelpers++;
    }
    pthread_mutex_unlock(&start_lock);
}

// Run fn(ctx, 0..nchunks-1) on the caller and up to threads-1 helpers; returns when all are done.
void parallel_run(work_fn fn, const void* ctx, int64_t nchunks, int threads) {
    if (threads <= 1 || nchunks <= 1) {
        for (int64_t c = 0; c < nchunks; c++) fn(ctx, c);
        return;
    }
    ensure_helpers(threads - 1);
    pthread_mutex_lock(&call_lock);
    job = (job_t){fn, ctx, nchunks};
    atomic_store_explicit(&done, 0, memory_order_relaxed);
    uint32_t gen = (uint32_t)(atomic_load(&state) >> 32) + 1;
    atomic_store_explicit(&state, (uint64_t)gen << 32, memory_order_release);
    atomic_fetch_add_explicit(&wake_word, 1, memory_order_release);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &wake_word, FUTEX_WAKE_PRIVATE, nhelpers, NULL, NULL, 0);
    int64_t c;
    while (claim(gen, nchunks, &c)) {
        fn(ctx, c);
        atomic_fetch_add_explicit(&done, 1, memory_order_acq_rel);
    }
    while (atomic_load_explicit(&done, memory_order_acquire) < nchunks) _mm_pause();
    // Close the generation before the job may be rewritten: a helper woken for it late may pass the NEXT job's
    // nchunks (written before the next generation is published) to its claim; with the counter left at nchunks
    // that claim succeeded past this job's end and ran a chunk of a half-written job (SIGSEGV in plinear_chunk,
    // helpers preempted on a busy box). A closed generation refuses every claim.
    atomic_store_explicit(&state, ((uint64_t)gen << 32) | 0xffffffffu, memory_order_release);
    pthread_mutex_unlock(&call_lock);
}

// ---------------------------------------------------------------------------------------------
// linear (see the top of the file)
// One tile: MT x rows times one panel, from k = 0 to K - 1, then bias, residual and store (masked past N).
// While it runs, pf_lines cache lines of the next panel are prefetched into L2, spread over the k loop.
// BF: the panel holds bf16 weights, each widened to fp32 exactly (its 16 bits above 16 zero bits) before the same FMA:
// a weight stored in bf16 that is exactly its fp32 value gives the fp32 panel's result bit for bit, from half the bytes.
static inline __attribute__((always_inline)) vf pload(const int BF, const void* p, int64_t at) {
    if (BF) return vf_load_bf16((const uint16_t*)p + at);
    return vf_loadu((const float*)p + at);
}

// NV weight vectors of 16 columns each, vstride elements apart: a panel's PNV vectors (AVX-512: 16 apart), or on AVX2
// the one vector of NV adjacent panels (K * PANEL apart), which are adjacent columns of y too.
#define NVMAX 3
static inline __attribute__((always_inline)) void ptile(const int MT, const int NV, const int BF, const void* p,
                                                        int64_t vstride, const float* x, float* y, const float* b,
                                                        const float* r, int64_t K, int64_t ldx, int64_t ldy,
                                                        int64_t ldr, int64_t ncols, const char* pf, int64_t pf_lines,
                                                        int64_t pf_stride) {
    vf acc[PMT][NVMAX];
    for (int i = 0; i < MT; i++) for (int v = 0; v < NV; v++) acc[i][v] = vf_zero();
    int64_t kq = K / 4, pf_acc = 0;
    const char* pfl = pf;
    pf_lines = (pf_lines + pf_stride - 1) / pf_stride;  // the lines prefetched: every pf_stride-th
#define KSTEP(kk) do { /* the k-th weight vectors loaded once, then a row at a time */ \
        vf wv[NVMAX]; \
        for (int v = 0; v < NV; v++) wv[v] = pload(BF, p, (kk) * PANEL + vstride * v); \
        for (int i = 0; i < MT; i++) { \
            vf xb = vf_set1(x[i * ldx + (kk)]); \
            for (int v = 0; v < NV; v++) acc[i][v] = vf_fmadd(wv[v], xb, acc[i][v]); \
        } } while (0)
    for (int64_t q = 0; q < kq; q++) {
        for (pf_acc += pf_lines; /* Bresenham: pf_lines spread over kq steps, no division */ pf_acc >= kq && kq > 0; pf_acc -= kq) { _mm_prefetch(pfl, _MM_HINT_T1); pfl += 64 * pf_stride; }
        int64_t k = 4 * q;
        KSTEP(k); KSTEP(k + 1); KSTEP(k + 2); KSTEP(k + 3);
    }
    for (int64_t k = 4 * kq; k < K; k++) KSTEP(k);
#undef KSTEP
    for (int i = 0; i < MT; i++)
        for (int v = 0; v < NV; v++) {
            int64_t c = 16 * v, left = ncols - c;
            if (left <= 0) break;
            vmask mk = vmask_first(left);
            vf o = acc[i][v];
            if (b) o = vf_add(o, vf_maskz_loadu(mk, b + c));
            if (r) o = vf_add(vf_maskz_loadu(mk, r + i * ldr + c), o);  // residual + product, as h + f(h)
            vf_mask_storeu(y + i * ldy + c, mk, o);
        }
}

// Tiles a row block of M rows takes: AVX-512 tiles of up to PMT rows. AVX2: at most FEW_ROWS rows (a verification's,
// a draft's, a small batch's) in tiles of up to 3 (2-3 rows over 2 adjacent panels: 12 accumulators and two panel
// streams, where one 6-row tile streamed one panel), more in tiles of up to PMT.
#define FEW_ROWS 6
static inline int64_t tile_count(int64_t M) {
#if PMT == 8
    return (M + PMT - 1) / PMT;
#else
    int64_t most = M <= FEW_ROWS ? 3 : PMT;
    return (M + most - 1) / most;
#endif
}

// Rows of tile t of `tiles` at row m of M: PMT while that many are left (AVX-512), or the rows left shared evenly by
// the tiles left (AVX2: 8 rows as 4 + 4, not 6 + 2, whose 2-row tile is FMA-latency-bound on its 4 accumulators).
static inline int64_t tile_rows(int64_t M, int64_t m, int64_t t, int64_t tiles) {
#if PMT == 8
    (void)t, (void)tiles;
    return M - m < PMT ? M - m : PMT;
#else
    return (M - m + (tiles - t) - 1) / (tiles - t);
#endif
}

// Panels a tile of `rows` rows spans, of `left` left in the claim: one (AVX-512: its 48 columns; AVX2 tiles of 4-6
// rows), or on AVX2 up to 3 adjacent 16-column panels for 1 row and 2 for 2-3 rows: more accumulator chains and memory
// streams, one tile prologue for several panels.
static inline int64_t panel_group(int64_t rows, int64_t left) {
#if PMT == 8
    (void)rows, (void)left;
    return 1;
#else
    int64_t most = rows == 1 ? 3 : rows <= 3 ? 2 : 1;
    return left < most ? left : most;
#endif
}

// Every how many lines of the next panels a tile prefetches into L2: AVX-512 every line. AVX2, at most FEW_ROWS rows:
// one line per 4 KB page, the L2 stream prefetcher (which stops at a page's end) fetching the rest: a prefetch of every
// line held the fill buffers the streams need (1 / 3 / 5 rows 17.0 / 23.4 / 23.0 -> 14.6 / 16.4 / 21.2 ms a SmolLM2
// step's linears with the 3-row tiles, BENCHMARKS.md). More rows: every line (8 rows as 4 + 4: 24.7 ms, 29.7 one a page).
static inline int64_t prefetch_stride(int64_t M) {
#if PMT == 8
    (void)M;
    return 1;
#else
    return M <= FEW_ROWS ? 64 : 1;
#endif
}

// Panels [c * per_chunk, ...) of one claim: each is read from memory once, by its first tile, and from
// L2 by the others; the claim's next panels are prefetched a slice per tile meanwhile (a claim holds
// consecutive panels so that the prefetch lands in the L2 of the core that will use it).
void plinear_chunk(const void* vctx, int64_t c) {
    const plinear_t* j = (const plinear_t*)vctx;
    int64_t p0 = c * j->per_chunk, p1 = p0 + j->per_chunk < j->npanels ? p0 + j->per_chunk : j->npanels;
    int64_t esz = j->bf16 ? 2 : 4, tiles = tile_count(j->M), panel_lines = j->K * PANEL * esz / 64;
    int64_t vstride = PNV > 1 ? 16 : j->K * PANEL;  // elements between a tile's weight vectors
    int64_t stride = prefetch_stride(j->M);
    for (int64_t pi = p0, group; pi < p1; pi += group) {
        group = panel_group(tile_rows(j->M, 0, 0, tiles), p1 - pi);
        int64_t n0 = pi * PANEL, ncols = j->N - n0 < group * PANEL ? j->N - n0 : group * PANEL;
        const char* p = (const char*)j->p + pi * j->K * PANEL * esz;
        const float* b = j->b ? j->b + n0 : NULL;
        int64_t after = p1 - pi - group, lines = (after < group ? after : group) * panel_lines;
        const char* next = p + group * j->K * PANEL * esz;
        for (int64_t t = 0, m = 0, rows; m < j->M; m += rows, t++) {
            rows = tile_rows(j->M, m, t, tiles);
            int64_t l0 = lines * t / tiles, l1 = lines * (t + 1) / tiles;
            const float* xm = j->x + m * j->ldx;
            float* ym = j->y + m * j->ldy + n0;
            const float* rm = j->r ? j->r + m * j->ldr + n0 : NULL;
#define PT(MTc, NVc, BF) \
    ptile(MTc, NVc, BF, p, vstride, xm, ym, b, rm, j->K, j->ldx, j->ldy, j->ldr, ncols, next + 64 * l0, l1 - l0, stride)
#if PMT == 8
#define TILE(BF) switch (rows) { \
            case 8: PT(8, PNV, BF); break; case 7: PT(7, PNV, BF); break; case 6: PT(6, PNV, BF); break; \
            case 5: PT(5, PNV, BF); break; case 4: PT(4, PNV, BF); break; case 3: PT(3, PNV, BF); break; \
            case 2: PT(2, PNV, BF); break; default: PT(1, PNV, BF); break; }
#else  // PMT == 6 (AVX2): a group of panels for 1-2 rows
#define TILE(BF) switch (rows * 4 + group) { \
            case 6 * 4 + 1: PT(6, 1, BF); break; case 5 * 4 + 1: PT(5, 1, BF); break; \
            case 4 * 4 + 1: PT(4, 1, BF); break; case 3 * 4 + 1: PT(3, 1, BF); break; \
            case 3 * 4 + 2: PT(3, 2, BF); break; case 2 * 4 + 2: PT(2, 2, BF); break; case 2 * 4 + 1: PT(2, 1, BF); break; \
            case 1 * 4 + 3: PT(1, 3, BF); break; case 1 * 4 + 2: PT(1, 2, BF); break; default: PT(1, 1, BF); break; }
#endif
            if (j->bf16) TILE(1) else TILE(0)
#undef TILE
#undef PT
        }
    }
}

int64_t linear_panel_cols(void) { return PANEL; }

// Splits ctx's panels into claims for `threads` threads; returns the number of claims.
int64_t plinear_plan(plinear_t* ctx, int threads) {
    int64_t np = (ctx->N + PANEL - 1) / PANEL, per = np / (3 * (threads > 1 ? threads : 1));
    per = per < 1 ? 1 : per > 16 ? 16 : per;
    ctx->npanels = np;
    ctx->per_chunk = per;
    return (np + per - 1) / per;
}

// y [M, N] = x [M, K] @ w^T + b with w packed (linear_panel_cols() columns a panel, see the top); bf16: the panels are
// bf16 (see pload).
void linear_packed_f32(const float* x, const void* p, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                       int64_t ldx, int64_t ldy, int threads, int bf16) {
    plinear_t ctx = {x, p, b, NULL, y, M, N, K, ldx, ldy, 0, 0, 0, bf16 != 0};
    parallel_run(plinear_chunk, &ctx, plinear_plan(&ctx, threads), threads);
}

// ---------------------------------------------------------------------------------------------
// argmax over each row (greedy sampling and verification): the first index of the row's maximum,
// a NaN's index if the row has one (first NaN), as torch.argmax. Rows in parallel.
typedef struct { const float* x; int64_t* out; int64_t N, ld; } argmax_t;

static void argmax_row(const void* vctx, int64_t r) {
    const argmax_t* a = (const argmax_t*)vctx;
    const float* row = a->x + r * a->ld;
    int64_t N = a->N, k = 0;
    vf best = vf_set1(-INFINITY);
    vi bidx = vi_set1(0), idx = vi_iota();
    const vi step = vi_set1(16);
    vmask nan = 0;
    for (; k + 16 <= N; k += 16) {
        vf v = vf_loadu(row + k);
        nan |= vf_cmp(v, v, _CMP_UNORD_Q);
        vmask gt = vf_cmp(v, best, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
        best = vf_mask_mov(best, gt, v);
        bidx = vi_mask_mov(bidx, gt, idx);
        idx = vi_add(idx, step);
    }
    if (k < N) {
        vmask mk = vmask_first(N - k);
        vf v = vf_mask_loadu(vf_set1(-INFINITY), mk, row + k);
        nan |= mk & vf_cmp(v, v, _CMP_UNORD_Q);
        vmask gt = vf_cmp(v, best, _CMP_GT_OQ);
        best = vf_mask_mov(best, gt, v);
        bidx = vi_mask_mov(bidx, gt, idx);
    }
    if (nan) {
        for (int64_t j = 0; j < N; j++)
            if (row[j] != row[j]) { a->out[r] = j; return; }
    }
    float m = vf_reduce_max(best);
    vmask at = vf_cmp(best, vf_set1(m), _CMP_EQ_OQ);  // lanes holding the maximum
    a->out[r] = (int64_t)vi_mask_reduce_min_u32(at, bidx);   // the first of them
}

void argmax_rows_f32(const float* x, int64_t* out, int64_t M, int64_t N, int64_t ld, int threads) {
    argmax_t a = {x, out, N, ld};
    parallel_run(argmax_row, &a, M, threads);
}

// ---------------------------------------------------------------------------------------------
// Paged attention for decode/verify rows (fp32): out[t, h] = sum_j softmax_j(scale q[t,h].k_j) v_j over
// the keys row t may see: cache positions j < ctx[t] of its sequence, and new positions
// ctx[t] + i (i < nnew[t]) whose bit i is set in mask[t] (causal: bits 0..row; a tree: its ancestors).
// K/V are read in place from the paged cache [num_blocks, block_size, Hkv, D] through the block table.
// Keys are taken in tiles of 16 from position 0 with an online softmax, each row alone, so a row's
// result does not depend on the other rows of the batch or on how many new tokens follow it.
void attn_item(const void* vctx, int64_t item) {
    const attn_t* a = (const attn_t*)vctx;
    int64_t t = item / a->Hkv, kvh = item % a->Hkv, G = a->Hq / a->Hkv, D = a->D, nv = D / 16;
    int64_t ctx = a->ctx[t], nnew = a->nnew[t], nkeys = ctx + nnew;
    uint64_t bits = (uint64_t)a->mask[t];
    const int32_t* table = a->bt + a->seq[t] * a->bt_w;
    vf acc[MAX_G][MAX_D / 16];
    float m[MAX_G], l[MAX_G];
    for (int64_t g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; for (int64_t v = 0; v < nv; v++) acc[g][v] = vf_zero(); }
    const float* qrow = a->q + t * a->ldq + kvh * G * D;
    for (int64_t j0 = 0; j0 < nkeys; j0 += 16) {
        int64_t n = nkeys - j0 < 16 ? nkeys - j0 : 16;
        uint32_t vis = 0;
        const float *kp[16], *vp[16];
        for (int64_t jj = 0; jj < n; jj++) {
            int64_t j = j0 + jj;
            if (j >= ctx && !((bits >> (j - ctx)) & 1u)) continue;
            int64_t slot = (int64_t)table[j / a->bs] * a->bs + j % a->bs;
            kp[jj] = a->kc + (slot * a->Hkv + kvh) * D;
            vp[jj] = a->vc + (slot * a->Hkv + kvh) * D;
            vis |= 1u << jj;
        }
        if (!vis) continue;
        for (int64_t g = 0; g < G; g++) {
            const float* qg = qrow + g * D;
            float s[16];
            for (int64_t jj = 0; jj < 16; jj++) {
                if (!((vis >> jj) & 1u)) { s[jj] = -INFINITY; continue; }
                vf d = vf_zero();
                for (int64_t v = 0; v < nv; v++) d = vf_fmadd(vf_loadu(qg + v * 16), vf_loadu(kp[jj] + v * 16), d);
                s[jj] = vf_reduce_add(d) * a->scale;
            }
            vf sv = vf_loadu(s);
            float tile_max = vf_mask_reduce_max((vmask)vis, sv);
            float m_new = m[g] > tile_max ? m[g] : tile_max;
            float alpha = m[g] == -INFINITY ? 0.f : expf(m[g] - m_new);
            vf p = vf_maskz_mov((vmask)vis, vf_exp(vf_sub(sv, vf_set1(m_new))));
            float pj[16];
            vf_storeu(pj, p);
            l[g] = l[g] * alpha + vf_reduce_add(p);
            vf va = vf_set1(alpha);
            for (int64_t v = 0; v < nv; v++) acc[g][v] = vf_mul(acc[g][v], va);
            for (int64_t jj = 0; jj < 16; jj++) {
                if (!((vis >> jj) & 1u)) continue;
                vf pb = vf_set1(pj[jj]);
                for (int64_t v = 0; v < nv; v++) acc[g][v] = vf_fmadd(pb, vf_loadu(vp[jj] + v * 16), acc[g][v]);
            }
            m[g] = m_new;
        }
    }
    float* orow = a->out + (t * a->Hq + kvh * G) * D;
    for (int64_t g = 0; g < G; g++) {
        vf inv = vf_set1(l[g] > 0.f ? 1.f / l[g] : 0.f);
        for (int64_t v = 0; v < nv; v++) vf_storeu(orow + g * D + v * 16, vf_mul(acc[g][v], inv));
    }
}

// Returns 0, or -1 when the shapes are outside what this kernel handles (the caller checks first).
int paged_attention_f32(const float* q, const float* kc, const float* vc, float* out, const int32_t* bt, int64_t bt_w,
                        const int64_t* seq, const int64_t* ctx, const int64_t* nnew, const int64_t* mask,
                        int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, int threads) {
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_G || D % 16 || D > MAX_D) return -1;
    attn_t a = {q, kc, vc, out, bt, bt_w, seq, ctx, nnew, mask, Hq, Hkv, D, bs, Hq * D, scale};
    parallel_run(attn_item, &a, T * Hkv, threads);
    return 0;
}

// How many pauses a helper spins for the next call before it sleeps (>= 0); returns the one before.
int set_helper_spin(int n) {
    return atomic_exchange(&spin_limit, n < 0 ? 0 : n);
}
