// A 16-lane fp32 / int32 vector for the native CPU kernels (cpu_decode.c, cpu_layer.c, cpu_prefill.c), one source for
// two instruction sets: AVX-512F (one zmm register a vector, __mmask16 masks) or, built without -mavx512f, AVX2 + FMA
// (two ymm halves a vector, lanes 0-7 and 8-15; masks as 16 bits, lane i = bit i, turned into lane masks per use).
// Every operation is lane-wise except the reductions, whose order is fixed per instruction set: a kernel's results
// are bitwise the same for a row alone or beside others on one build (greedy speculation's equality), and close, not
// bitwise equal, between the two builds. Internal to the library.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define VI static inline __attribute__((always_inline))
typedef uint16_t vmask;  // lane i: bit i

#if defined(__AVX512F__)
#define CPU_SIMD_ISA "avx512"
typedef __m512 vf;
typedef __m512i vi;
VI vf vf_zero(void) { return _mm512_setzero_ps(); }
VI vf vf_set1(float x) { return _mm512_set1_ps(x); }
VI vf vf_loadu(const float* p) { return _mm512_loadu_ps(p); }
VI vf vf_load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
VI void vf_storeu(float* p, vf v) { _mm512_storeu_ps(p, v); }
VI void vf_store(float* p, vf v) { _mm512_store_ps(p, v); }
VI vf vf_maskz_loadu(vmask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }  // lanes off: 0, not read
VI vf vf_mask_loadu(vf src, vmask m, const float* p) { return _mm512_mask_loadu_ps(src, m, p); }
VI void vf_mask_storeu(float* p, vmask m, vf v) { _mm512_mask_storeu_ps(p, m, v); }
VI vf vf_load_bf16(const uint16_t* p) {  // 16 bf16 widened exactly to fp32 (their 16 bits above 16 zero bits)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
VI vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
VI vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
VI vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
VI vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
VI vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
VI vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
VI vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
VI vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
#define vf_cmp(a, b, pred) ((vmask)_mm512_cmp_ps_mask((a), (b), (pred)))
VI vf vf_mask_mov(vf src, vmask m, vf v) { return _mm512_mask_mov_ps(src, m, v); }
VI vf vf_maskz_mov(vmask m, vf v) { return _mm512_maskz_mov_ps(m, v); }
VI float vf_reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
VI float vf_reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
VI vf vf_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
VI vf vf_scale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
VI vi vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
VI vi vi_iota(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
VI vi vi_loadu(const int32_t* p) { return _mm512_loadu_si512(p); }
VI vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
VI vi vi_mask_mov(vi src, vmask m, vi v) { return _mm512_mask_mov_epi32(src, m, v); }
VI vmask vi_cmplt(vi a, vi b) { return (vmask)_mm512_cmplt_epi32_mask(a, b); }  // signed
VI uint32_t vi_mask_reduce_min_u32(vmask m, vi v) { return (uint32_t)_mm512_mask_reduce_min_epu32(m, v); }

#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_SIMD_ISA "avx2"
typedef struct { __m256 lo, hi; } vf;
typedef struct { __m256i lo, hi; } vi;
VI __m256i lanes8(unsigned bits) {  // 8 bits -> 8 lane masks (all ones where set)
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), sel), sel);
}
VI vf vf_zero(void) { return (vf){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
VI vf vf_set1(float x) { return (vf){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
VI vf vf_loadu(const float* p) { return (vf){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
VI vf vf_load(const float* p) { return (vf){_mm256_load_ps(p), _mm256_load_ps(p + 8)}; }
VI void vf_storeu(float* p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
VI void vf_store(float* p, vf v) { _mm256_store_ps(p, v.lo); _mm256_store_ps(p + 8, v.hi); }
VI vf vf_maskz_loadu(vmask m, const float* p) {  // masked-off lanes are not read (vmaskmovps does not fault on them)
    return (vf){_mm256_maskload_ps(p, lanes8(m & 0xffu)), _mm256_maskload_ps(p + 8, lanes8(m >> 8))};
}
VI void vf_mask_storeu(float* p, vmask m, vf v) {
    _mm256_maskstore_ps(p, lanes8(m & 0xffu), v.lo);
    _mm256_maskstore_ps(p + 8, lanes8(m >> 8), v.hi);
}
VI vf vf_mask_mov(vf src, vmask m, vf v) {
    return (vf){_mm256_blendv_ps(src.lo, v.lo, _mm256_castsi256_ps(lanes8(m & 0xffu))),
                _mm256_blendv_ps(src.hi, v.hi, _mm256_castsi256_ps(lanes8(m >> 8)))};
}
VI vf vf_maskz_mov(vmask m, vf v) { return vf_mask_mov(vf_zero(), m, v); }
VI vf vf_mask_loadu(vf src, vmask m, const float* p) { return vf_mask_mov(src, m, vf_maskz_loadu(m, p)); }
VI vf vf_load_bf16(const uint16_t* p) {
    __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
    __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8))), 16);
    return (vf){_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi)};
}
#define VF2(name, op) VI vf name(vf a, vf b) { return (vf){op(a.lo, b.lo), op(a.hi, b.hi)}; }
VF2(vf_add, _mm256_add_ps)
VF2(vf_sub, _mm256_sub_ps)
VF2(vf_mul, _mm256_mul_ps)
VF2(vf_div, _mm256_div_ps)
VF2(vf_max, _mm256_max_ps)
VF2(vf_min, _mm256_min_ps)
#undef VF2
VI vf vf_fmadd(vf a, vf b, vf c) { return (vf){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
VI vf vf_fnmadd(vf a, vf b, vf c) { return (vf){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
#define vf_cmp(a, b, pred)                                                      \
    ((vmask)(_mm256_movemask_ps(_mm256_cmp_ps((a).lo, (b).lo, (pred))) |       \
             (_mm256_movemask_ps(_mm256_cmp_ps((a).hi, (b).hi, (pred))) << 8)))
VI float hsum8(__m256 v) {  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
VI float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
VI float vf_reduce_add(vf v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }
VI float vf_reduce_max(vf v) { return hmax8(_mm256_max_ps(v.lo, v.hi)); }
VI vf vf_round(vf x) {
    return (vf){_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
VI __m256 scale2_8(__m256 p, __m256 n) {  // p * 2^n for integral n in [-126, 127]: 2^n built in the exponent bits
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
VI vf vf_scale2(vf p, vf n) { return (vf){scale2_8(p.lo, n.lo), scale2_8(p.hi, n.hi)}; }
VI vi vi_set1(int32_t x) { return (vi){_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
VI vi vi_iota(void) { return (vi){_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)}; }
VI vi vi_loadu(const int32_t* p) {
    return (vi){_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 8))};
}
VI vi vi_add(vi a, vi b) { return (vi){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
VI vi vi_mask_mov(vi src, vmask m, vi v) {
    return (vi){_mm256_blendv_epi8(src.lo, v.lo, lanes8(m & 0xffu)), _mm256_blendv_epi8(src.hi, v.hi, lanes8(m >> 8))};
}
VI vmask vi_cmplt(vi a, vi b) {
    return (vmask)(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(b.lo, a.lo))) |
                   (_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(b.hi, a.hi))) << 8));
}
VI uint32_t vi_mask_reduce_min_u32(vmask m, vi v) {  // lanes off count as UINT32_MAX
    vi w = vi_mask_mov(vi_set1(-1), m, v);
    __m256i x = _mm256_min_epu32(w.lo, w.hi);
    __m128i s = _mm_min_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    s = _mm_min_epu32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_min_epu32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return (uint32_t)_mm_cvtsi128_si32(s);
}

#else
#error "the native CPU kernels need AVX-512F, or AVX2 and FMA (build with -mavx512f or -mavx2 -mfma)"
#endif

VI vmask vmask_first(int64_t n) { return n >= 16 ? (vmask)0xffffu : (vmask)((1u << n) - 1u); }  // lanes 0..n-1
VI float vf_mask_reduce_max(vmask m, vf v) { return vf_reduce_max(vf_mask_mov(vf_set1(-INFINITY), m, v)); }

VI vf vf_exp(vf x) {  // Cephes expf on [-87, 88]
    x = vf_min(vf_max(x, vf_set1(-87.0f)), vf_set1(88.0f));
    vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fmadd(p, vf_mul(r, r), r);
    p = vf_add(p, vf_set1(1.0f));
    return vf_scale2(p, n);
}
