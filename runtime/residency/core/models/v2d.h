/* v2d: two doubles in an SSE2 register, or in a struct where there is none; each operation
 * the same IEEE operation on both lanes either way (internal to the residency core).
 *
 *   v2d o = v2d_mul(v2d_set(a, b), v2d_set1(2.0));   // (2a, 2b)
 *   double lo = v2d_lo(o), hi = v2d_hi(o);
 */
#ifndef V2D_H
#define V2D_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#ifdef __SSE2__
typedef __m128d v2d;
static inline v2d v2d_set(double lo, double hi) { return _mm_set_pd(hi, lo); }
static inline v2d v2d_set1(double x) { return _mm_set1_pd(x); }
static inline v2d v2d_add(v2d a, v2d b) { return _mm_add_pd(a, b); }
static inline v2d v2d_sub(v2d a, v2d b) { return _mm_sub_pd(a, b); }
static inline v2d v2d_mul(v2d a, v2d b) { return _mm_mul_pd(a, b); }
static inline v2d v2d_div(v2d a, v2d b) { return _mm_div_pd(a, b); }
static inline v2d v2d_max(v2d a, v2d b) { return _mm_max_pd(a, b); }
static inline double v2d_lo(v2d a) { return _mm_cvtsd_f64(a); }
static inline double v2d_hi(v2d a) { return _mm_cvtsd_f64(_mm_unpackhi_pd(a, a)); }
/* 2^k of kr = k + 1.5 2^52 (|k| < 1022): its low bits hold k */
static inline v2d v2d_exp2_rounded(v2d kr) {
    const __m128i k = _mm_add_epi64(_mm_castpd_si128(kr), _mm_set1_epi64x(1023));
    return _mm_castsi128_pd(_mm_slli_epi64(k, 52));
}
#else
typedef struct { double lo, hi; } v2d;
static inline v2d v2d_set(double lo, double hi) { return (v2d) {lo, hi}; }
static inline v2d v2d_set1(double x) { return (v2d) {x, x}; }
static inline v2d v2d_add(v2d a, v2d b) { return (v2d) {a.lo + b.lo, a.hi + b.hi}; }
static inline v2d v2d_sub(v2d a, v2d b) { return (v2d) {a.lo - b.lo, a.hi - b.hi}; }
static inline v2d v2d_mul(v2d a, v2d b) { return (v2d) {a.lo * b.lo, a.hi * b.hi}; }
static inline v2d v2d_div(v2d a, v2d b) { return (v2d) {a.lo / b.lo, a.hi / b.hi}; }
static inline v2d v2d_max(v2d a, v2d b) { return (v2d) {fmax(a.lo, b.lo), fmax(a.hi, b.hi)}; }
static inline double v2d_lo(v2d a) { return a.lo; }
static inline double v2d_hi(v2d a) { return a.hi; }
static inline double exp2_rounded(double kr) {  /* (v2d_exp2_rounded's, one lane) */
    uint64_t bits;
    memcpy(&bits, &kr, sizeof bits);
    bits = (bits + 1023) << 52;
    memcpy(&kr, &bits, sizeof kr);
    return kr;
}
static inline v2d v2d_exp2_rounded(v2d kr) {
    return (v2d) {exp2_rounded(kr.lo), exp2_rounded(kr.hi)};
}
#endif

#endif
