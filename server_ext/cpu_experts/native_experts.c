/* CPU expert MLPs straight from the host bank rows (bf16 or FP8 e4m3, row-major [N, K]), no weight copy.
 *
 * Why our own: decode is a GEMV per expert (1-8 tokens), bound by DRAM reads of the weights.
 * The plain layout is already the GEMV-friendly one (each output is a dot product of one
 * contiguous row); kt-kernel and vLLM-cpu's MoE kernels repack weights into their own layout
 * (a second copy of the bank), and torch's bf16 GEMV scales poorly with threads. With
 * AVX512-BF16 (Zen 4, Sapphire Rapids) rows meet bf16 activations in vdpbf16ps; with plain
 * AVX-512 weights are widened to fp32 in registers (a shift) and FMA'd; activations stay in L1
 * and every weight byte is read once per call whatever the token count.
 *
 * FP8 (e4m3fn) rows are dequantized in registers, exactly. On a CPU with AVX512-BF16 and VBMI, two
 * vpermi2b lookups turn 64 bytes into bf16 that meet the bf16 activations in vdpbf16ps, and the
 * scale multiplies the row's dot product once (one scale per row: per-tensor, per-shard) or each
 * block's sum of its 64-column chunks once ([bn, bk] blocks, e.g. bk = 128). Otherwise (and for the
 * columns of a block past its last 64-column chunk) each byte becomes an fp16 bit pattern with one shift and one mask
 * (the e4m3 value times 2^-8, subnormals included), vcvtph2ps widens it, and the scale times 2^8
 * multiplies each decoded chunk of a block (w * s: the fp32 product a dequantize-then-matmul
 * computes) or the dot product at the end. Activations stay bf16 (no activation quantization:
 * the CPU's result is the unquantized-activation one). e4m3fn's NaN (0x7f / 0xff) reads as 480.
 *
 * Semantics follow vLLM's fused MoE on bf16: h = bf16(x W13^T) (fp32 accumulation),
 * a = bf16(bf16(silu(h_gate)) * h_up) (CUDA silu_and_mul), y = bf16(fp32(a W2^T) * w) (routing
 * weight applied to the fp32 accumulator, as MUL_ROUTED_WEIGHT does), one output per pair.
 *
 * Threads, two entries:
 *  - serving: the team (below) -- persistent threads pinned to the configured cores
 *    (reap_cpu_experts_set_cpus) that take layer steps from a device-mapped mailbox; vLLM's own
 *    threads keep their cores. Two work phases in one queue; a group's second phase waits only for
 *    its own first phase.
 *  - CpuExperts' native backend (benchmarks, tests): one OpenMP team per call with num_threads(n),
 *    pinned the same way. Call it from a dedicated host thread: OpenMP keeps one team per calling
 *    thread, so torch's intra-op team on the main thread is neither resized nor reused. On shared,
 *    oversubscribed cores run with OMP_WAIT_POLICY=passive (a spinning thread waiting on a
 *    descheduled one costs a time slice per barrier: measured 4x slower on the 2-core CI box).
 * GEMM items are handed out dynamically in both, so a thread preempted by someone else's delays
 * only its current item.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sys/prctl.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define RB 4 /* rows per micro-tile */
#define TB 4 /* tokens per micro-tile */
#define NB 32 /* rows per work item */

static int g_cpus[1024];
static int g_ncpus = 0;
static int g_gen = 1;
static int g_have_all = 0;
static cpu_set_t g_all; /* the setter's mask when first called: what "unpinned" restores */
static __thread int t_gen = 0;

/* Pin the team's threads (the calling thread is thread 0) to cpus[tid % n]; n = 0 unpins. */
int reap_cpu_experts_set_cpus(const int* cpus, int n) {
  if (n < 0 || n > 1024) return -1;
  if (!g_have_all && sched_getaffinity(0, sizeof(g_all), &g_all) == 0) g_have_all = 1;
  for (int i = 0; i < n; i++) g_cpus[i] = cpus[i];
  g_ncpus = n;
  __atomic_add_fetch(&g_gen, 1, __ATOMIC_SEQ_CST);
  return 0;
}

static void pin_self(int tid) {
  int gen = __atomic_load_n(&g_gen, __ATOMIC_SEQ_CST);
  if (t_gen == gen) return;
  t_gen = gen;
  if (g_ncpus == 0) {
    if (g_have_all) pthread_setaffinity_np(pthread_self(), sizeof(g_all), &g_all);
    return;
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(g_cpus[tid % g_ncpus], &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

static inline float bf16_to_f32(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN kept quiet */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* Activations (x and a) as the dot kernels want them: bf16 pairs for AVX512-BF16's vdpbf16ps
 * (32 MACs per instruction, no widening of W), else fp32 for widen-and-FMA. Both are exact:
 * every activation value is a bf16 number. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define USE_DPBF16 1
typedef uint16_t act_t;
static inline act_t to_act(uint16_t b) { return b; }
static inline float act_f32(act_t a) { return bf16_to_f32(a); }
static inline act_t act_from_f32(float f) { return f32_to_bf16(f); }
#else
#define USE_DPBF16 0
typedef float act_t;
static inline act_t to_act(uint16_t b) { return bf16_to_f32(b); }
static inline float act_f32(act_t a) { return a; }
static inline act_t act_from_f32(float f) { return round_bf16(f); }
#endif

#if defined(__AVX512F__)
#if USE_DPBF16
#define STEP 32
static inline __m512 mac(__m512 acc, const uint16_t* w, const act_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void*)w), (__m512bh)_mm512_loadu_si512((const void*)x));
}
#else
#define STEP 16
static inline __m512 widen(const uint16_t* w) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)w)), 16));
}
static inline __m512 mac(__m512 acc, const uint16_t* w, const act_t* x) {
  return _mm512_fmadd_ps(widen(w), _mm512_loadu_ps(x), acc);
}
#endif
#endif

/* Y[t * RB + r] = sum_k W[r][k] * X[t][k] for r < RB, t < TB (callers pad with repeats). */
static void tile_rb_tb(const uint16_t* const* W, const act_t* const* X, int K, float* Y) {
  int k = 0;
#if defined(__AVX512F__)
  __m512 acc[RB][TB];
  for (int r = 0; r < RB; r++)
    for (int t = 0; t < TB; t++) acc[r][t] = _mm512_setzero_ps();
  for (; k + STEP <= K; k += STEP)
    for (int r = 0; r < RB; r++)
      for (int t = 0; t < TB; t++) acc[r][t] = mac(acc[r][t], W[r] + k, X[t] + k);
  for (int r = 0; r < RB; r++)
    for (int t = 0; t < TB; t++) Y[t * RB + r] = _mm512_reduce_add_ps(acc[r][t]);
#else
  for (int r = 0; r < RB; r++)
    for (int t = 0; t < TB; t++) Y[t * RB + r] = 0.0f;
#endif
  for (int r = 0; r < RB; r++)
    for (int t = 0; t < TB; t++) {
      float s = 0.0f;
      for (int kk = k; kk < K; kk++) s += bf16_to_f32(W[r][kk]) * act_f32(X[t][kk]);
      Y[t * RB + r] += s;
    }
}

/* The single-token case (batch-1 decode): RB rows against one vector, no padding waste. */
static void tile_rb_1(const uint16_t* const* W, const act_t* X, int K, float* Y) {
  int k = 0;
#if defined(__AVX512F__)
  __m512 acc[RB];
  for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
  for (; k + STEP <= K; k += STEP)
    for (int r = 0; r < RB; r++) acc[r] = mac(acc[r], W[r] + k, X + k);
  for (int r = 0; r < RB; r++) Y[r] = _mm512_reduce_add_ps(acc[r]);
#else
  for (int r = 0; r < RB; r++) Y[r] = 0.0f;
#endif
  for (int r = 0; r < RB; r++) {
    float s = 0.0f;
    for (int kk = k; kk < K; kk++) s += bf16_to_f32(W[r][kk]) * act_f32(X[kk]);
    Y[r] += s;
  }
}

/* e4m3fn -> fp32 (the scalar tails and the non-AVX-512 build; NaN patterns read as 480 like the vector path). */
static inline float fp8_to_f32(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float v = e ? ldexpf(1.0f + (float)m / 8.0f, e - 7) : ldexpf((float)m / 8.0f, -6);
  return (b & 0x80) ? -v : v;
}

#if defined(__AVX512F__)
/* 16 e4m3 bytes -> 16 fp32 values times 2^-8 (exact): sign-extend to 16 bits, shift the exponent and
 * mantissa into fp16's bits 13..7 (the sign copies land in bits 15 and 14), clear bit 14, widen. */
static inline __m512 fp8x16(const uint8_t* p) {
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBFFF));
  return _mm512_cvtph_ps(h);
}
#if USE_DPBF16 && defined(__AVX512VBMI__)
#define FP8_BF16 1 /* one-block FP8 rows decode to bf16 and meet the activations in vdpbf16ps */
#define FP8_ONE_BLOCK_DECODE_SCALE 1.0f /* bf16 values are the e4m3 values */
/* The bf16 bits of each e4m3 magnitude (byte & 0x7f; 0x7f, NaN, as 480), low and high bytes: two
 * vpermi2b lookups decode 64 weights, the sign goes into the high byte. */
static const uint8_t E4M3_BF16_LO[128] __attribute__((aligned(64))) = {
    0x00, 0x00, 0x80, 0xc0, 0x00, 0x20, 0x40, 0x60, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0};
static const uint8_t E4M3_BF16_HI[128] __attribute__((aligned(64))) = {
    0x00, 0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c,
    0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d,
    0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e,
    0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f,
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
    0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
    0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
    0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43};
#define FP8_PREFETCH 2048 /* bytes ahead in the row (the next rows' for w13): measured best of 256, 1024, 2048 on the 2-core box */
/* 64 e4m3 bytes -> 64 bf16 of the same values, as two vectors in the order vpunpck{l,h}bw leaves them:
 * *wa = bytes {0-7, 16-23, 32-39, 48-55}, *wb = {8-15, 24-31, 40-47, 56-63} (x64_pair matches x). */
static inline void fp8x64_bf16(const uint8_t* p, __m512i* wa, __m512i* wb) {
  const __m512i b = _mm512_loadu_si512((const void*)p);
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512((const void*)E4M3_BF16_LO), b,
                                              _mm512_load_si512((const void*)(E4M3_BF16_LO + 64)));
  __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512((const void*)E4M3_BF16_HI), b,
                                        _mm512_load_si512((const void*)(E4M3_BF16_HI + 64)));
  hi = _mm512_ternarylogic_epi32(hi, b, _mm512_set1_epi8((char)0x80), 0xF8); /* hi | (b & 0x80) */
  *wa = _mm512_unpacklo_epi8(lo, hi);
  *wb = _mm512_unpackhi_epi8(lo, hi);
}
/* 64 bf16 activations in fp8x64_bf16's order: 128-bit lanes {0, 2} and {1, 3} of each half. */
static inline void x64_pair(const act_t* x, __m512i* xa, __m512i* xb) {
  const __m512i x0 = _mm512_loadu_si512((const void*)x), x1 = _mm512_loadu_si512((const void*)(x + 32));
  *xa = _mm512_shuffle_i64x2(x0, x1, 0x88);
  *xb = _mm512_shuffle_i64x2(x0, x1, 0xDD);
}
/* sum[r][t] += W[r][k..] . X[t][k..] over the 64-byte chunks of [k, k1) (exact products, fp32 sums); returns the
 * first column it did not take. Both FP8 layouts use it: one block per row sums the whole row, blocks sum each block. */
static inline __attribute__((always_inline)) int fp8_bf16_chunks(const uint8_t* const* W, const act_t* const* X, int k, int k1,
                                                                 __m512 sum[RB][TB], const int NT) {
  for (; k + 64 <= k1; k += 64) {
    __m512i xa[TB], xb[TB];
    for (int t = 0; t < NT; t++) x64_pair(X[t] + k, &xa[t], &xb[t]);
    for (int r = 0; r < RB; r++) {
      __m512i wa, wb;
      _mm_prefetch((const char*)(W[r] + k + FP8_PREFETCH), _MM_HINT_T0);
      fp8x64_bf16(W[r] + k, &wa, &wb);
      for (int t = 0; t < NT; t++)
        sum[r][t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(sum[r][t], (__m512bh)wa, (__m512bh)xa[t]), (__m512bh)wb, (__m512bh)xb[t]);
    }
  }
  return k;
}
#else
#define FP8_BF16 0 /* fp8x16 and fp32 FMAs */
#define FP8_ONE_BLOCK_DECODE_SCALE 256.0f /* fp8x16's 2^-8 */
#endif
static inline __m512 act16(const act_t* x) { /* 16 activations as fp32 */
#if USE_DPBF16
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
#else
  return _mm512_loadu_ps(x);
#endif
}
#endif

/* FP8 rows: Y[t * RB + r] = sum_k (W[r][k] * S[r][k / bk]) * X[t][k] for r < RB, t < NT (NT: 1 or TB,
 * a constant after inlining). S[r] is row r's scale row ([nbk] scales, one per bk columns). Each
 * chunk of a row is decoded once and FMA'd into NT tokens. One block per row (per-tensor and
 * per-shard scales: bk >= K) leaves the scale to the end -- (sum_k w x) * s, one multiply per output
 * instead of one per 16 weights; blocks sum their 64-byte chunks in bf16 (FP8_BF16) and scale the
 * block's sum, and multiply each 16-byte chunk of the rest by its block's scale. */
static inline __attribute__((always_inline)) void tile8(const uint8_t* const* W, const float* const* S, int bk,
                                                        const act_t* const* X, int K, float* Y, const int NT) {
  float tail[RB * TB];
  for (int i = 0; i < RB * TB; i++) tail[i] = 0.0f;
  const int one_block = bk >= K;
#if defined(__AVX512F__)
  __m512 acc[RB][TB];
  for (int r = 0; r < RB; r++)
    for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();
#endif
  for (int k0 = 0, kb = 0; k0 < K; k0 += bk, kb++) {
    const int k1 = K - k0 < bk ? K : k0 + bk;
    int k = k0;
#if defined(__AVX512F__)
    if (one_block) {
#if FP8_BF16
      k = fp8_bf16_chunks(W, X, k, k1, acc, NT);
#else
      for (; k + 16 <= k1; k += 16) {
        __m512 xv[TB];
        for (int t = 0; t < NT; t++) xv[t] = act16(X[t] + k);
        for (int r = 0; r < RB; r++) {
          const __m512 wv = fp8x16(W[r] + k);
          for (int t = 0; t < NT; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
      }
#endif
    } else {
#if FP8_BF16
      /* 64-byte chunks of the block decode to bf16 and meet the activations in vdpbf16ps (exact products,
       * fp32 sums) into a block sum the block's scale then multiplies once: (sum_k w x) * s. With TB
       * tokens the block sums and acc need more than the 32 vector registers (gcc 12 keeps part of them
       * in L1 through the loop); one token fits. */
      if (k + 64 <= k1) {
        __m512 part[RB][TB];
        for (int r = 0; r < RB; r++)
          for (int t = 0; t < NT; t++) part[r][t] = _mm512_setzero_ps();
        k = fp8_bf16_chunks(W, X, k, k1, part, NT);
        for (int r = 0; r < RB; r++) {
          const __m512 s = _mm512_set1_ps(S[r][kb]);
          for (int t = 0; t < NT; t++) acc[r][t] = _mm512_fmadd_ps(part[r][t], s, acc[r][t]);
        }
      }
#endif
      __m512 sc[RB];
      for (int r = 0; r < RB; r++) sc[r] = _mm512_set1_ps(S[r][kb] * 256.0f);
      for (; k + 16 <= k1; k += 16) {
        __m512 xv[TB];
        for (int t = 0; t < NT; t++) xv[t] = act16(X[t] + k);
        for (int r = 0; r < RB; r++) {
          const __m512 wv = _mm512_mul_ps(fp8x16(W[r] + k), sc[r]);
          for (int t = 0; t < NT; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
      }
    }
#endif
    for (; k < k1; k++)
      for (int r = 0; r < RB; r++) {
        const float wv = fp8_to_f32(W[r][k]) * (one_block ? 1.0f : S[r][kb]);
        for (int t = 0; t < NT; t++) tail[t * RB + r] += wv * act_f32(X[t][k]);
      }
  }
  for (int r = 0; r < RB; r++)
    for (int t = 0; t < NT; t++) {
#if defined(__AVX512F__)
      /* one block: the vector sums carry no scale yet (and fp8x16's 2^-8) */
      const float v = one_block ? _mm512_reduce_add_ps(acc[r][t]) * (S[r][0] * FP8_ONE_BLOCK_DECODE_SCALE) : _mm512_reduce_add_ps(acc[r][t]);
#else
      const float v = 0.0f;
#endif
      Y[t * RB + r] = v + (one_block ? tail[t * RB + r] * S[r][0] : tail[t * RB + r]);
    }
}
static void tile8_rb_tb(const uint8_t* const* W, const float* const* S, int bk, const act_t* const* X, int K, float* Y) {
  tile8(W, S, bk, X, K, Y, TB);
}
static void tile8_rb_1(const uint8_t* const* W, const float* const* S, int bk, const act_t* X, int K, float* Y) {
  const act_t* xs[1] = {X};
  tile8(W, S, bk, xs, K, Y, 1);
}

/* One expert's matrix as the dot kernels read it: rows of K weights, bf16 or FP8 with scales.
 * FP8: the scale of row n, columns [kb * bk, (kb + 1) * bk) is s[(n / bn) * nbk + kb]. */
typedef struct {
  const uint8_t* w; /* row 0 */
  int64_t row_bytes;
  int fp8;
  const float* s;
  int bn, bk, nbk;
} mat_t;

/* Rows [n0, n1) of matrix M [N, K] against np vectors; vector q is X + (idx ? idx[q] : q) * xstride.
 * Y[q * ldy + n - ycol0] for n in [n0, n1). Short tiles repeat their first row / vector (results dropped). */
static void rows_block(const mat_t* M, int K, int n0, int n1, const act_t* X, const int32_t* idx, int64_t xstride,
                       int np, float* Y, int64_t ldy, int ycol0) {
  float tmp[TB * RB];
  const uint8_t* wr[RB];
  const float* sr[RB];
  const act_t* xr[TB];
  for (int n = n0; n < n1; n += RB) {
    int nr = n1 - n < RB ? n1 - n : RB;
    for (int r = 0; r < RB; r++) {
      const int row = n + (r < nr ? r : 0);
      wr[r] = M->w + (int64_t)row * M->row_bytes;
      sr[r] = M->fp8 ? M->s + (int64_t)(row / M->bn) * M->nbk : NULL;
    }
    if (np == 1) {
      const act_t* x = X + (int64_t)(idx ? idx[0] : 0) * xstride;
      if (M->fp8)
        tile8_rb_1(wr, sr, M->bk, x, K, tmp);
      else
        tile_rb_1((const uint16_t* const*)wr, x, K, tmp);
      for (int r = 0; r < nr; r++) Y[n + r - ycol0] = tmp[r];
      continue;
    }
    for (int p = 0; p < np; p += TB) {
      int nt = np - p < TB ? np - p : TB;
      for (int t = 0; t < TB; t++) {
        int q = p + (t < nt ? t : 0);
        xr[t] = X + (int64_t)(idx ? idx[q] : q) * xstride;
      }
      if (M->fp8)
        tile8_rb_tb(wr, sr, M->bk, xr, K, tmp);
      else
        tile_rb_tb((const uint16_t* const*)wr, xr, K, tmp);
      for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) Y[(int64_t)(p + t) * ldy + n + r - ycol0] = tmp[t * RB + r];
    }
  }
}

/* How the experts' weights are stored: bf16 (fp8 = 0, the rest unused) or FP8 e4m3fn with fp32 scales
 * per bank row: w13's row r has scales s13 + r * s13_row_stride ([ceil(2I / bn13), nbk13], row-major,
 * block [bn13, bk13]; per-tensor: bn13 = 2I, bk13 = H; per-shard [gate, up]: bn13 = I), w2's likewise.
 * Mirrored by ``quant.CQuant`` (ctypes). */
typedef struct {
  int64_t fp8;
  const float *s13, *s2;
  int64_t s13_row_stride, s2_row_stride;
  int64_t bn13, bk13, nbk13, bn2, bk2, nbk2;
} reap_quant;

/* One call's work, shared by the threads that compute it. Groups are experts (bank rows); pairs
 * [off[g], off[g+1]) route to group g. Two phases of dynamically handed-out items (the OpenMP entry
 * puts a barrier between them, the team a per-group wait):
 *   A  (group, block of NBA intermediate rows): gate and up rows of the block for the group's pairs,
 *      then a = bf16(bf16(silu(bf16 g)) * bf16 u) -- silu needs no other block;
 *   B  (group, block of NB output rows): y = a W2^T for the block, out = bf16(y * routing weight)
 *      written straight to the pair's output row.
 * Items are small (<= 128 KB of weights) so the last ones to finish leave little idle time. */
#define NBA 16
typedef struct {
  const uint8_t *w13, *w2;
  int64_t w13_row_stride, w2_row_stride; /* in weights */
  const int32_t *group_rows, *group_off;
  int n_groups, n_pairs, H, I;
  const act_t* x;         /* pair q's input: x + (x_idx ? x_idx[q] : q) * x_stride */
  const int32_t* x_idx;
  int64_t x_stride;
  const float* pair_w;
  const int32_t* pair_dst; /* pair q's output row (q when NULL) */
  float* hs;               /* [n_pairs, 2I] fp32 */
  act_t* as;               /* [n_pairs, I] */
  uint16_t* out;           /* [*, H] */
  reap_quant q;
} work_t;

static inline int64_t wbytes(const work_t* w) { return w->q.fp8 ? 1 : 2; } /* bytes per weight */

/* Group g's w13 / w2 matrix. */
static inline mat_t mat13(const work_t* w, int g) {
  const int64_t row = w->group_rows[g];
  mat_t m = {w->w13 + row * w->w13_row_stride * wbytes(w), (int64_t)w->H * wbytes(w), (int)w->q.fp8,
             w->q.fp8 ? w->q.s13 + row * w->q.s13_row_stride : NULL, (int)w->q.bn13, (int)w->q.bk13, (int)w->q.nbk13};
  return m;
}
static inline mat_t mat2(const work_t* w, int g) {
  const int64_t row = w->group_rows[g];
  mat_t m = {w->w2 + row * w->w2_row_stride * wbytes(w), (int64_t)w->I * wbytes(w), (int)w->q.fp8,
             w->q.fp8 ? w->q.s2 + row * w->q.s2_row_stride : NULL, (int)w->q.bn2, (int)w->q.bk2, (int)w->q.nbk2};
  return m;
}

static inline int blocks_a(const work_t* w) { return (w->I + NBA - 1) / NBA; } /* A items per group */
static inline int blocks_b(const work_t* w) { return (w->H + NB - 1) / NB; }   /* B items per group */
static inline int items_a(const work_t* w) { return w->n_groups * blocks_a(w); }
static inline int items_b(const work_t* w) { return w->n_groups * blocks_b(w); }

static void item_a(const work_t* w, int it) {
  const int per = blocks_a(w), I = w->I, n13 = 2 * I;
  int g = it / per, b = it % per;
  int p0 = w->group_off[g], np = w->group_off[g + 1] - p0;
  int n0 = b * NBA, n1 = n0 + NBA < I ? n0 + NBA : I;
  const mat_t W = mat13(w, g);
  const act_t* X = w->x_idx ? w->x : w->x + (int64_t)p0 * w->x_stride;
  const int32_t* idx = w->x_idx ? w->x_idx + p0 : NULL;
  float* hs = w->hs + (int64_t)p0 * n13;
  rows_block(&W, w->H, n0, n1, X, idx, w->x_stride, np, hs, n13, 0);       /* gate */
  rows_block(&W, w->H, I + n0, I + n1, X, idx, w->x_stride, np, hs, n13, 0);  /* up */
  for (int q = 0; q < np; q++)
    for (int i = n0; i < n1; i++) {
      float gt = round_bf16(hs[(int64_t)q * n13 + i]), u = round_bf16(hs[(int64_t)q * n13 + I + i]);
      float sg = round_bf16(gt / (1.0f + expf(-gt)));
      w->as[(int64_t)(p0 + q) * I + i] = act_from_f32(sg * u);
    }
}

static void item_b(const work_t* w, int it) {
  const int per = blocks_b(w), H = w->H;
  int g = it / per, b = it % per;
  int p0 = w->group_off[g], np = w->group_off[g + 1] - p0;
  int n0 = b * NB, n1 = n0 + NB < H ? n0 + NB : H;
  const mat_t W = mat2(w, g);
  float y[TB * NB];
  for (int q0 = 0; q0 < np; q0 += TB) {
    int nq = np - q0 < TB ? np - q0 : TB;
    rows_block(&W, w->I, n0, n1, w->as + (int64_t)(p0 + q0) * w->I, NULL, w->I, nq, y, NB, n0);
    for (int q = 0; q < nq; q++) {
      int p = p0 + q0 + q;
      uint16_t* dst = w->out + (int64_t)(w->pair_dst ? w->pair_dst[p] : p) * H;
      for (int n = n0; n < n1; n++) dst[n] = f32_to_bf16(y[q * NB + n - n0] * w->pair_w[p]);
    }
  }
}

/* --- OpenMP entry (CpuExperts' native backend): one team per call ---------------------------- */

/* quant: NULL for bf16 rows. */
int reap_cpu_experts(const void* w13, int64_t w13_row_stride, const void* w2, int64_t w2_row_stride,
                     const int32_t* group_rows, const int32_t* group_off, int n_groups, const int32_t* pair_tok,
                     const float* pair_w, int n_pairs, const uint16_t* x, int64_t x_stride, int H, int I, void* xs_,
                     float* hs, void* as_, uint16_t* out, int nthreads, const reap_quant* quant) {
  work_t w = {(const uint8_t*)w13, (const uint8_t*)w2, w13_row_stride, w2_row_stride, group_rows, group_off, n_groups, n_pairs, H, I,
              NULL, NULL, H, pair_w, NULL, hs, (act_t*)as_, out, {0}};
  if (quant) w.q = *quant;
  act_t* xs = (act_t*)xs_; /* [n_pairs, H]: the pairs' inputs as the dot kernels want them */
  w.x = xs;
  int ca = 0, cb = 0;
  const int na = items_a(&w), nb = items_b(&w);
  if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads)
  {
#ifdef _OPENMP
    pin_self(omp_get_thread_num());
#endif
#pragma omp for schedule(static)
    for (int p = 0; p < n_pairs; p++) {
      const uint16_t* src = x + (int64_t)pair_tok[p] * x_stride;
      for (int k = 0; k < H; k++) xs[(int64_t)p * H + k] = to_act(src[k]);
    }
    for (int it; (it = __atomic_fetch_add(&ca, 1, __ATOMIC_RELAXED)) < na;) item_a(&w, it);
#pragma omp barrier
    for (int it; (it = __atomic_fetch_add(&cb, 1, __ATOMIC_RELAXED)) < nb;) item_b(&w, it);
  }
  return 0;
}

/* --- one MoE layer step: the job ---------------------------------------------------------------
 * Everything a step reads was staged before it is posted: the [T, K] logical expert ids, CPU-pair
 * mask and routing weights and the [T, H] hidden states. The step groups the CPU pairs by expert
 * (ascending expert, pairs in (token, k) order), computes them from the bank's host rows in place
 * and writes each pair's bf16 output at its (token, k) row of the [T, K, H] per-k buffer (other
 * rows untouched: the device only reads the masked ones). A bad id sets status -1, more CPU pairs
 * than the job's scratch holds (max_pairs: the split's pair budget) status -2; the step then
 * computes nothing. The device may write ids / mask (mapped host memory) at any time, so the step
 * reads each of them exactly once, into ``sel``, validates that copy and uses only the copy: a
 * value changed after the check can never index ``counts``. Field order is mirrored by step.py's ctypes. */
typedef struct {
  const int32_t* ids;
  const uint8_t* mask;
  const float* weights;
  const uint16_t* x;
  uint16_t* out;
  const void* w13;
  const void* w2;
  int64_t w13_row_stride, w2_row_stride, row_offset, expert_bytes;
  int64_t T, K, H, I, E, nthreads;
  int64_t max_pairs;   /* P: most CPU pairs of one step, what the arrays below marked [P] hold */
  int32_t* counts;     /* [E + 1] */
  int32_t* group_rows; /* [P] */
  int32_t* group_off;  /* [P + 1] */
  int32_t* pair_tok;   /* [P] */
  int32_t* pair_dst;   /* [P] */
  int32_t* group_done; /* [P]: the team's phase-A items finished per group */
  float* pair_w;       /* [P] */
  void* xs;            /* [T * H] act_t */
  float* hs;           /* [P * 2I] */
  void* as;            /* [P * I] act_t */
  int32_t* sel;        /* [T * K]: expert of each CPU pair as read once from ids / mask, -1 for other pairs */
  int64_t calls, steps_with_work, experts, pairs, ns, bytes, status;
  reap_quant quant;    /* how the rows are stored (fp8 = 0: bf16) */
} reap_cpu_job;

size_t reap_cpu_job_size(void) { return sizeof(reap_cpu_job); }
size_t reap_cpu_act_size(void) { return sizeof(act_t); }

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Group the job's CPU pairs into w (single thread). Returns the number of pairs (0: nothing). */
/* Tests only: a value plan_job writes over every staged id right after taking its copy (a device
 * writer racing the team); 0x7fffffff: off. The step must compute from the copy regardless. */
static int32_t g_test_clobber_ids = 0x7fffffff;
void reap_job_set_test_clobber_ids(int32_t v) { __atomic_store_n(&g_test_clobber_ids, v, __ATOMIC_RELAXED); }

static int plan_job(reap_cpu_job* j, work_t* w) {
  const int64_t T = j->T, K = j->K, E = j->E, TK = T * K;
  j->calls++;
  memset(j->counts, 0, sizeof(int32_t) * (size_t)(E + 1));
  int64_t np = 0;
  int32_t* sel = j->sel;
  for (int64_t q = 0; q < TK; q++) { /* the only reads of ids / mask */
    const uint8_t m = __atomic_load_n((const uint8_t*)&j->mask[q], __ATOMIC_RELAXED);
    const int32_t e = m ? __atomic_load_n((const int32_t*)&j->ids[q], __ATOMIC_RELAXED) : -1;
    if (m && (e < 0 || e >= E)) { j->status = -1; return 0; }
    sel[q] = e;
  }
  const int32_t clobber = __atomic_load_n(&g_test_clobber_ids, __ATOMIC_RELAXED);
  if (clobber != 0x7fffffff)
    for (int64_t q = 0; q < TK; q++) ((int32_t*)j->ids)[q] = clobber;
  for (int64_t q = 0; q < TK; q++) {
    if (sel[q] < 0) continue;
    j->counts[sel[q] + 1]++;
    np++;
  }
  if (np == 0) return 0;
  if (np > (j->max_pairs > 0 ? j->max_pairs : TK)) { j->status = -2; return 0; } /* the split broke its budget */
  int ng = 0;
  for (int64_t e = 0; e < E; e++) { /* counts[e + 1] -> running start of expert e */
    int32_t c = j->counts[e + 1];
    j->counts[e + 1] = j->counts[e] + c;
    if (c) {
      j->group_rows[ng] = (int32_t)(j->row_offset + e);
      j->group_off[ng] = j->counts[e];
      ng++;
    }
  }
  j->group_off[ng] = (int32_t)np;
  for (int64_t q = 0; q < TK; q++) { /* stable: (token, k) order inside each expert */
    if (sel[q] < 0) continue;
    int32_t p = j->counts[sel[q]]++;
    j->pair_tok[p] = (int32_t)(q / K);
    j->pair_dst[p] = (int32_t)q;
    j->pair_w[p] = j->weights[q];
  }
#if USE_DPBF16
  const act_t* x = j->x; /* bf16 activations as staged */
#else
  act_t* xs = (act_t*)j->xs;
  for (int64_t k = 0; k < T * j->H; k++) xs[k] = to_act(j->x[k]);
  const act_t* x = xs;
#endif
  work_t v = {(const uint8_t*)j->w13, (const uint8_t*)j->w2, j->w13_row_stride, j->w2_row_stride, j->group_rows, j->group_off, ng,
              (int)np, (int)j->H, (int)j->I, x, j->pair_tok, j->H, j->pair_w, j->pair_dst, j->hs, (act_t*)j->as, j->out, j->quant};
  *w = v;
  return (int)np;
}

/* --- the team: persistent pinned threads taking steps from a mailbox -------------------------
 * Why not a host callback + OpenMP: on the H200 host (a KVM guest) a step's fixed cost was
 * ~0.1-0.2 ms -- the driver's callback thread waking, the OpenMP team forking, five barriers --
 * against ~0.09 ms per expert. Here the device (or the host) posts step s by writing the job's
 * address into ring[s % RING] and then s into seq; every team thread is already spinning on seq,
 * thread 0 groups the pairs, all take items, and the last to finish writes s into done, which the
 * device's merge polls. The mailbox lives in pinned host memory mapped into the device, so the
 * split kernel posts and the merge kernel waits without leaving the stream: graph-capturable, no
 * host synchronisation. Steps are taken strictly in order; one is in flight at a time (the poster
 * waits for done before it posts again).
 * Idle threads spin for spin_us after their last step, then poll every ~50 us (so a server between
 * requests does not burn its cores; the first layer after a pause pays the poll interval). */
#define RING 64
typedef struct {
  volatile int64_t seq; /* last posted step */
  int64_t pad0[7];
  volatile int64_t done; /* last finished step */
  int64_t pad1[7];
  volatile int64_t job[RING]; /* reap_cpu_job* of step s at [s % RING] */
} reap_mailbox;

size_t reap_mailbox_size(void) { return sizeof(reap_mailbox); }

typedef struct {
  int64_t v;
  int64_t pad[7];
} line_t;

typedef struct {
  reap_mailbox* mb;
  int n, ncpus, oversubscribed;
  int cpus[1024];
  int64_t spin_ns, start_seq;
  pthread_t th[1024];
  int started;
  line_t quit, ready, item, finished;
  work_t w;
  int np;
  int64_t t0;
  reap_cpu_job* job;
} team_t;

static team_t g_team; /* the process's one team (a registry of one) */

/* Tests only: each group's last phase-A item starts this late, so a phase-B item that did not
 * wait for its group would read the previous step's activations (0: off). */
static int64_t g_test_a_delay_ns = 0;
void reap_team_set_test_delay_us(int64_t us) { __atomic_store_n(&g_test_a_delay_ns, us * 1000, __ATOMIC_RELAXED); }
static void sleep_ns(int64_t ns) {
  struct timespec ts = {ns / 1000000000LL, ns % 1000000000LL};
  nanosleep(&ts, NULL);
}
static pthread_mutex_t g_team_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void relax(uint64_t* spins, int oversub) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
  if (oversub && (++*spins & 63) == 0) sched_yield(); /* a spinning thread must not starve the one it waits for */
}

static inline int64_t ld_acq(const volatile int64_t* p) { return __atomic_load_n((const int64_t*)p, __ATOMIC_ACQUIRE); }
static inline void st_rel(volatile int64_t* p, int64_t v) { __atomic_store_n((int64_t*)p, v, __ATOMIC_RELEASE); }

static void team_step(team_t* t, int tid, int64_t s) {
  reap_mailbox* mb = t->mb;
  uint64_t spins = 0;
  if (tid == 0) {
    while (ld_acq(&mb->done) < s - 1) relax(&spins, t->oversubscribed); /* the previous step fully done */
    reap_cpu_job* j = (reap_cpu_job*)(intptr_t)ld_acq(&mb->job[s % RING]);
    t->job = j;
    t->t0 = now_ns();
    t->np = j ? plan_job(j, &t->w) : 0;
    if (t->np > 0) memset(j->group_done, 0, sizeof(int32_t) * (size_t)t->w.n_groups);
    __atomic_store_n(&t->item.v, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&t->finished.v, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&t->ready.v, s, __ATOMIC_RELEASE);
  } else {
    while (__atomic_load_n(&t->ready.v, __ATOMIC_ACQUIRE) < s) relax(&spins, t->oversubscribed);
  }
  if (t->np > 0) {
    /* One queue: all A items (group-major), then all B items. A group's B items need only that
     * group's A items, all handed out before any B item, so a thread waits only while the last of
     * them finish -- no step-wide barrier between the phases (its tail cost up to one A item, ~20 us). */
    const work_t* w = &t->w;
    const int na = items_a(w), nb = items_b(w);
    const int per_a = blocks_a(w), per_b = blocks_b(w);
    int32_t* group_done = t->job->group_done;
    for (int64_t it; (it = __atomic_fetch_add(&t->item.v, 1, __ATOMIC_RELAXED)) < na + nb;) {
      if (it < na) {
        const int64_t delay = __atomic_load_n(&g_test_a_delay_ns, __ATOMIC_RELAXED);
        if (delay && it % per_a == per_a - 1) sleep_ns(delay); /* tests: the group's B items must wait for this */
        item_a(w, (int)it);
        if (g_test_a_delay_ns && it % per_a == per_a - 1) sleep_ns(g_test_a_delay_ns);
        __atomic_fetch_add(&group_done[it / per_a], 1, __ATOMIC_RELEASE);
      } else {
        const int b = (int)(it - na);
        while (__atomic_load_n(&group_done[b / per_b], __ATOMIC_ACQUIRE) < per_a) relax(&spins, t->oversubscribed);
        item_b(w, b);
      }
    }
  }
  if (__atomic_fetch_add(&t->finished.v, 1, __ATOMIC_ACQ_REL) == t->n - 1) {
    reap_cpu_job* j = t->job;
    if (j && t->np > 0) {
      j->ns += now_ns() - t->t0;
      j->steps_with_work++;
      j->experts += t->w.n_groups;
      j->pairs += t->np;
      j->bytes += (int64_t)t->w.n_groups * j->expert_bytes;
    }
    st_rel(&mb->done, s);
  }
}

static void* team_main(void* arg) {
  team_t* t = &g_team;
  int tid = (int)(intptr_t)arg;
  if (t->ncpus > 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(t->cpus[tid % t->ncpus], &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* idle polls wake on time, not 50 us late */
  int64_t last = t->start_seq; /* not the seq now: a step may be posted before this thread first runs */
  int64_t idle_since = now_ns();
  uint64_t spins = 0;
  while (!__atomic_load_n(&t->quit.v, __ATOMIC_ACQUIRE)) {
    if (ld_acq(&t->mb->seq) > last) {
      team_step(t, tid, ++last);
      idle_since = now_ns();
      continue;
    }
    relax(&spins, t->oversubscribed);
    if ((spins & 1023) == 0 && now_ns() - idle_since > t->spin_ns) {
      struct timespec ts = {0, 50000};
      nanosleep(&ts, NULL);
    }
  }
  return NULL;
}

/* Start the team on a zeroed mailbox: n threads pinned to cpus[i % ncpus] (ncpus 0: unpinned).
 * 0 ok, 1 already running on this mailbox with n threads, -1 bad arguments, -2 running elsewhere,
 * -3 a thread could not start (none left running). */
int reap_team_start(void* mailbox, const int* cpus, int ncpus, int n, int64_t spin_us) {
  if (!mailbox || n < 1 || n > 1024 || ncpus < 0 || ncpus > 1024 || spin_us < 0) return -1;
  pthread_mutex_lock(&g_team_lock);
  team_t* t = &g_team;
  if (t->started) {
    int rc = (t->mb == mailbox && t->n == n) ? 1 : -2;
    pthread_mutex_unlock(&g_team_lock);
    return rc;
  }
  memset(t, 0, sizeof(*t));
  t->mb = (reap_mailbox*)mailbox;
  t->n = n;
  t->ncpus = ncpus;
  for (int i = 0; i < ncpus; i++) t->cpus[i] = cpus[i];
  t->spin_ns = spin_us * 1000;
  cpu_set_t mine;
  int avail = sched_getaffinity(0, sizeof(mine), &mine) == 0 ? CPU_COUNT(&mine) : 1;
  t->oversubscribed = ncpus > 0 ? ncpus < n : avail <= n; /* unpinned: the poster needs a core too */
  t->start_seq = ld_acq(&t->mb->seq);
  __atomic_store_n(&t->ready.v, t->start_seq, __ATOMIC_RELEASE);
  for (int i = 0; i < n; i++) {
    if (pthread_create(&t->th[i], NULL, team_main, (void*)(intptr_t)i) != 0) {
      __atomic_store_n(&t->quit.v, 1, __ATOMIC_RELEASE);
      for (int k = 0; k < i; k++) pthread_join(t->th[k], NULL);
      memset(t, 0, sizeof(*t));
      pthread_mutex_unlock(&g_team_lock);
      return -3;
    }
  }
  t->started = 1;
  pthread_mutex_unlock(&g_team_lock);
  return 0;
}

/* Stop and join the team (steps already posted are finished first). 0 ok, 1 none running. */
int reap_team_stop(void) {
  pthread_mutex_lock(&g_team_lock);
  team_t* t = &g_team;
  if (!t->started) {
    pthread_mutex_unlock(&g_team_lock);
    return 1;
  }
  uint64_t spins = 0;
  while (ld_acq(&t->mb->done) < ld_acq(&t->mb->seq)) relax(&spins, 1);
  __atomic_store_n(&t->quit.v, 1, __ATOMIC_RELEASE);
  for (int i = 0; i < t->n; i++) pthread_join(t->th[i], NULL);
  memset(t, 0, sizeof(*t));
  pthread_mutex_unlock(&g_team_lock);
  return 0;
}

/* Host-side poster: post the job as the next step and wait until the team has done it. Only when
 * no device step is in flight on the same mailbox (calibration, CPU-only tests). 0 ok, -1 no team
 * on this mailbox, -2 timed out (the team did not finish within timeout_ms). */
int reap_team_run(void* mailbox, void* job, int64_t timeout_ms) {
  team_t* t = &g_team;
  if (!__atomic_load_n(&t->started, __ATOMIC_ACQUIRE) || t->mb != mailbox) return -1;
  reap_mailbox* mb = t->mb;
  int64_t s = ld_acq(&mb->seq) + 1;
  st_rel(&mb->job[s % RING], (int64_t)(intptr_t)job);
  st_rel(&mb->seq, s);
  int64_t t0 = now_ns();
  uint64_t spins = 0;
  while (ld_acq(&mb->done) < s) {
    relax(&spins, 1);
    if ((spins & 1023) == 0 && now_ns() - t0 > timeout_ms * 1000000LL) return -2;
  }
  return 0;
}
