/* CPU expert MLPs straight from the host bank rows (bf16, row-major [N, K]), no weight copy.
 *
 * Why our own: decode is a GEMV per expert (1-8 tokens), bound by DRAM reads of the weights.
 * The plain layout is already the GEMV-friendly one (each output is a dot product of one
 * contiguous row); kt-kernel and vLLM-cpu's MoE kernels repack weights into their own layout
 * (a second copy of the bank), and torch's bf16 GEMV scales poorly with threads. With
 * AVX512-BF16 (Zen 4, Sapphire Rapids) rows meet bf16 activations in vdpbf16ps; with plain
 * AVX-512 weights are widened to fp32 in registers (a shift) and FMA'd; activations stay in L1
 * and every weight byte is read once per call whatever the token count.
 *
 * Semantics follow vLLM's fused MoE on bf16: h = bf16(x W13^T) (fp32 accumulation),
 * a = bf16(bf16(silu(h_gate)) * h_up) (CUDA silu_and_mul), y = bf16(fp32(a W2^T) * w) (routing
 * weight applied to the fp32 accumulator, as MUL_ROUTED_WEIGHT does), one output per pair.
 *
 * Threads: one OpenMP team per call with num_threads(n); its threads pin themselves to the
 * configured cores (reap_cpu_experts_set_cpus) so vLLM's own threads keep theirs. Call it from a
 * dedicated host thread: OpenMP keeps one team per calling thread, so torch's intra-op team on
 * the main thread is neither resized nor reused. GEMM items are handed out dynamically, so a
 * thread preempted by someone else's delays only its current item. Team threads spin at the
 * barriers (libgomp's default), right for dedicated cores; on shared, oversubscribed cores run
 * the process with OMP_WAIT_POLICY=passive (a spinning thread waiting on a descheduled one
 * otherwise costs a time slice per barrier: measured 4x slower on the 2-core CI box).
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
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

/* Rows [n0, n1) of W [N, K] against the group's np vectors X [np, K] -> Y [np, ldy] columns n.
 * Short tiles repeat their first row / token (the repeats' results are dropped). */
static void rows_block(const uint16_t* W, int K, int n0, int n1, const act_t* X, int np, float* Y, int64_t ldy) {
  float tmp[TB * RB];
  const uint16_t* wr[RB];
  const act_t* xr[TB];
  for (int n = n0; n < n1; n += RB) {
    int nr = n1 - n < RB ? n1 - n : RB;
    for (int r = 0; r < RB; r++) wr[r] = W + (int64_t)(n + (r < nr ? r : 0)) * K;
    if (np == 1) {
      tile_rb_1(wr, X, K, tmp);
      for (int r = 0; r < nr; r++) Y[n + r] = tmp[r];
      continue;
    }
    for (int p = 0; p < np; p += TB) {
      int nt = np - p < TB ? np - p : TB;
      for (int t = 0; t < TB; t++) xr[t] = X + (int64_t)(p + (t < nt ? t : 0)) * K;
      tile_rb_tb(wr, xr, K, tmp);
      for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) Y[(int64_t)(p + t) * ldy + n + r] = tmp[t * RB + r];
    }
  }
}

/* Groups are experts (bank rows); pairs [off[g], off[g+1]) route to group g; pair p's output goes
 * to out row pair_dst[p] (row p when pair_dst is NULL). */
static void experts_impl(const uint16_t* w13, int64_t w13_row_stride, const uint16_t* w2, int64_t w2_row_stride,
                         const int32_t* group_rows, const int32_t* group_off, int n_groups, const int32_t* pair_tok,
                         const float* pair_w, int n_pairs, const uint16_t* x, int64_t x_stride, int H, int I, void* xs_,
                         float* hs, void* as_, uint16_t* out, const int32_t* pair_dst, int nthreads) {
  act_t* xs = (act_t*)xs_; /* [n_pairs, H] */
  act_t* as = (act_t*)as_; /* [n_pairs, I] */
  const int n13 = 2 * I;
  const int items13 = (n13 + NB - 1) / NB;
  const int items2 = (H + NB - 1) / NB;
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
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_groups * items13; it++) {
      int g = it / items13, b = it % items13;
      int p0 = group_off[g], np = group_off[g + 1] - p0;
      int n0 = b * NB, n1 = n0 + NB < n13 ? n0 + NB : n13;
      const uint16_t* W = w13 + (int64_t)group_rows[g] * w13_row_stride;
      rows_block(W, H, n0, n1, xs + (int64_t)p0 * H, np, hs + (int64_t)p0 * n13, n13);
    }
#pragma omp for schedule(static)
    for (int p = 0; p < n_pairs; p++) {
      const float* h = hs + (int64_t)p * n13;
      for (int i = 0; i < I; i++) {
        float g = round_bf16(h[i]), u = round_bf16(h[I + i]);
        float s = round_bf16(g / (1.0f + expf(-g)));
        as[(int64_t)p * I + i] = act_from_f32(s * u);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < n_groups * items2; it++) {
      int g = it / items2, b = it % items2;
      int p0 = group_off[g], np = group_off[g + 1] - p0;
      int n0 = b * NB, n1 = n0 + NB < H ? n0 + NB : H;
      const uint16_t* W = w2 + (int64_t)group_rows[g] * w2_row_stride;
      /* fp32 results land in hs (free now; the caller sizes it n_pairs * max(2I, H)) */
      rows_block(W, I, n0, n1, as + (int64_t)p0 * I, np, hs + (int64_t)p0 * H, H);
    }
#pragma omp for schedule(static)
    for (int p = 0; p < n_pairs; p++) {
      uint16_t* dst = out + (int64_t)(pair_dst ? pair_dst[p] : p) * H;
      for (int n = 0; n < H; n++) dst[n] = f32_to_bf16(hs[(int64_t)p * H + n] * pair_w[p]);
    }
  }
}

int reap_cpu_experts(const uint16_t* w13, int64_t w13_row_stride, const uint16_t* w2, int64_t w2_row_stride,
                     const int32_t* group_rows, const int32_t* group_off, int n_groups, const int32_t* pair_tok,
                     const float* pair_w, int n_pairs, const uint16_t* x, int64_t x_stride, int H, int I, void* xs_,
                     float* hs, void* as_, uint16_t* out, int nthreads) {
  experts_impl(w13, w13_row_stride, w2, w2_row_stride, group_rows, group_off, n_groups, pair_tok, pair_w, n_pairs, x,
               x_stride, H, I, xs_, hs, as_, out, NULL, nthreads);
  return 0;
}

/* One MoE layer step of the CPU expert path, as a CUDA host function (cuLaunchHostFunc's
 * void(void*) signature) or a plain call. Everything it reads was staged by the device before it
 * runs (stream order): the step's [T, K] logical expert ids, CPU-pair mask and routing weights
 * and its [T, H] hidden states. It groups the CPU pairs by expert (ascending expert, pairs in
 * (token, k) order: group_pairs' order), computes them from the bank's host rows in place and
 * writes each pair's bf16 output at its (token, k) place of the [T, K, H] per-k buffer (other
 * places untouched: the device only reads the masked ones). Never calls CUDA, never blocks on
 * anything but its own OpenMP team. Errors cannot be raised from a host callback: a bad id
 * sets status and the step computes nothing. Field order is mirrored by step.py's ctypes. */
typedef struct {
  const int32_t* ids;
  const uint8_t* mask;
  const float* weights;
  const uint16_t* x;
  uint16_t* out;
  const uint16_t* w13;
  const uint16_t* w2;
  int64_t w13_row_stride, w2_row_stride, row_offset, expert_bytes;
  int64_t T, K, H, I, E, nthreads;
  int32_t* counts;     /* [E + 1] */
  int32_t* group_rows; /* [T * K] */
  int32_t* group_off;  /* [T * K + 1] */
  int32_t* pair_tok;   /* [T * K] */
  int32_t* pair_dst;   /* [T * K] */
  float* pair_w;       /* [T * K] */
  void* xs;            /* [T * K * H] act_t */
  float* hs;           /* [T * K * max(2I, H)] */
  void* as;            /* [T * K * I] act_t */
  int64_t calls, steps_with_work, experts, pairs, ns, bytes, status;
} reap_cpu_job;

size_t reap_cpu_job_size(void) { return sizeof(reap_cpu_job); }
size_t reap_cpu_act_size(void) { return sizeof(act_t); }

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void reap_cpu_step(void* arg) {
  reap_cpu_job* j = (reap_cpu_job*)arg;
  const int64_t T = j->T, K = j->K, E = j->E, TK = T * K;
  j->calls++;
  memset(j->counts, 0, sizeof(int32_t) * (size_t)(E + 1));
  int64_t np = 0;
  for (int64_t q = 0; q < TK; q++) {
    if (!j->mask[q]) continue;
    int32_t e = j->ids[q];
    if (e < 0 || e >= E) { j->status = -1; return; }
    j->counts[e + 1]++;
    np++;
  }
  if (np == 0) return;
  int64_t t0 = now_ns();
  /* groups: experts with pairs, ascending; counts[e + 1] -> running start of expert e */
  int ng = 0;
  for (int64_t e = 0; e < E; e++) {
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
    if (!j->mask[q]) continue;
    int32_t p = j->counts[j->ids[q]]++;
    j->pair_tok[p] = (int32_t)(q / K);
    j->pair_dst[p] = (int32_t)q;
    j->pair_w[p] = j->weights[q];
  }
  experts_impl(j->w13, j->w13_row_stride, j->w2, j->w2_row_stride, j->group_rows, j->group_off, ng, j->pair_tok,
               j->pair_w, (int)np, j->x, j->H, (int)j->H, (int)j->I, j->xs, j->hs, j->as, j->out, j->pair_dst,
               (int)j->nthreads);
  j->ns += now_ns() - t0;
  j->steps_with_work++;
  j->experts += ng;
  j->pairs += np;
  j->bytes += (int64_t)ng * j->expert_bytes;
}
