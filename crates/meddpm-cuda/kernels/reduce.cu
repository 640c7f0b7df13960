// reduce.cu: per-channel partial reductions over the voxels of an activation, parallel over the
// whole volume (many blocks per channel and group), and their finalisers. Used by GroupNorm
// (statistics and backward sums), channel_sum and the conv bias gradient.
//
// Stage 1 (`chan_partial_*`): the voxels are cut into chunks; one block reduces one chunk of one
// sample for one channel (NCDHW) or for all channels (NDHWC) and writes two floats per
// (n, chunk, c) to part[((n*nchunks + chunk)*C + c)*2 + {0,1}]:
//   OP_STATS: (mean, M2) of x over the chunk's voxels (sums shifted by the chunk's first value,
//             so large means do not cancel the variance);
//   OP_GNBWD: (sum g, sum g*(x - mu_group)) with g = dout, or dout*silu'(y) with y = GN(x)
//             recomputed from the statistics (rstd, gamma, beta) when beta is given; the
//             GroupNorm's input is x + off[n*C + c] when `off` is given (see groupnorm.cu);
//             chan_gnbwd3_* (NDHWC) add a third, sum (x - mu), three floats per (n, chunk, c);
//   OP_SUM:   (sum x, 0).
// Stage 2 combines the chunks in double precision (see groupnorm.cu and chan_sum_finalize).
// The activation inputs (a = x or dout, b = x) share one storage type T; the `bf` argument of the
// extern kernels selects it (common.cu).

#define OP_STATS 0
#define OP_GNBWD 1
#define OP_SUM 2

// GroupNorm backward's per-channel inputs: mu of the channel's group (less the channel's input
// offset, so x - mu is the normalised input's deviation), and the affine map of x to y = GN(x)
// (sc, sh) for the SiLU derivative.
struct GnBwdIn {
    const float* mean;
    const float* rstd;
    const float* gamma;
    const float* beta;  // null: no SiLU
    const float* off;   // null: no input offset
    int G;
};

__device__ __forceinline__ void gn_chan(const GnBwdIn& p, int n, int c, int C, float& mu, float& sc, float& sh) {
    int ng = n * p.G + c / (C / p.G);
    mu = p.mean[ng] - (p.off ? p.off[n * C + c] : 0.0f);
    sc = sh = 0.0f;
    if (p.beta) gn_affine(p.rstd[ng], p.gamma[c], p.beta[c], mu, sc, sh);
}

template <typename T, int OP>
__device__ __forceinline__ void chan_acc1(float a, float b, bool silu, float mu, float sc, float sh, float shift,
                                          float& s, float& q) {
    if (OP == OP_STATS) {
        float v = a - shift;
        s += v;
        q += v * v;
    } else if (OP == OP_GNBWD) {
        float g = silu ? a * silu_grad_t<T>(gn_y(b, sc, sh)) : a;
        s += g;
        q += g * (b - mu);
    } else {
        s += a;
    }
}

template <int OP>
__device__ __forceinline__ void chan_write(float* part, i64 idx, float s, float q, i64 cnt, float shift) {
    if (OP == OP_STATS) {
        float m = s / (float)cnt;
        part[idx] = shift + m;
        part[idx + 1] = fmaxf(q - s * m, 0.0f);
    } else {
        part[idx] = s;
        part[idx + 1] = q;
    }
}

// grid (nchunks, N*C), block 256.
template <typename T, int OP>
__device__ void chan_partial_ncdhw_t(const void* av, const void* bv, GnBwdIn gp, float* part, int C, i64 S,
                                     int chunk_len, int nchunks) {
    const T *a = (const T*)av, *b = (const T*)bv;
    __shared__ float sh[32];
    int row = blockIdx.y, n = row / C, c = row % C, chunk = blockIdx.x;
    i64 base = (i64)row * S;
    i64 v0 = (i64)chunk * chunk_len, v1 = min(S, v0 + (i64)chunk_len);
    float shift = (OP == OP_STATS) ? ld(a, base + v0) : 0.0f;
    float mu = 0.0f, sc = 0.0f, shf = 0.0f;
    if (OP == OP_GNBWD) gn_chan(gp, n, c, C, mu, sc, shf);
    bool silu = OP == OP_GNBWD && gp.beta;
    float s = 0.0f, q = 0.0f;
#pragma unroll 4
    for (i64 v = v0 + threadIdx.x; v < v1; v += blockDim.x)
        chan_acc1<T, OP>(ld(a, base + v), OP == OP_GNBWD ? ld(b, base + v) : 0.0f, silu, mu, sc, shf, shift, s, q);
    s = block_sum(s, sh);
    q = block_sum(q, sh);
    if (threadIdx.x == 0) chan_write<OP>(part, (((i64)n * nchunks + chunk) * C + c) * 2, s, q, v1 - v0, shift);
}

// The NDHWC stage-1 block's two steps after its loop: each row's sums of its VEC channels into
// shared memory (red[2][256 * VEC]), then, after a barrier, one thread per channel c adds the rows'.
template <int VEC>
__device__ __forceinline__ void rows_store(float (*red)[256 * VEC], int r, int C, int c0, const float* s,
                                           const float* q) {
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        red[0][r * C + c0 + j] = s[j];
        red[1][r * C + c0 + j] = q[j];
    }
}
template <int VEC>
__device__ __forceinline__ void rows_sum(float (*red)[256 * VEC], int rows, int C, int c, float& ss, float& qq) {
    ss = 0.0f;
    qq = 0.0f;
    for (int rr = 0; rr < rows; rr++) {
        ss += red[0][rr * C + c];
        qq += red[1][rr * C + c];
    }
}

// A value rounded to T as it would be stored (the concatenation a decoder ResBlock normalises
// is summed as its stored values, wherever it is read from its parts).
template <typename T>
__device__ __forceinline__ float as_stored(float v);
template <>
__device__ __forceinline__ float as_stored<float>(float v) {
    return v;
}
template <>
__device__ __forceinline__ float as_stored<bf16>(float v) {
    return bf2f(f2bf(v));
}

// The concatenation's VEC channels c0.. of voxel v of sample n (rounded as stored).
template <typename T, int VEC>
__device__ __forceinline__ void cat_load(const T* a, const T* b, const float* abias, int ca, int cb, int n, i64 S,
                                         i64 v, int c0, float* x) {
    // one load whose address is selected, not two branches: lanes of one warp read both parts
    bool fa = c0 < ca;
    const T* p = fa ? a : b;
    i64 idx = fa ? ((i64)n * S + v) * ca + c0 : ((i64)n * S + v) * cb + (c0 - ca);
    ldv<VEC>(p, idx, x);
#pragma unroll
    for (int j = 0; j < VEC; j++) x[j] = as_stored<T>(x[j] + (fa && abias ? abias[c0 + j] : 0.0f));
}

// NDHWC: grid (nchunks, N), block 256. Each thread owns VEC consecutive channels (VEC = 4 f32 or
// 8 bf16: 16-byte loads; needs C % VEC == 0) of one voxel row; the block's rows = 256 / (C / VEC)
// stride over the chunk's voxels, so every thread issues useful, coalesced loads. Host ensures
// C / VEC <= 256.
// X3 (OP_GNBWD only): a third partial, sum (x - mu) over the chunk, so part has three floats per
// (n, chunk, c): the GroupNorm input's channel sums, from which gn_bwd_finalize forms the channel
// sums of dx without a pass over dx (the ResBlock's time-embedding bias gradient).
// CAT (OP_GNBWD only): x is the concatenation cat([b + xbias, x2]) along channels, read from its
// parts (b: channels [0, ca), x2: [ca, C); each a multiple of VEC) as cat_load rounds it, so the
// concatenation itself is never built (chan_gnbwd_cat_ndhwc*, the decoder ResBlock's backward).
template <typename T, int OP, int VEC, bool X3 = false, bool CAT = false>
__device__ void chan_partial_ndhwc_t(const void* av, const void* bv, GnBwdIn gp, float* part, int C, i64 S,
                                     int chunk_len, int nchunks, const void* x2v = nullptr,
                                     const float* xbias = nullptr, int ca = 0) {
    const T *a = (const T*)av, *b = (const T*)bv;
    // OP_GNBWD: (mu, sc, sh) per channel (C <= 256·VEC), read per vector with lds4 (as registers,
    // 3·VEC floats a thread, the 8-wide variants spilled at 64-80 registers and reached 2.2-3.1
    // TB/s on the H200, ncu). Entry of channel c: (c % VEC)·lanes + c / VEC, so that the lanes of
    // a warp read consecutive entries (no bank conflicts). The rows' sums (red) reuse its storage
    // after the loop.
    constexpr int RED4 = (X3 ? 3 : 2) * 256 * VEC / 4, TAB4 = OP == OP_GNBWD ? 256 * VEC : 0;
    __shared__ float4 smem4[RED4 > TAB4 ? RED4 : TAB4];
    float4* gtab = smem4;
    float(*red)[256 * VEC] = reinterpret_cast<float(*)[256 * VEC]>(smem4);
    int n = blockIdx.y, chunk = blockIdx.x, t = threadIdx.x;
    int lanes = C / VEC, rows = blockDim.x / lanes;
    int l = t % lanes, r = t / lanes, c0 = l * VEC;
    i64 v0 = (i64)chunk * chunk_len, v1 = min(S, v0 + (i64)chunk_len);
    bool silu = OP == OP_GNBWD && gp.beta;
    float s[VEC], q[VEC], u[VEC], shift[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j++) {
        s[j] = 0.0f;
        q[j] = 0.0f;
        u[j] = 0.0f;
        shift[j] = (OP == OP_STATS) ? ld(a, ((i64)n * S + v0) * C + c0 + j) : 0.0f;
    }
    if (OP == OP_GNBWD) {
        for (int c = t; c < C; c += blockDim.x) {
            float mu, sc, shf;
            gn_chan(gp, n, c, C, mu, sc, shf);
            // CAT: .w is the first part's bias (0 for the second part's channels)
            const float xb = CAT && xbias && c < ca ? xbias[c] : 0.0f;
            gtab[(c % VEC) * lanes + c / VEC] = make_float4(mu, sc, shf, xb);
        }
        __syncthreads();
    }
    // CAT: this thread's channels lie in one part (xp, with cp channels; xbias where it is the
    // first); element indices are stepped, not recomputed per voxel (64-bit registers)
    const bool fa = !CAT || c0 < ca;
    const T* xp = CAT ? (fa ? b : (const T*)x2v) : b;
    const int cp = CAT ? (fa ? ca : C - ca) : C;
    i64 base = ((i64)n * S + v0 + r) * C + c0, xi = ((i64)n * S + v0 + r) * cp + (fa ? c0 : c0 - ca);
    const i64 bstep = (i64)rows * C, xstep = (i64)rows * cp;
    if (r < rows) {
        for (i64 v = v0 + r; v < v1; v += rows, base += bstep, xi += xstep) {
            float va[VEC], vb[VEC];
            ldv<VEC>(a, base, va);
            if (OP == OP_GNBWD && CAT) {
                ldv<VEC>(xp, xi, vb);  // plus the first part's bias from the table, below
            } else if (OP == OP_GNBWD) {
                ldv<VEC>(b, base, vb);
            }
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                float4 f = OP == OP_GNBWD ? lds4(&gtab[j * lanes + l]) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                // the concatenation's value as cat_load gives it: the first part plus its bias
                if (OP == OP_GNBWD && CAT) vb[j] = as_stored<T>(vb[j] + f.w);
                chan_acc1<T, OP>(va[j], OP == OP_GNBWD ? vb[j] : 0.0f, silu, f.x, f.y, f.z, shift[j], s[j], q[j]);
                if (X3) u[j] += vb[j] - f.x;
            }
        }
    }
    if (OP == OP_GNBWD) __syncthreads();  // every row is done with the table: its storage becomes red
    if (r < rows) {
        rows_store<VEC>(red, r, C, c0, s, q);
        if (X3) {
#pragma unroll
            for (int j = 0; j < VEC; j++) red[X3 ? 2 : 0][r * C + c0 + j] = u[j];
        }
    }
    __syncthreads();
    // Every row used the same per-channel shift, so the rows' shifted sums add up.
    for (int c = t; c < C; c += blockDim.x) {
        float ss, qq;
        rows_sum<VEC>(red, rows, C, c, ss, qq);
        float sh = (OP == OP_STATS) ? ld(a, ((i64)n * S + v0) * C + c) : 0.0f;
        const i64 idx = (((i64)n * nchunks + chunk) * C + c) * (X3 ? 3 : 2);
        chan_write<OP>(part, idx, ss, qq, v1 - v0, sh);
        if (X3) {
            float uu = 0.0f;
            for (int rr = 0; rr < rows; rr++) uu += red[X3 ? 2 : 0][rr * C + c];
            part[idx + 2] = uu;
        }
    }
}

// Extern kernels: x/dout are activations of the type `bf` selects; part and the GroupNorm
// parameters are f32.
// PARTIAL(F, (args), template args after T): F<T, ...>(args) with T chosen by `bf`.
#define PARTIAL(F, ARGS, ...)       \
    if (bf)                         \
        F<bf16, __VA_ARGS__> ARGS;  \
    else                            \
        F<float, __VA_ARGS__> ARGS
#define NO_GN GnBwdIn{nullptr, nullptr, nullptr, nullptr, nullptr, 1}
extern "C" __global__ void chan_stats_ncdhw(const void* x, float* part, int C, i64 S, int chunk_len, int nchunks,
                                            int bf) {
    PARTIAL(chan_partial_ncdhw_t, (x, nullptr, NO_GN, part, C, S, chunk_len, nchunks), OP_STATS);
}
extern "C" __global__ void chan_gnbwd_ncdhw(const void* dout, const void* x, const float* mean, const float* rstd,
                                            const float* gamma, const float* beta, const float* off, float* part,
                                            int C, i64 S, int G, int chunk_len, int nchunks, int bf) {
    GnBwdIn gp{mean, rstd, gamma, beta, off, G};
    PARTIAL(chan_partial_ncdhw_t, (dout, x, gp, part, C, S, chunk_len, nchunks), OP_GNBWD);
}
extern "C" __global__ void chan_sum_ncdhw(const void* x, float* part, int C, i64 S, int chunk_len, int nchunks,
                                          int bf) {
    PARTIAL(chan_partial_ncdhw_t, (x, nullptr, NO_GN, part, C, S, chunk_len, nchunks), OP_SUM);
}
// The 8-wide GroupNorm backward sums: 4 blocks of 256 per SM cap them at 64 registers; they spill
// 16-40 bytes there (NVRTC 13.0), which costs less than the lower occupancy of 80 registers, their
// cap until 2026-12-01: 47.2 vs 47.5 ms per whole-head bf16 training step, 172.9 vs 176.8 BraTS
// (H200, same call, docs/perf/h200-2026-12-01p).
#define LB_GNBWD_1
#define LB_GNBWD_4
#define LB_GNBWD_8 __launch_bounds__(256, 4)
#define LB_GNBWD3_1
#define LB_GNBWD3_4
#define LB_GNBWD3_8 __launch_bounds__(256, 4)
#define NDHWC_WRAPPERS(V, BF16_ONLY)                                                                            \
    extern "C" __global__ void chan_stats_ndhwc##V(const void* x, float* part, int C, i64 S, int chunk_len,      \
                                                   int nchunks, int bf) {                                       \
        if (BF16_ONLY || bf)                                                                                    \
            chan_partial_ndhwc_t<bf16, OP_STATS, V>(x, nullptr, NO_GN, part, C, S, chunk_len, nchunks);         \
        else                                                                                                    \
            chan_partial_ndhwc_t<float, OP_STATS, V>(x, nullptr, NO_GN, part, C, S, chunk_len, nchunks);        \
    }                                                                                                           \
    extern "C" __global__ void LB_GNBWD_##V chan_gnbwd_ndhwc##V(const void* dout, const void* x, const float* mean, \
                                                   const float* rstd, const float* gamma, const float* beta,     \
                                                   const float* off, float* part, int C, i64 S, int G,           \
                                                   int chunk_len, int nchunks, int bf) {                         \
        GnBwdIn gp{mean, rstd, gamma, beta, off, G};                                                            \
        if (BF16_ONLY || bf)                                                                                    \
            chan_partial_ndhwc_t<bf16, OP_GNBWD, V>(dout, x, gp, part, C, S, chunk_len, nchunks);               \
        else                                                                                                    \
            chan_partial_ndhwc_t<float, OP_GNBWD, V>(dout, x, gp, part, C, S, chunk_len, nchunks);              \
    }                                                                                                           \
    extern "C" __global__ void LB_GNBWD3_##V chan_gnbwd3_ndhwc##V(const void* dout, const void* x, const float* mean,          \
                                                    const float* rstd, const float* gamma, const float* beta,    \
                                                    const float* off, float* part, int C, i64 S, int G,          \
                                                    int chunk_len, int nchunks, int bf) {                        \
        GnBwdIn gp{mean, rstd, gamma, beta, off, G};                                                            \
        if (BF16_ONLY || bf)                                                                                    \
            chan_partial_ndhwc_t<bf16, OP_GNBWD, V, true>(dout, x, gp, part, C, S, chunk_len, nchunks);         \
        else                                                                                                    \
            chan_partial_ndhwc_t<float, OP_GNBWD, V, true>(dout, x, gp, part, C, S, chunk_len, nchunks);        \
    }                                                                                                           \
    extern "C" __global__ void chan_sum_ndhwc##V(const void* x, float* part, int C, i64 S, int chunk_len,        \
                                                 int nchunks, int bf) {                                         \
        if (BF16_ONLY || bf)                                                                                    \
            chan_partial_ndhwc_t<bf16, OP_SUM, V>(x, nullptr, NO_GN, part, C, S, chunk_len, nchunks);           \
        else                                                                                                    \
            chan_partial_ndhwc_t<float, OP_SUM, V>(x, nullptr, NO_GN, part, C, S, chunk_len, nchunks);          \
    }
NDHWC_WRAPPERS(1, 0)
NDHWC_WRAPPERS(4, 0)
NDHWC_WRAPPERS(8, 1)
// The GroupNorm backward sums over a concatenation given by its parts (CAT above): x = cat([xh +
// xbias, xs]) at channel ca. 4 (f32) or 8 (bf16) channels per thread; the host checks that both
// parts' channel counts are multiples of that. 4 blocks per SM, as the plain sums.
#define CAT_WRAPPER(V, BF16_ONLY)                                                                                \
    extern "C" __global__ void LB_GNBWD_##V chan_gnbwd_cat_ndhwc##V(                                           \
        const void* dout, const void* xh, const void* xs, const float* xbias, const float* mean,               \
        const float* rstd, const float* gamma, const float* beta, const float* off, float* part, int C, i64 S, \
        int G, int chunk_len, int nchunks, int bf, int ca) {                                                    \
        GnBwdIn gp{mean, rstd, gamma, beta, off, G};                                                            \
        if (BF16_ONLY || bf)                                                                                    \
            chan_partial_ndhwc_t<bf16, OP_GNBWD, V, false, true>(dout, xh, gp, part, C, S, chunk_len, nchunks, \
                                                                 xs, xbias, ca);                                \
        else                                                                                                    \
            chan_partial_ndhwc_t<float, OP_GNBWD, V, false, true>(dout, xh, gp, part, C, S, chunk_len, nchunks,\
                                                                  xs, xbias, ca);                               \
    }
CAT_WRAPPER(4, 0)
CAT_WRAPPER(8, 1)
// out[n*C + c] (or out[c] summed over n when over_n) = sum of the chunks' first values, in double.
// grid = number of outputs, block 256: one block per output, its threads stride over the chunks
// (a whole-head 128^3 NDHWC activation has 8192 chunks per channel; one thread per output, as
// this kernel first was, took ~190 us per call). accum adds into out.
extern "C" __global__ void chan_sum_finalize(const float* part, float* out, int N, int C, int nchunks, int over_n,
                                             int accum) {
    __shared__ double sh[32];
    int j = blockIdx.x;
    int c = over_n ? j : j % C;
    int n0 = over_n ? 0 : j / C, n1 = over_n ? N : n0 + 1;
    double t = 0.0;
    for (int n = n0; n < n1; n++)
        for (int k = threadIdx.x; k < nchunks; k += blockDim.x) t += (double)part[(((i64)n * nchunks + k) * C + c) * 2];
    t = block_sum_d(t, sh);
    if (threadIdx.x == 0) out[j] = accum ? out[j] + (float)t : (float)t;
}

// ---- the concatenation that also takes its GroupNorm statistics ---------------------------------
// out (N, S, ca+cb) = cat(a (N, S, ca) + abias[c], b (N, S, cb)) along channels (NDHWC; ca, cb %
// VEC == 0), and stage 1 of OP_STATS over out in the same pass (grid (nchunks, N), block 256, the
// layout of chan_partial_ndhwc_t): a decoder ResBlock normalises the concatenation it builds, so
// no separate statistics pass reads it back. Values are rounded to T before they are summed, as
// that pass would read them.
template <typename T, int VEC>
__device__ void concat_stats_ndhwc_t(void* outv, const void* av, const void* bv, const float* abias, float* part,
                                     int ca, int cb, i64 S, int chunk_len, int nchunks) {
    T* out = (T*)outv;
    const T *a = (const T*)av, *b = (const T*)bv;
    __shared__ float red[2][256 * VEC];
    int C = ca + cb;
    int n = blockIdx.y, chunk = blockIdx.x, t = threadIdx.x;
    int lanes = C / VEC, rows = blockDim.x / lanes;
    int l = t % lanes, r = t / lanes, c0 = l * VEC;
    i64 v0 = (i64)chunk * chunk_len, v1 = min(S, v0 + (i64)chunk_len);
    float s[VEC], q[VEC], shift[VEC];
    if (r < rows) {
        cat_load<T, VEC>(a, b, abias, ca, cb, n, S, v0, c0, shift);
#pragma unroll
        for (int j = 0; j < VEC; j++) s[j] = q[j] = 0.0f;
        // (four voxels per iteration, loads first, measured slower on the H200: 1.28 vs 0.94 ms
        // for the ten whole-head calls). The thread's channels lie in one part, whose bias it
        // holds; element indices are stepped, not recomputed per voxel: cat_load's values, with
        // fewer registers and instructions.
        const bool fa = c0 < ca;
        const T* xp = fa ? a : b;
        const int cp = fa ? ca : cb;
        float bias[VEC];
#pragma unroll
        for (int j = 0; j < VEC; j++) bias[j] = fa && abias ? abias[c0 + j] : 0.0f;
        i64 xi = ((i64)n * S + v0 + r) * cp + (fa ? c0 : c0 - ca), oi = ((i64)n * S + v0 + r) * C + c0;
        const i64 xstep = (i64)rows * cp, ostep = (i64)rows * C;
        for (i64 v = v0 + r; v < v1; v += rows, xi += xstep, oi += ostep) {
            float x[VEC];
            ldv<VEC>(xp, xi, x);
#pragma unroll
            for (int j = 0; j < VEC; j++) x[j] = as_stored<T>(x[j] + bias[j]);
            stv<VEC>(out, oi, x);
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                float d = x[j] - shift[j];
                s[j] += d;
                q[j] += d * d;
            }
        }
        rows_store<VEC>(red, r, C, c0, s, q);
    }
    __syncthreads();
    for (int c = t; c < C; c += blockDim.x) {
        float ss, qq;
        rows_sum<VEC>(red, rows, C, c, ss, qq);
        float sh;
        cat_load<T, 1>(a, b, abias, ca, cb, n, S, v0, c, &sh);
        chan_write<OP_STATS>(part, (((i64)n * nchunks + chunk) * C + c) * 2, ss, qq, v1 - v0, sh);
    }
}
extern "C" __global__ void concat_stats_ndhwc(void* out, const void* a, const void* b, const float* abias,
                                              float* part, int ca, int cb, i64 S, int chunk_len, int nchunks,
                                              int bf, int V) {
    if (bf) {
        if (V == 8)
            concat_stats_ndhwc_t<bf16, 8>(out, a, b, abias, part, ca, cb, S, chunk_len, nchunks);
        else
            concat_stats_ndhwc_t<bf16, 4>(out, a, b, abias, part, ca, cb, S, chunk_len, nchunks);
    } else {
        concat_stats_ndhwc_t<float, 4>(out, a, b, abias, part, ca, cb, S, chunk_len, nchunks);
    }
}

// ---- a decoder ResBlock's skip conv and its GroupNorm statistics, from the concatenation's parts
// out (N, S, CO) = W (CO, C) · cat(a (N, S, ca), b (N, S, cb)) + bias[co] (the 1×1×1 skip conv,
// bf16 NDHWC, C = ca + cb, ca and cb multiples of 32, C and CO of 64) and stage 1 of OP_STATS over the
// concatenation, without the concatenation ever being stored: the decoder ResBlock's in_layers
// conv reads the two parts too (conv3d_wgmma_fwd_gn with x2). Before this kernel the block wrote
// the concatenation (concat_stats_ndhwc: 342 us at 128^3 x 128 channels on the H200) and cuBLAS
// read it back for the skip conv (200 us).
// Grid (nchunks, N), block 256, chunks as concat_stats_ndhwc's. The chunk's voxels are staged in
// tiles of T voxels (a multiple of 16 and of the statistics rows) through a ring of CS_NS buffers
// (cp.async, CS_NS - 1 tiles in flight; rows padded by 16 bytes so the fragment reads fall on
// distinct banks); one barrier a tile. A first version with two buffers of 128 voxels (one tile in
// flight, one block an SM) reached 1.35 TB/s: 595 us at 128^3. The statistics take each staged
// value in concat_stats_ndhwc's order (thread (l, r) sums voxels r, r + rows, ... of the chunk),
// so the partials are bit for bit that kernel's. The skip conv is mma.m16n8k16 with the voxels
// on M; a warp's work item is 16 voxels x 32 outputs. Its K (channels) is permuted so that a
// lane's A fragment is 16 contiguous bytes of a voxel row (channels 8t .. 8t + 7 of each 32) and
// its B fragment the same 16 bytes of a weight row. The sums are staged per warp and written as
// 16-byte vectors, 64 contiguous bytes a voxel.
#define CS_XR(C) ((C) + 32)  // bf16 elements a staged voxel row: 64 bytes of padding, so that the two
                             // rows an 8-lane phase of a fragment read touches (2C a multiple of 128
                             // bytes) fall on distinct banks (16 bytes of padding: 7.5 wavefronts a
                             // 4-wavefront read, ncu)
#define CS_NS 3             // tiles in the ring
#define CS_OR 40            // bf16 elements a warp's staged output row (32 + 16 bytes)
extern "C" __global__ void __launch_bounds__(256, 2)
    cat_skip_stats_ndhwc(bf16* out, const bf16* a, const bf16* b, const bf16* w, const float* bias, float* part,
                         int ca, int cb, int CO, i64 S, int chunk_len, int nchunks, int T) {
    extern __shared__ __align__(16) unsigned char cs_smem[];
    __shared__ float red[2][256 * 8];
    const int C = ca + cb, XR = CS_XR(C);
    bf16* ws = (bf16*)cs_smem;         // W, CO rows of XR
    bf16* xs = ws + (i64)CO * XR;      // CS_NS tiles of T rows of XR
    bf16* os = xs + CS_NS * (i64)T * XR;  // 8 warps x 16 rows of CS_OR
    float* bs = (float*)(os + 8 * 16 * CS_OR);  // the bias, CO floats
    const int n = blockIdx.y, chunk = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int lanes = C / 8, rows = 256 / lanes, l = tid % lanes, r = tid / lanes, c0 = l * 8;
    const i64 v0 = (i64)chunk * chunk_len, v1 = min(S, v0 + (i64)chunk_len);
    const int nv = (int)(v1 - v0), ntiles = (nv + T - 1) / T, C8 = C / 8;
    for (int i = tid; i < CO; i += 256) bs[i] = bias ? bias[i] : 0.0f;
    // W into shared memory (with the first tile's copies: one commit group)
    for (int i = tid; i < CO * C8; i += 256) {
        const int co = i / C8, k = i - co * C8;
        cp_async16(ws + co * XR + k * 8, w + (i64)co * C + k * 8, true);
    }
    // tile `tile`'s copies into its ring buffer, one commit group (empty past the last tile).
    // Thread (l, r) copies the chunks its statistics read: channels c0 .. c0 + 7 of voxels r,
    // r + rows, ... (T is a multiple of rows), pointers stepped (the generic index arithmetic
    // of a first version cost ~60 instructions a copy: 110 instructions a voxel in all, ncu).
    const bool fa = c0 < ca;
    const int cp = fa ? ca : cb;
    const bf16* src0 = fa ? a + ((i64)n * S + v0) * ca + c0 : b + ((i64)n * S + v0) * cb + (c0 - ca);
    auto stage = [&](int tile) {
        if (tile < ntiles && r < rows) {
            bf16* dst = xs + (i64)(tile % CS_NS) * T * XR + r * XR + c0;
            const bf16* src = src0 + (i64)(tile * T + r) * cp;
            const int lim = nv - tile * T;
            const i64 sstep = (i64)rows * cp;
            for (int vi = r; vi < T; vi += rows, dst += rows * XR, src += sstep) cp_async16(dst, vi < lim ? src : a, vi < lim);
        }
        cp_async_commit();
    };
    float shift[8], s[8], q[8];
    if (r < rows) cat_load<bf16, 8>(a, b, nullptr, ca, cb, n, S, v0, c0, shift);
#pragma unroll
    for (int j = 0; j < 8; j++) s[j] = q[j] = 0.0f;
#pragma unroll
    for (int k = 0; k < CS_NS - 1; k++) stage(k);
    const int t4 = lane & 3, g = lane >> 2, items = (T / 16) * (CO / 32);
    bf16* ow = os + warp * 16 * CS_OR;
    for (int tile = 0; tile < ntiles; tile++) {
        const int tv = min(T, nv - tile * T);
        cp_async_wait<CS_NS - 2>();  // this tile's copies (this thread's) landed
        __syncthreads();             // everyone's; and the previous tile's buffer is free
        stage(tile + CS_NS - 1);
        const bf16* xt = xs + (i64)(tile % CS_NS) * T * XR;
        // the statistics, in concat_stats_ndhwc's order
        if (r < rows) {
            const bf16* xp = xt + r * XR + c0;
            for (int vi = r; vi < tv; vi += rows, xp += rows * XR) {
                float x[8];
                const uint4 u = *reinterpret_cast<const uint4*>(xp);
                unpack2(u.x, x);
                unpack2(u.y, x + 2);
                unpack2(u.z, x + 4);
                unpack2(u.w, x + 6);
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    // (cat_load rounds x + 0, making a -0 +0; x - shift is then -0 where it was
                    // +0, which sums to the same s and q: a running sum never is -0)
                    const float d = x[j] - shift[j];
                    s[j] += d;
                    q[j] += d * d;
                }
            }
        }
        // the skip conv: work item it = (m16 tile it % (T / 16), outputs 32 (it / (T / 16)) ..)
        for (int it = warp; it < items; it += 8) {
            const int mt = it % (T / 16), cg = (it / (T / 16)) * 32;
            if (mt * 16 >= tv) continue;
            const bf16* xr = xt + (mt * 16 + g) * XR + t4 * 8;
            float acc[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
            for (int kb = 0; kb < C; kb += 32) {
                const uint4 lo = *reinterpret_cast<const uint4*>(xr + kb);
                const uint4 hi = *reinterpret_cast<const uint4*>(xr + 8 * XR + kb);
                const u32 a0[4] = {lo.x, hi.x, lo.y, hi.y}, a1[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    const uint4 wv = *reinterpret_cast<const uint4*>(ws + (cg + nt * 8 + g) * XR + kb + t4 * 8);
                    mma_bf16_16816(acc[nt], a0, wv.x, wv.y);
                    mma_bf16_16816(acc[nt], a1, wv.z, wv.w);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const int co = nt * 8 + 2 * t4;
                const float b0 = bs[cg + co], b1 = bs[cg + co + 1];
                *reinterpret_cast<u32*>(ow + g * CS_OR + co) = pack_bf2(acc[nt][0] + b0, acc[nt][1] + b1);
                *reinterpret_cast<u32*>(ow + (g + 8) * CS_OR + co) = pack_bf2(acc[nt][2] + b0, acc[nt][3] + b1);
            }
            __syncwarp();
            // 16 voxels x 32 outputs: 64 contiguous bytes a voxel, as 16-byte vectors
            const int m = min(16, tv - mt * 16);
            const i64 ob = ((i64)n * S + v0 + (i64)tile * T + mt * 16) * CO + cg;
            for (int i = lane; i < m * 4; i += 32) {
                const int vi = i >> 2, k = i & 3;
                *reinterpret_cast<uint4*>(out + ob + (i64)vi * CO + k * 8) =
                    *reinterpret_cast<const uint4*>(ow + vi * CS_OR + k * 8);
            }
            __syncwarp();
        }
    }
    cp_async_wait<0>();
    if (r < rows) rows_store<8>(red, r, C, c0, s, q);
    __syncthreads();
    for (int c = tid; c < C; c += 256) {
        float ss, qq;
        rows_sum<8>(red, rows, C, c, ss, qq);
        float sh;
        cat_load<bf16, 1>(a, b, nullptr, ca, cb, n, S, v0, c, &sh);
        chan_write<OP_STATS>(part, (((i64)n * nchunks + chunk) * C + c) * 2, ss, qq, v1 - v0, sh);
    }
}

// ---- a decoder ResBlock's GroupNorm+SiLU backward into the parts, with its skip conv's data
// gradient added (the backward twin of cat_skip_stats_ndhwc)
// gn_bwd_apply_split's from-the-parts pass (bf16 NDHWC, beta given: the SiLU) and the 1x1x1 skip
// conv's data gradient in one: for voxel v and concatenation channel c,
//   part[v][c] (= or +=) A_c·g·silu'(y) + B_c·x + K_c + sum_o dout[v][o]·W[o][c],
// rounded to bf16 once (before: the pass wrote the part, then a cuBLAS GEMM with beta = 1 read it
// back and wrote it again), and act[v][c] = silu(y) as gn_bwd_apply_split writes it (bit for
// bit: the same coefficients, the same arithmetic). y = GN(x), x read from the parts as stored
// (xh + xbias, xs), g = dy (the in_layers conv's data gradient, C channels), (A, B, K) from the
// statistics and gn_bwd_finalize's coef as gn_bwd_apply_body computes them.
// Grid (nchunks, N), chunks of chunk_len voxels (a multiple of 16); block: C / 32 warps, or a
// multiple R of them up to 8. Each warp owns one 32-channel group of C and every R-th 16-voxel
// item of the chunk (from the (warp / (C / 32))-th), and runs it alone (no block barrier after
// W^T and the coefficients are staged):
//   its dy, x (and old part) loads issued first; the item's 16 x 32 sums on mma.m16n8k16
//   (voxels on M, K = CO permuted as cat_skip_stats_ndhwc reads it, A = the dout rows straight
//   from global, B = W^T rows from shared memory); the sums turned through the warp's own shared
//   tile so that lane (g, t4) holds channels t4·8 .. t4·8 + 7 of voxels g and g + 8; then the
//   elementwise pass on those two voxels, its coefficients from a shared table.
// At 128³ (C 128, CO 64) ncu: 0.74 ms, 68 % of DRAM bandwidth, L2 81 % busy. Before, a block
// staged 64-voxel tiles and alternated the MMAs and the elementwise pass behind __syncthreads:
// 0.83 ms, 60 %, 0.87 eligible warps a scheduler. Not kept: the dout loads marked
// L1::no_allocate (0.75 ms), the dout rows shared by the C / 32 warps of an item through a
// cp.async tile and a named barrier (0.77 ms; the L2 stayed 78 % busy).
// Dynamic shared memory: W^T (C rows of CO + 32 bf16), the (A, B, K, sh) table (C float4,
// entry (c % 8)·(C / 8) + c / 8: a warp's four t4 read consecutive entries), a 16 x 32 float
// tile a warp. Requires C and CO multiples of 64, C <= 256 and ca a multiple of 8 (host:
// skip_apply_fits).
#define SD_XR(K) ((K) + 32)
// Element j (a constant after unrolling) of 8 packed bf16.
__device__ __forceinline__ float bf_at(uint4 t, int j) {
    const u32 w = j < 2 ? t.x : j < 4 ? t.y : j < 6 ? t.z : t.w;
    return __uint_as_float(j & 1 ? w & 0xffff0000u : w << 16);
}
// 16 bytes stored as one vector (as a uint4 assignment, ptxas split one of the pass's two stores
// into four under register pressure).
__device__ __forceinline__ void st_v4(void* p, const u32* w) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
}
// A warp's turn tile: 16 rows of 32 floats, row r's float4 chunk k stored at chunk
// k ^ (2·(r & 3) + (r & 1)): the MMA fragments' float2 stores (half a warp: rows 0-3, chunks
// 2nt, 2nt + 1) and the lanes' float4 reads (a quarter: rows g, g + 1, chunks 2·t4 (+ 1)) each
// reach 32 distinct banks (unswizzled with 36-float rows, the stores conflicted two ways).
#define SD_TR 32
__device__ __forceinline__ int sd_chunk(int r, int k) { return k ^ (2 * (r & 3) + (r & 1)); }
extern "C" __global__ void __launch_bounds__(256, 2)
    gn_bwd_apply_split_skip(const bf16* dy, const float* mean, const float* rstd, const float* gamma,
                            const float* beta, const float* coef, bf16* dxh, bf16* dxs, bf16* act, int C, i64 S,
                            int G, int accum, int ca, const bf16* xh, const bf16* xs, const float* xbias,
                            const bf16* dout, const bf16* w, int CO, int chunk_len) {
    extern __shared__ __align__(16) unsigned char sd_smem[];
    const int XR = SD_XR(CO), C8 = C / 8;
    bf16* wt = (bf16*)sd_smem;                   // W^T: C rows of XR
    float4* tab = (float4*)(wt + (i64)C * XR);   // (A, B, K, sh) a channel
    float* turn = (float*)(tab + C);             // 16 x SD_TR a warp (swizzled: sd_chunk)
    const int n = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const i64 v0 = (i64)blockIdx.x * chunk_len, v1 = min(S, v0 + (i64)chunk_len);
    if (v0 >= v1) return;  // the whole block: v0 is the block's
    for (int i = tid; i < CO * C; i += blockDim.x) {
        const int o = i / C, c = i - o * C;
        wt[c * XR + o] = w[i];
    }
    const int cpg = C / G;
    for (int c = tid; c < C; c += blockDim.x) {
        const int ng = n * G + c / cpg;
        const float rs = rstd[ng], m1 = coef[2 * ng], m2 = coef[2 * ng + 1], mu = mean[ng];
        float A, sh;
        gn_affine(rs, gamma[c], beta[c], mu, A, sh);
        tab[(c % 8) * C8 + c / 8] = make_float4(A, -rs * rs * m2, rs * (mu * rs * m2 - m1), sh);
    }
    __syncthreads();
    // this warp's channel group and items, this lane's channels, their part
    const int NG = C / 32, R = (int)(blockDim.x >> 5) / NG, cg = (warp % NG) * 32;
    const int t4 = lane & 3, g = lane >> 2, c0 = cg + t4 * 8;
    const bool fa = c0 < ca;
    const int cp = fa ? ca : C - ca, cc = fa ? c0 : c0 - ca;
    const bf16* xin = fa ? xh : xs;
    bf16* out = fa ? dxh : dxs;
    const int acc = fa ? (accum & 1) : ((accum >> 1) & 1);
    const bool hb = fa && xbias;
    const float4* tb = tab + c0 / 8;
    float* tw = turn + warp * 16 * SD_TR;
    const bf16* wr = wt + (cg + g) * XR + t4 * 8;  // B rows: channel cg + nt·8 + g
    const int items = (int)((v1 - v0 + 15) / 16);
    for (int it = warp / NG; it < items; it += R) {
        const i64 vb = v0 + (i64)it * 16;
        const int tv = (int)min((i64)16, v1 - vb);
        const i64 va = (i64)n * S + vb + g;  // this lane's voxels: va and va + 8
        const bool ok[2] = {g < tv, g + 8 < tv};
        const uint4 z = make_uint4(0u, 0u, 0u, 0u);
        uint4 graw[2], xraw[2], oraw[2];  // packed until used: unpacked, two voxels spilled
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const i64 v = va + 8 * u;
            graw[u] = ok[u] ? *reinterpret_cast<const uint4*>(dy + v * C + c0) : z;
            xraw[u] = ok[u] ? *reinterpret_cast<const uint4*>(xin + v * cp + cc) : z;
            oraw[u] = ok[u] && acc ? *reinterpret_cast<const uint4*>(out + v * cp + cc) : z;
        }
        // the skip conv's data gradient of the item's 16 voxels x 32 channels
        float s4[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) s4[nt][0] = s4[nt][1] = s4[nt][2] = s4[nt][3] = 0.0f;
        const bf16* ar = dout + va * CO + t4 * 8;
#pragma unroll 1
        for (int kb = 0; kb < CO; kb += 64) {
            uint4 lo[2], hi[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                lo[h] = ok[0] ? *reinterpret_cast<const uint4*>(ar + kb + 32 * h) : z;
                hi[h] = ok[1] ? *reinterpret_cast<const uint4*>(ar + 8 * CO + kb + 32 * h) : z;
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u32 a0[4] = {lo[h].x, hi[h].x, lo[h].y, hi[h].y}, a1[4] = {lo[h].z, hi[h].z, lo[h].w, hi[h].w};
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    const uint4 wv = *reinterpret_cast<const uint4*>(wr + nt * 8 * XR + kb + 32 * h);
                    mma_bf16_16816(s4[nt], a0, wv.x, wv.y);
                    mma_bf16_16816(s4[nt], a1, wv.z, wv.w);
                }
            }
        }
        __syncwarp();  // the previous item's reads of the turn tile are done
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            float* t0 = tw + g * SD_TR + sd_chunk(g, 2 * nt + (t4 >> 1)) * 4 + 2 * (t4 & 1);
            *reinterpret_cast<float2*>(t0) = make_float2(s4[nt][0], s4[nt][1]);
            *reinterpret_cast<float2*>(t0 + 8 * SD_TR) = make_float2(s4[nt][2], s4[nt][3]);
        }
        __syncwarp();
        // the elementwise pass, a voxel at a time (values unpacked as used, results packed as
        // made: both voxels' values unpacked at once took 134 registers, over the 128 of two
        // blocks an SM)
        float xb[8];  // the first part's bias
#pragma unroll
        for (int j = 0; j < 8; j++) xb[j] = 0.0f;
        if (hb) ldv<8>(xbias, c0, xb);
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const float* tr = tw + (g + 8 * u) * SD_TR;
            const float4 s0 = *reinterpret_cast<const float4*>(tr + sd_chunk(g, 2 * t4) * 4);
            const float4 s1 = *reinterpret_cast<const float4*>(tr + sd_chunk(g, 2 * t4 + 1) * 4);
            const float sk[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
            u32 yp[4], op[4];
            float ye = 0.0f, oe = 0.0f;  // an even channel's results, packed with the odd one's
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float4 f = lds4(tb + j * C8);  // (A, B, K, sh) of channel c0 + j
                float xj = bf_at(xraw[u], j);
                if (hb) xj = as_stored<bf16>(xj + xb[j]);
                const float yy = gn_y(xj, f.x, f.w);
                float sg, sl;
                silu_sig_t<bf16>(yy, sl, sg);
                const float gj = bf_at(graw[u], j) * (sg * (1.0f + yy * (1.0f - sg)));
                const float d = f.x * gj + f.y * xj + f.z;
                const float oj = (acc ? bf_at(oraw[u], j) + d : d) + sk[j];
                if (j & 1) {
                    yp[j / 2] = pack2(ye, sl);
                    op[j / 2] = pack2(oe, oj);
                } else {
                    ye = sl;
                    oe = oj;
                }
            }
            if (!ok[u]) continue;
            const i64 v = va + 8 * u;
            st_v4(act + v * C + c0, yp);
            st_v4(out + v * cp + cc, op);
        }
    }
}
