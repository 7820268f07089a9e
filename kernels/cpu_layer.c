// eagleray: a Llama decoder layer of a decode-sized forward (decode, verification) in one call, fp32, AVX-512 or AVX2; also
// the EAGLE-3 draft's layer (a second input and norm).
//
// For T rows h [T, H]: x = RMSNorm(h) -> qkv = x Wqkv^T -> RoPE on q, k (cos/sin [T, D] given) -> k, v written to
// the paged cache at slots[t] -> paged attention (each row's keys as RowKeys describe) -> h1 = h + att Wo^T ->
// x = RMSNorm(h1) -> gu = x Wgu^T -> a = silu(gate) * up -> out = h1 + a Wdown^T. No biases, no qk-norm, no sliding
// window, one tensor-parallel rank (the caller falls back to the PyTorch layer for those).
// The EAGLE-3 draft's layer (w->hid_norm set) takes the token embeddings e [T, H] too: q/k/v read the 2H features
// x = [RMSNorm_in(e), RMSNorm_hid(h)] (qkv = x Wqkv^T, Wqkv [(Hq + 2 Hkv) D, 2H]) and the residual of the o product is
// h, or RMSNorm_hid(h) with norm_residual (vLLM's norm_before_residual); the rest is the Llama layer's.
//
// Every phase is row-wise: the products are the packed-panel linear of cpu_decode.c (one FMA chain over k in order
// per output), attention takes one row at a time, the norms, RoPE and SiLU one row each on one thread; so a row's
// output is bitwise the same whatever the other rows are and however many threads run (greedy speculation stays
// lossless). Phases run on cpu_decode.c's thread pool, each ending when all its chunks are done.
// Reference: kernels/cpu_layer.py decoder_layer_reference, draft_layer_reference (the same layers in PyTorch).
#define _GNU_SOURCE
#include "cpu_decode.h"
#include <string.h>

// One forward's inputs, the same for every layer. Scratch rows: xn [T, H] ([T, 2H] for a draft layer), qkv [T, (Hq + 2 Hkv) D], att [T, Hq D],
// h1 [T, H], gu [T, 2 I], act [T, I].
typedef struct {
    int64_t T, H, Hq, Hkv, D, I, bs, bt_w, threads;
    const float *cos, *sin;                     // [T, D] each
    const int64_t* slots;                       // [T] cache slot of each row's new K/V
    const int32_t* bt;                          // [B, bt_w] block tables
    const int64_t *seq, *ctx, *nnew, *mask;     // [T] each: the keys each row sees (cpu_decode.RowKeys)
    float *xn, *qkv, *att, *h1, *gu, *act;      // scratch
} layer_step_t;

// One layer's weights: the norms [H], the products packed in panels (cpu_decode.pack), its K/V cache; a draft
// layer's hidden norm (NULL: a Llama layer) and whether its normed hidden is the residual.
typedef struct {
    const float *in_norm, *post_norm, *qkv, *o, *gate_up, *down;
    float *kc, *vc;                             // [num_blocks, bs, Hkv, D] each
    const float* hid_norm;                      // [H] or NULL
    float in_eps, post_eps, scale, hid_eps;
    int32_t norm_residual;
    int32_t bf16;                               // bit i: product i (qkv, o, gate_up, down) packed in bf16 (pload)
} layer_weights_t;

typedef struct { const float *x, *w; float* y; int64_t H, ldy; float eps; } norm_t;  // y rows ldy floats apart

// y[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w: sum of squares in 16 lanes over k in order, then a fixed tree.
static void norm_row(const void* vctx, int64_t t) {
    const norm_t* n = (const norm_t*)vctx;
    const float* x = n->x + t * n->H;
    float* y = n->y + t * n->ldy;
    int64_t H = n->H, k = 0;
    vf ss = vf_zero();
    for (; k + 16 <= H; k += 16) { vf v = vf_loadu(x + k); ss = vf_fmadd(v, v, ss); }
    vmask tail = vmask_first(H - k);
    if (k < H) { vf v = vf_maskz_loadu(tail, x + k); ss = vf_fmadd(v, v, ss); }
    vf r = vf_set1(1.0f / sqrtf(vf_reduce_add(ss) / (float)H + n->eps));
    for (k = 0; k + 16 <= H; k += 16)
        vf_storeu(y + k, vf_mul(vf_mul(vf_loadu(x + k), r), vf_loadu(n->w + k)));
    if (k < H)
        vf_mask_storeu(y + k, tail, vf_mul(vf_mul(vf_maskz_loadu(tail, x + k), r), vf_maskz_loadu(tail, n->w + k)));
}

// y [T, ldy] (its first H columns) = RMSNorm(x [T, H]).
static void norm_rows(const float* x, const float* w, float* y, int64_t ldy, int64_t T, int64_t H, float eps, int threads) {
    norm_t n = {x, w, y, H, ldy, eps};
    parallel_run(norm_row, &n, T, threads);
}

// x [D] <- x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]) (GPT-NeoX layout).
static void rotate(float* x, const float* c, const float* s, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * c[i] - b * s[i];
        x[i + half] = b * c[i + half] + a * s[i + half];
    }
}

typedef struct { const layer_step_t* s; const layer_weights_t* w; } layer_t;

// Row t: RoPE on its q and k heads in place, then its k and v into the cache at slots[t].
static void rope_write_row(const void* vctx, int64_t t) {
    const layer_step_t* s = ((const layer_t*)vctx)->s;
    const layer_weights_t* w = ((const layer_t*)vctx)->w;
    int64_t D = s->D, kv = s->Hkv * D;
    float* row = s->qkv + t * (s->Hq * D + 2 * kv);
    for (int64_t h = 0; h < s->Hq + s->Hkv; h++) rotate(row + h * D, s->cos + t * D, s->sin + t * D, D / 2);
    memcpy(w->kc + s->slots[t] * kv, row + s->Hq * D, (size_t)kv * sizeof(float));
    memcpy(w->vc + s->slots[t] * kv, row + s->Hq * D + kv, (size_t)kv * sizeof(float));
}

// act[t] = silu(gate[t]) * up[t], gu[t] = (gate [I], up [I]).
static void silu_mul_row(const void* vctx, int64_t t) {
    const layer_step_t* s = ((const layer_t*)vctx)->s;
    int64_t I = s->I, i = 0;
    const float *g = s->gu + t * 2 * I, *u = g + I;
    float* a = s->act + t * I;
    const vf one = vf_set1(1.0f);
    for (; i < I; i += 16) {
        vmask mk = vmask_first(I - i);
        vf x = vf_maskz_loadu(mk, g + i);
        vf sig = vf_div(x, vf_add(one, vf_exp(vf_sub(vf_zero(), x))));
        vf_mask_storeu(a + i, mk, vf_mul(sig, vf_maskz_loadu(mk, u + i)));
    }
}

// y [T, N] = x [T, K] @ W^T (+ r [T, N] rows ldr floats apart, a residual, or NULL), W packed; x, y contiguous.
static void product(const float* x, const float* p, int bf16, const float* r, int64_t ldr, float* y, int64_t T,
                    int64_t N, int64_t K, int threads) {
    plinear_t l = {x, p, NULL, r, y, T, N, K, K, N, ldr, 0, 0, bf16 != 0};
    parallel_run(plinear_chunk, &l, plinear_plan(&l, threads), threads);
}

// xn [T, Kin] <- the q/k/v input: RMSNorm(h) (Kin = H) or, for a draft layer, [RMSNorm(e), RMSNorm_hid(h)] (Kin = 2H).
// Returns the o product's residual: h, or the normed hidden (rows 2H apart: *ldr) with norm_residual.
static const float* qkv_input(const layer_step_t* s, const layer_weights_t* w, const float* e, const float* h,
                              int64_t* ldr) {
    int64_t T = s->T, H = s->H;
    int th = (int)s->threads;
    *ldr = H;
    if (e == NULL) {
        norm_rows(h, w->in_norm, s->xn, H, T, H, w->in_eps, th);
        return h;
    }
    norm_rows(e, w->in_norm, s->xn, 2 * H, T, H, w->in_eps, th);
    norm_rows(h, w->hid_norm, s->xn + H, 2 * H, T, H, w->hid_eps, th);
    if (!w->norm_residual) return h;
    *ldr = 2 * H;
    return s->xn + H;
}

// out [T, H] = the layer applied to h [T, H] (out must not be h, nor e); e [T, H]: a draft layer's token embeddings
// (w->hid_norm set), NULL for a Llama layer. Returns 0, or -1 for shapes or inputs it does not handle.
int decoder_layer_f32(const layer_step_t* s, const layer_weights_t* w, const float* h, const float* e, float* out) {
    int64_t T = s->T, H = s->H, Hq = s->Hq, Hkv = s->Hkv, D = s->D, I = s->I, nqkv = (Hq + 2 * Hkv) * D;
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_G || D % 16 || D > MAX_D || out == h || out == e) return -1;
    if ((e == NULL) != (w->hid_norm == NULL)) return -1;
    int th = (int)s->threads;
    layer_t lt = {s, w};
    int64_t ldr;
    const float* res = qkv_input(s, w, e, h, &ldr);
    product(s->xn, w->qkv, w->bf16 & 1, NULL, 0, s->qkv, T, nqkv, e == NULL ? H : 2 * H, th);
    parallel_run(rope_write_row, &lt, T, th);
    attn_t a = {s->qkv, w->kc, w->vc, s->att, s->bt, s->bt_w, s->seq, s->ctx, s->nnew, s->mask, Hq, Hkv, D, s->bs, nqkv, w->scale};
    parallel_run(attn_item, &a, T * Hkv, th);
    product(s->att, w->o, w->bf16 & 2, res, ldr, s->h1, T, H, Hq * D, th);
    norm_rows(s->h1, w->post_norm, s->xn, H, T, H, w->post_eps, th);
    product(s->xn, w->gate_up, w->bf16 & 4, NULL, 0, s->gu, T, 2 * I, H, th);
    parallel_run(silu_mul_row, &lt, T, th);
    product(s->act, w->down, w->bf16 & 8, s->h1, H, out, T, H, I, th);
    return 0;
}

// A prefill's layer between its products (kernels/cpu_prefill.py: the products there are oneDNN's GEMMs, these the
// phases between them, each row-wise on the same thread pool as above).

// y [T, H] = RMSNorm(x [T, H]) * w. Returns 0, or -1 for bad sizes.
int rms_norm_rows_f32(const float* x, const float* w, float* y, int64_t T, int64_t H, float eps, int threads) {
    if (T < 0 || H <= 0) return -1;
    norm_rows(x, w, y, H, T, H, eps, threads);
    return 0;
}

// qkv [T, (Hq + 2 Hkv) D], the q/k/v product of the step's rows: RoPE on q and k in place, k and v written into the
// layer's cache at the step's slots; then att [T, Hq D] = the rows' paged attention over the keys the step gives each
// row: by causal blocks (blocks [nblocks, 2]: first row, rows; kernels/cpu_prefill.c) or, blocks NULL, row by row.
// The step's own scratch pointers are not used. Returns 0, or -1 for head shapes the kernel does not take.
int rope_attention_f32(const layer_step_t* s, const layer_weights_t* w, float* qkv, float* att, const int64_t* blocks,
                       int64_t nblocks) {
    int64_t Hq = s->Hq, Hkv = s->Hkv, D = s->D;
    if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_G || D % 16 || D > MAX_D) return -1;
    layer_step_t rows = *s;
    rows.qkv = qkv;
    rows.att = att;
    layer_t lt = {&rows, w};
    int th = (int)s->threads;
    parallel_run(rope_write_row, &lt, s->T, th);
    attn_t a = {qkv, w->kc, w->vc, att, s->bt, s->bt_w, s->seq, s->ctx, s->nnew, s->mask, Hq, Hkv, D, s->bs, (Hq + 2 * Hkv) * D, w->scale};
    if (blocks == NULL) {
        parallel_run(attn_item, &a, s->T * Hkv, th);
        return 0;
    }
    prefill_attn_t pa = {&a, blocks};
    parallel_run(prefill_attn_block, &pa, nblocks * Hkv, th);
    return 0;
}

// act [T, I] = silu(gate) * up for gu [T, 2 I] = (gate, up) rows. Returns 0, or -1 for bad sizes.
int silu_mul_rows_f32(const float* gu, float* act, int64_t T, int64_t I, int threads) {
    if (T < 0 || I <= 0) return -1;
    layer_step_t s;
    memset(&s, 0, sizeof s);
    s.I = I;
    s.gu = (float*)gu;  // read only
    s.act = act;
    layer_t lt = {&s, NULL};
    parallel_run(silu_mul_row, &lt, T, threads);
    return 0;
}
