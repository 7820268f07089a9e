// eagleray CPU linear for small M (decode, verification, drafting): y = x w^T + b in fp32, AVX-512.
//
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]);  w [N, K] row-major, x [M, K] (row stride ldx), y [M, N] (row stride ldy)
//
// Memory-bound at these sizes: each weight row is streamed from DRAM once and reused from L1 for
// every x row. Each y[m, n] is accumulated in one fixed order (16-lane FMA over k in steps of 16,
// masked tail, then one horizontal sum) whatever M, the row blocking or the thread count is, so a
// token's logits are bitwise the same when it is decoded alone or verified beside k others.
// Built and loaded by kernels/cpu_decode.py; reference: torch.nn.functional.linear.
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>
static inline float dot_row(const float* w, const float* x, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), acc);
    if (k < K) { __mmask16 m = (__mmask16)((1u << (K - k)) - 1); acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + k), _mm512_maskz_loadu_ps(m, x + k), acc); }
    return _mm512_reduce_add_ps(acc);
}
#define FMA4(xv, a0, a1, a2, a3, k) \
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + k), xv, a0); a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + k), xv, a1); \
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + k), xv, a2); a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w3 + k), xv, a3);
#define FMA4M(xv, a0, a1, a2, a3, k, mk) \
    a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, w0 + k), xv, a0); a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, w1 + k), xv, a1); \
    a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, w2 + k), xv, a2); a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, w3 + k), xv, a3);
static inline void store4(float* ym, const float* b, int64_t n0, __m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    ym[0] = _mm512_reduce_add_ps(a0) + (b ? b[n0] : 0.f);
    ym[1] = _mm512_reduce_add_ps(a1) + (b ? b[n0 + 1] : 0.f);
    ym[2] = _mm512_reduce_add_ps(a2) + (b ? b[n0 + 2] : 0.f);
    ym[3] = _mm512_reduce_add_ps(a3) + (b ? b[n0 + 3] : 0.f);
}
// Four weight rows against the x rows; x rows in pairs (8 accumulators), each y[m, n] summed in one fixed order.
#define PREFETCH_NEXT(k) do { const char* nx = (const char*)(w0 + 4 * K + (k)); \
    _mm_prefetch(nx, _MM_HINT_T0); _mm_prefetch(nx + 4 * K, _MM_HINT_T0); \
    _mm_prefetch(nx + 8 * K, _MM_HINT_T0); _mm_prefetch(nx + 12 * K, _MM_HINT_T0); } while (0)
// (the next block's four rows, one line each per 16 floats consumed: DRAM latency hidden behind this block's FMAs)
static void rows4(const float* w, const float* x, float* y, const float* b, int64_t n0, int64_t M, int64_t K, int64_t ldx, int64_t ldy) {
    const float* w0 = w + n0 * K; const float* w1 = w0 + K; const float* w2 = w1 + K; const float* w3 = w2 + K;
    int64_t kt = K & ~(int64_t)15;
    __mmask16 mk = (__mmask16)((1u << (K - kt)) - 1);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        const float* xa = x + m * ldx;
        __m512 a[4][4];
        for (int i = 0; i < 4; i++) for (int r = 0; r < 4; r++) a[i][r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < kt; k += 16) {
            if (m == 0) PREFETCH_NEXT(k);
            __m512 wv[4] = {_mm512_loadu_ps(w0 + k), _mm512_loadu_ps(w1 + k), _mm512_loadu_ps(w2 + k), _mm512_loadu_ps(w3 + k)};
            for (int i = 0; i < 4; i++) {
                __m512 xv = _mm512_loadu_ps(xa + i * ldx + k);
                for (int r = 0; r < 4; r++) a[i][r] = _mm512_fmadd_ps(wv[r], xv, a[i][r]);
            }
        }
        if (kt < K) {
            __m512 wv[4] = {_mm512_maskz_loadu_ps(mk, w0 + kt), _mm512_maskz_loadu_ps(mk, w1 + kt), _mm512_maskz_loadu_ps(mk, w2 + kt), _mm512_maskz_loadu_ps(mk, w3 + kt)};
            for (int i = 0; i < 4; i++) {
                __m512 xv = _mm512_maskz_loadu_ps(mk, xa + i * ldx + kt);
                for (int r = 0; r < 4; r++) a[i][r] = _mm512_fmadd_ps(wv[r], xv, a[i][r]);
            }
        }
        for (int i = 0; i < 4; i++) store4(y + (m + i) * ldy + n0, b, n0, a[i][0], a[i][1], a[i][2], a[i][3]);
    }
    for (; m + 2 <= M; m += 2) {
        const float* xa = x + m * ldx; const float* xb = xa + ldx;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps(), c3 = _mm512_setzero_ps();
        for (int64_t k = 0; k < kt; k += 16) {
            if (m == 0) PREFETCH_NEXT(k);
            __m512 wa = _mm512_loadu_ps(w0 + k), wb = _mm512_loadu_ps(w1 + k), wc = _mm512_loadu_ps(w2 + k), wd = _mm512_loadu_ps(w3 + k);
            __m512 xv = _mm512_loadu_ps(xa + k), xu = _mm512_loadu_ps(xb + k);
            a0 = _mm512_fmadd_ps(wa, xv, a0); a1 = _mm512_fmadd_ps(wb, xv, a1); a2 = _mm512_fmadd_ps(wc, xv, a2); a3 = _mm512_fmadd_ps(wd, xv, a3);
            c0 = _mm512_fmadd_ps(wa, xu, c0); c1 = _mm512_fmadd_ps(wb, xu, c1); c2 = _mm512_fmadd_ps(wc, xu, c2); c3 = _mm512_fmadd_ps(wd, xu, c3);
        }
        if (kt < K) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, xa + kt), xu = _mm512_maskz_loadu_ps(mk, xb + kt);
            FMA4M(xv, a0, a1, a2, a3, kt, mk)
            FMA4M(xu, c0, c1, c2, c3, kt, mk)
        }
        store4(y + m * ldy + n0, b, n0, a0, a1, a2, a3);
        store4(y + (m + 1) * ldy + n0, b, n0, c0, c1, c2, c3);
    }
    for (; m < M; m++) {
        const float* xa = x + m * ldx;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (int64_t k = 0; k < kt; k += 16) {
            if (m == 0) PREFETCH_NEXT(k);
            __m512 xv = _mm512_loadu_ps(xa + k);
            FMA4(xv, a0, a1, a2, a3, k)
        }
        if (kt < K) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, xa + kt);
            FMA4M(xv, a0, a1, a2, a3, kt, mk)
        }
        store4(y + m * ldy + n0, b, n0, a0, a1, a2, a3);
    }
}
// ---------------------------------------------------------------------------------------------
// Threads. Not OpenMP: an OpenMP region ends in a barrier that waits for every team thread, so one
// thread descheduled by another process (a Serve ingress, a test runner) stalls every call for a
// whole scheduler slice. Here the calling thread and up to MAX_HELPERS helper threads claim chunks
// of 4-row blocks from one atomic counter; the caller returns when every chunk is done, so a helper
// that has not woken up simply gets no work. Helpers spin briefly, then sleep on a futex.
#define MAX_HELPERS 15
typedef void (*work_fn)(const void* ctx, int64_t chunk);
typedef struct { work_fn fn; const void* ctx; int64_t nchunks; } job_t;
static job_t job;
static _Atomic uint64_t state;     // (generation << 32) | next chunk
static _Atomic int64_t done;       // chunks finished in this generation
static _Atomic uint32_t wake_word; // futex word: bumped on every new generation
static _Atomic int sleepers;
static int nhelpers;
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
            if (++spins < 20000) { _mm_pause(); continue; }
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
static void parallel_run(work_fn fn, const void* ctx, int64_t nchunks, int threads) {
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
    pthread_mutex_unlock(&call_lock);
}

// ---------------------------------------------------------------------------------------------
// linear
#define CHUNK_BLOCKS 16  // 64 weight rows per claim
typedef struct { const float *x, *w, *b; float* y; int64_t M, N, K, ldx, ldy, nblocks; } linear_t;

static void linear_chunk(const void* ctx, int64_t c) {
    const linear_t* j = (const linear_t*)ctx;
    int64_t b0 = c * CHUNK_BLOCKS, b1 = b0 + CHUNK_BLOCKS < j->nblocks ? b0 + CHUNK_BLOCKS : j->nblocks;
    for (int64_t i = b0; i < b1; i++) rows4(j->w, j->x, j->y, j->b, i * 4, j->M, j->K, j->ldx, j->ldy);
}

void linear_f32(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                int64_t ldx, int64_t ldy, int threads) {
    int64_t nb = N / 4;
    linear_t ctx = {x, w, b, y, M, N, K, ldx, ldy, nb};
    parallel_run(linear_chunk, &ctx, (nb + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS, threads);
    for (int64_t n = nb * 4; n < N; n++)
        for (int64_t m = 0; m < M; m++) y[m * ldy + n] = dot_row(w + n * K, x + m * ldx, K) + (b ? b[n] : 0.f);
}

// ---------------------------------------------------------------------------------------------
// Paged attention for decode/verify rows (fp32): out[t, h] = sum_j softmax_j(scale q[t,h].k_j) v_j over
// the keys row t may see: cache positions j < ctx[t] of its sequence, and new positions
// ctx[t] + i (i < nnew[t]) whose bit i is set in mask[t] (causal: bits 0..row; a tree: its ancestors).
// K/V are read in place from the paged cache [num_blocks, block_size, Hkv, D] through the block table.
// Keys are taken in tiles of 16 from position 0 with an online softmax, each row alone, so a row's
// result does not depend on the other rows of the batch or on how many new tokens follow it.
static inline __m512 exp512(__m512 x) {  // Cephes expf on [-87, 88]
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#define MAX_G 16
#define MAX_D 256
typedef struct {
    const float *q, *kc, *vc; float* out; const int32_t* bt; int64_t bt_w;
    const int64_t *seq, *ctx, *nnew, *mask; int64_t Hq, Hkv, D, bs; float scale;
} attn_t;

static void attn_item(const void* vctx, int64_t item) {
    const attn_t* a = (const attn_t*)vctx;
    int64_t t = item / a->Hkv, kvh = item % a->Hkv, G = a->Hq / a->Hkv, D = a->D, nv = D / 16;
    int64_t ctx = a->ctx[t], nnew = a->nnew[t], nkeys = ctx + nnew;
    uint64_t bits = (uint64_t)a->mask[t];
    const int32_t* table = a->bt + a->seq[t] * a->bt_w;
    __m512 acc[MAX_G][MAX_D / 16];
    float m[MAX_G], l[MAX_G];
    for (int64_t g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; for (int64_t v = 0; v < nv; v++) acc[g][v] = _mm512_setzero_ps(); }
    const float* qrow = a->q + (t * a->Hq + kvh * G) * D;
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
                __m512 d = _mm512_setzero_ps();
                for (int64_t v = 0; v < nv; v++) d = _mm512_fmadd_ps(_mm512_loadu_ps(qg + v * 16), _mm512_loadu_ps(kp[jj] + v * 16), d);
                s[jj] = _mm512_reduce_add_ps(d) * a->scale;
            }
            __m512 sv = _mm512_loadu_ps(s);
            float tile_max = _mm512_mask_reduce_max_ps((__mmask16)vis, sv);
            float m_new = m[g] > tile_max ? m[g] : tile_max;
            float alpha = m[g] == -INFINITY ? 0.f : expf(m[g] - m_new);
            __m512 p = _mm512_maskz_mov_ps((__mmask16)vis, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
            float pj[16];
            _mm512_storeu_ps(pj, p);
            l[g] = l[g] * alpha + _mm512_reduce_add_ps(p);
            __m512 va = _mm512_set1_ps(alpha);
            for (int64_t v = 0; v < nv; v++) acc[g][v] = _mm512_mul_ps(acc[g][v], va);
            for (int64_t jj = 0; jj < 16; jj++) {
                if (!((vis >> jj) & 1u)) continue;
                __m512 pb = _mm512_set1_ps(pj[jj]);
                for (int64_t v = 0; v < nv; v++) acc[g][v] = _mm512_fmadd_ps(pb, _mm512_loadu_ps(vp[jj] + v * 16), acc[g][v]);
            }
            m[g] = m_new;
        }
    }
    float* orow = a->out + (t * a->Hq + kvh * G) * D;
    for (int64_t g = 0; g < G; g++) {
        __m512 inv = _mm512_set1_ps(l[g] > 0.f ? 1.f / l[g] : 0.f);
        for (int64_t v = 0; v < nv; v++) _mm512_storeu_ps(orow + g * D + v * 16, _mm512_mul_ps(acc[g][v], inv));
    }
}

// Returns 0, or -1 when the shapes are outside what this kernel handles (the caller checks first).
int paged_attention_f32(const float* q, const float* kc, const float* vc, float* out, const int32_t* bt, int64_t bt_w,
                        const int64_t* seq, const int64_t* ctx, const int64_t* nnew, const int64_t* mask,
                        int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, int threads) {
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_G || D % 16 || D > MAX_D) return -1;
    attn_t a = {q, kc, vc, out, bt, bt_w, seq, ctx, nnew, mask, Hq, Hkv, D, bs, scale};
    parallel_run(attn_item, &a, T * Hkv, threads);
    return 0;
}
