// What kernels/cpu_decode.c shares with the fused decoder layer (kernels/cpu_layer.c): the thread pool, the
// packed-panel linear's work items and the paged attention's; the vectors are cpu_simd.h's. Internal to the library.
#pragma once
#include "cpu_simd.h"

#define INTERNAL __attribute__((visibility("hidden")))

// Threads: fn(ctx, 0..nchunks-1) on the caller and up to threads-1 helpers; returns when all are done.
typedef void (*work_fn)(const void* ctx, int64_t chunk);
INTERNAL void parallel_run(work_fn fn, const void* ctx, int64_t nchunks, int threads);

// The packed-panel linear: y = x w^T (+ b) (+ r), r a residual [M, N] (row stride ldr) or NULL.
#if defined(__AVX512F__)
#define PNV 3  // weight vectors a panel: 48 columns
#define PMT 8  // x rows a tile: 8 x 3 accumulators + 3 weight vectors + 1 broadcast, of 32 zmm registers
#else
#define PNV 1  // AVX2 (a vector: two ymm): panels of 16 columns, contiguous (three passes over 48-column panels: slower)
#define PMT 6  // 6 rows x 2 ymm accumulators + a weight vector's halves + 1 broadcast, of 16 ymm registers
#endif
#define PANEL (16 * PNV)
typedef struct {
    const float* x;
    const void* p;  // the packed panels: fp32, or bf16 with bf16 != 0 (widened exactly to fp32 as they are read)
    const float *b, *r;
    float* y;
    int64_t M, N, K, ldx, ldy, ldr, npanels, per_chunk;
    int32_t bf16;
} plinear_t;
INTERNAL int64_t plinear_plan(plinear_t* ctx, int threads);  // sets npanels/per_chunk; returns the claims
INTERNAL void plinear_chunk(const void* ctx, int64_t claim);

// Paged attention of one (row, kv head) item; q rows ldq floats apart, out rows Hq * D.
#define MAX_G 16
#define MAX_D 256
typedef struct {
    const float *q, *kc, *vc;
    float* out;
    const int32_t* bt;
    int64_t bt_w;
    const int64_t *seq, *ctx, *nnew, *mask;
    int64_t Hq, Hkv, D, bs, ldq;
    float scale;
} attn_t;
INTERNAL void attn_item(const void* ctx, int64_t item);

// A prefill's causal attention (kernels/cpu_prefill.c): blocks [n, 2] (first row, rows) of rows of one sequence whose
// keys are all cached (row t sees keys 0..ctx[t]-1, consecutive rows one key more), at most 16 query heads a block.
typedef struct {
    const attn_t* a;
    const int64_t* blocks;
} prefill_attn_t;
INTERNAL void prefill_attn_block(const void* ctx, int64_t item);  // item = block * Hkv + kv head
