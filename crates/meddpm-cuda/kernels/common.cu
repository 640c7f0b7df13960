// common.cu: helpers shared by every meddpm NVRTC kernel (prepended to each source file).
//
// Conventions (binding for all kernels, see crates/meddpm/src/backend.rs):
// - Activations have a logical shape (N, C, D, H, W); S = D*H*W. `cl` selects the memory layout:
//   cl == 0: NCDHW, element (n, c, s) at (n*C + c)*S + s;  cl == 1: NDHWC, at (n*S + s)*C + c.
// - Flat indices are 64-bit (a 128^3 x 512 x 2 activation has more than 2^31 elements).
// - `accum` == 1 adds into the destination (Accum::Add), 0 overwrites it.
// - Element types: activation buffers hold f32 or bf16 (GpuBuf's tag). A kernel that reads or writes
//   them takes `void*` pointers and a flag `bf` (or a bit mask `dt`, one bit per pointer, documented at
//   the kernel) and dispatches once, at its start, to a body templated on the storage type T (float or
//   bf16). Bodies read through ld()/ld4() and write through st()/st4(): all arithmetic is f32, and a
//   bf16 store rounds to nearest even (f2bf, the twin of meddpm::backend::round_bf16).
// No #include: NVRTC compiles these without the CUDA headers.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

// bf16 storage: the upper half of an f32. A distinct struct type so overloads tell it from u16.
struct bf16 {
    u16 b;
};
__device__ __forceinline__ float bf2f(bf16 h) { return __uint_as_float(((u32)h.b) << 16); }
// Round to nearest even. From sm_80 one cvt instruction (a NaN becomes the canonical quiet NaN);
// before, the integer form (a NaN stays a quiet NaN with its sign and upper payload), which is
// also what round_bf16 computes for every non-NaN value. The integer form was ~8 integer ops a
// value: ncu found bf16 elementwise kernels issue-bound on the integer pipe
// (docs/perf/h200-2026-12-03l).
__device__ __forceinline__ bf16 f2bf(float f) {
    bf16 r;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.b) : "f"(f));
#else
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.b = (u16)((u | 0x00400000u) >> 16);  // NaN stays a (quiet) NaN
    } else {
        r.b = (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
#endif
    return r;
}

__device__ __forceinline__ float ld(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16* p, i64 i) { return bf2f(p[i]); }
__device__ __forceinline__ void st(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16* p, i64 i, float v) { p[i] = f2bf(v); }

// Four consecutive elements p[4*i4 .. 4*i4+3] (16-byte f32 / 8-byte bf16 accesses; aligned by the
// host's conditions).
__device__ __forceinline__ void ld4(const float* p, i64 i4, float* v) {
    float4 t = reinterpret_cast<const float4*>(p)[i4];
    v[0] = t.x;
    v[1] = t.y;
    v[2] = t.z;
    v[3] = t.w;
}
__device__ __forceinline__ void ld4(const bf16* p, i64 i4, float* v) {
    uint2 t = reinterpret_cast<const uint2*>(p)[i4];
    v[0] = __uint_as_float(t.x << 16);
    v[1] = __uint_as_float(t.x & 0xffff0000u);
    v[2] = __uint_as_float(t.y << 16);
    v[3] = __uint_as_float(t.y & 0xffff0000u);
}
__device__ __forceinline__ void st4(float* p, i64 i4, const float* v) {
    reinterpret_cast<float4*>(p)[i4] = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void st4(bf16* p, i64 i4, const float* v) {
    uint2 t;
    t.x = (u32)f2bf(v[0]).b | ((u32)f2bf(v[1]).b << 16);
    t.y = (u32)f2bf(v[2]).b | ((u32)f2bf(v[3]).b << 16);
    reinterpret_cast<uint2*>(p)[i4] = t;
}

// Run templated body F<T>(args...) with T = bf16 when `bf`, else float.
#define DISPATCH(bf, F, ...)            \
    do {                                \
        if (bf)                         \
            F<bf16>(__VA_ARGS__);       \
        else                            \
            F<float>(__VA_ARGS__);      \
    } while (0)

#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// Channel of memory element i (32-bit division when the indices fit: 64-bit division is slow).
__device__ __forceinline__ int chan_of(i64 i, int C, i64 S, int cl) {
    if ((u64)i < 0xffffffffull && (u64)S < 0xffffffffull) {
        u32 u = (u32)i;
        return cl ? (int)(u % (u32)C) : (int)((u / (u32)S) % (u32)C);
    }
    return cl ? (int)(i % C) : (int)((i / S) % C);
}

// Sample of memory element i given C*S elements per sample.
__device__ __forceinline__ int sample_of(i64 i, i64 CS) {
    if ((u64)i < 0xffffffffull && (u64)CS < 0xffffffffull) return (int)((u32)i / (u32)CS);
    return (int)(i / CS);
}

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// d/dx of x*sigmoid(x).
__device__ __forceinline__ float silu_grad(float x) {
    float s = sigmoid_f(x);
    return s * (1.0f + x * (1.0f - s));
}

// Where the result is stored in bf16 (8-bit mantissa), the sigmoid is the hardware tanh:
// sigmoid(x) = 0.5 + 0.5 * tanh(x / 2) (MUFU.TANH, max relative error ~2^-11, so at most ~2^-12
// absolute in the sigmoid: a sixteenth of a bf16 ulp at 1); f32 storage keeps the accurate
// functions. One MUFU a value: conv3d_wgmma_fwd_gn evaluates silu(GN(x)) for every staged input
// value (three times a value) beside the tensor cores, and with exp2 + reciprocal (two MUFU,
// relative error ~2^-22) it set the pace and took 1.25-1.35x the plain conv's time; with the tanh
// the fused forward is faster than GroupNorm+SiLU then the conv (docs/perf/h200-2026-12-02c). The
// elementwise GroupNorm+SiLU passes use the same function, so a recomputed silu(y) is bit for bit
// the forward's, fused or not. Limits: tanh saturates at +-1, the sigmoid at 0 and 1.
template <typename T>
struct FastMath {
    static constexpr bool on = false;
};
template <>
struct FastMath<bf16> {
    static constexpr bool on = true;
};
__device__ __forceinline__ float ex2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float rcp_ftz(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
template <typename T>
__device__ __forceinline__ float sigmoid_t(float x) {
    return FastMath<T>::on ? __fmaf_rn(0.5f, tanh_approx(0.5f * x), 0.5f) : sigmoid_f(x);
}
// silu(y) = y·σ(y) as the bf16 paths (FastMath) store it: with h = y / 2, σ(y) = (1 + tanh h) / 2, so
// silu(y) = h + h·tanh(h), one MUFU and one FMA once h is known (against y·sigmoid_t(y): two more
// multiplies and a second rounding). h = y / 2 is exact (a power of two; outside the subnormal
// range, where silu rounds to ~0 anyway), so a kernel may take h straight from a halved affine map
// (gn_y with sc / 2, sh / 2: conv3d_wgmma_fwd_gn's prologue) and store the same bits as gn_apply.
__device__ __forceinline__ float silu_h(float h) { return __fmaf_rn(h, tanh_approx(h), h); }
template <typename T>
__device__ __forceinline__ float silu_t(float y) {
    return FastMath<T>::on ? silu_h(0.5f * y) : y * sigmoid_f(y);
}
// silu(y) and σ(y) (= sigmoid_t(y)) from one tanh / sigmoid: the GroupNorm+SiLU backward passes
// that recompute the activation beside silu'(y)
template <typename T>
__device__ __forceinline__ void silu_sig_t(float y, float& silu, float& sig) {
    if (FastMath<T>::on) {
        const float h = 0.5f * y, th = tanh_approx(h);
        sig = __fmaf_rn(0.5f, th, 0.5f);
        silu = __fmaf_rn(h, th, h);
    } else {
        sig = sigmoid_f(y);
        silu = y * sig;
    }
}
template <typename T>
__device__ __forceinline__ float silu_grad_t(float x) {
    float s = sigmoid_t<T>(x);
    return s * (1.0f + x * (1.0f - s));
}

// GroupNorm+SiLU's per-channel affine map y = x·sc + sh (sc = rstd·γ, sh = β − μ·sc, μ the group
// mean less the channel's input offset), rounded the same way in every kernel that evaluates it
// (explicit _rn intrinsics: no contraction left to the compiler), so the backward's recomputed
// silu(y) is bit for bit the forward's.
__device__ __forceinline__ void gn_affine(float rstd, float gamma, float beta, float mu, float& sc, float& sh) {
    sc = __fmul_rn(rstd, gamma);
    sh = __fmaf_rn(-mu, sc, beta);
}
__device__ __forceinline__ float gn_y(float x, float sc, float sh) { return __fmaf_rn(x, sc, sh); }

// A float4 of a per-channel table in shared memory, loaded where it stands (asm volatile: the
// compiler does not hoist it out of a loop into registers). The GroupNorm backward passes keep
// their per-channel coefficients in such tables: as registers they were 3-5 floats per channel
// and thread, which capped occupancy at 24-33 % and bandwidth at 2.2-3.1 TB/s on the H200 (ncu).
__device__ __forceinline__ float4 lds4(const float4* p) {
    float4 v;
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a 1-D block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
// `sh` must hold 32 floats. Contains __syncthreads: call from all threads.
__device__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = (lane < nw) ? sh[lane] : 0.0f;
    return warp_sum(v);
}
__device__ double block_sum_d(double v, double* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = (lane < nw) ? sh[lane] : 0.0;
    return warp_sum_d(v);
}
// Two sums over a 1-D block at once (one pair of barriers); `sh` must hold 32 double2.
__device__ void block_sum_d2(double& a, double& b, double2* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    a = warp_sum_d(a);
    b = warp_sum_d(b);
    __syncthreads();
    if (lane == 0) sh[wid] = make_double2(a, b);
    __syncthreads();
    const double2 v = (lane < nw) ? sh[lane] : make_double2(0.0, 0.0);
    a = warp_sum_d(v.x);
    b = warp_sum_d(v.y);
}
__device__ float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = (lane < nw) ? sh[lane] : -3.402823466e38f;
    return warp_max(v);
}

// ---- vectors of V consecutive elements (16-byte accesses for (float, 4) and (bf16, 8)) -----------
// i is an element index, a multiple of V; the host guarantees the alignment.
// f32: float4 accesses for any V that is a multiple of 4 (V = 8: the upsampling's shared-memory
// rows of bf16 activations).
template <int V>
__device__ __forceinline__ void ldv(const float* p, i64 i, float* v) {
    if (V % 4 == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 4) {
            float4 t = *reinterpret_cast<const float4*>(p + i + j);
            v[j] = t.x;
            v[j + 1] = t.y;
            v[j + 2] = t.z;
            v[j + 3] = t.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; j++) v[j] = p[i + j];
    }
}
__device__ __forceinline__ void unpack2(u32 w, float* v) {
    v[0] = __uint_as_float(w << 16);
    v[1] = __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ u32 pack2(float a, float b) {
#if __CUDA_ARCH__ >= 800
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
#else
    return (u32)f2bf(a).b | ((u32)f2bf(b).b << 16);
#endif
}
template <int V>
__device__ __forceinline__ void ldv(const bf16* p, i64 i, float* v) {
    if (V == 8) {
        uint4 t = *reinterpret_cast<const uint4*>(p + i);
        unpack2(t.x, v);
        unpack2(t.y, v + 2);
        unpack2(t.z, v + 4);
        unpack2(t.w, v + 6);
    } else if (V == 4) {
        uint2 t = *reinterpret_cast<const uint2*>(p + i);
        unpack2(t.x, v);
        unpack2(t.y, v + 2);
    } else {
#pragma unroll
        for (int j = 0; j < V; j++) v[j] = bf2f(p[i + j]);
    }
}
template <int V>
__device__ __forceinline__ void stv(float* p, i64 i, const float* v) {
    if (V % 4 == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 4) *reinterpret_cast<float4*>(p + i + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
    } else {
#pragma unroll
        for (int j = 0; j < V; j++) p[i + j] = v[j];
    }
}
template <int V>
__device__ __forceinline__ void stv(bf16* p, i64 i, const float* v) {
    if (V == 8) {
        uint4 t;
        t.x = pack2(v[0], v[1]);
        t.y = pack2(v[2], v[3]);
        t.z = pack2(v[4], v[5]);
        t.w = pack2(v[6], v[7]);
        *reinterpret_cast<uint4*>(p + i) = t;
    } else if (V == 4) {
        uint2 t;
        t.x = pack2(v[0], v[1]);
        t.y = pack2(v[2], v[3]);
        *reinterpret_cast<uint2*>(p + i) = t;
    } else {
#pragma unroll
        for (int j = 0; j < V; j++) p[i + j] = f2bf(v[j]);
    }
}

// ---- channel-constant traversal (elementwise.rs `RowLaunch` picks the launch) ----------------------
// Each thread handles vectors of V consecutive elements whose channels stay the same for the whole
// loop, so per-channel constants are loaded once and no element index is ever divided:
//  cl == 1 (NDHWC): grid (gx, N), block a multiple of lanes = C / V; the thread's channels are
//                   c0 .. c0 + V - 1, c0 = (threadIdx.x % lanes) * V; its vectors are the
//                   grid-stride v of sample n (element n*S*C + v*V), voxel v / lanes.
//  cl == 0 (NDHWC's transpose, NCDHW): grid (gx, N*C), row = blockIdx.y (n = row / C, c = row % C);
//                   the thread's vectors walk the row's S elements (S % V == 0); one channel.
struct Row {
    i64 base;   // element index of the sample (NDHWC) or row (NCDHW) start
    i64 nvec;   // vectors in it
    i64 start;  // this thread's first vector
    i64 step;   // grid stride in vectors
    int n;      // sample
    int c0;     // channel of the first element
    int cstep;  // channel step between a vector's elements (1 NDHWC, 0 NCDHW)
    int lanes;  // vectors per voxel (NDHWC), 1 (NCDHW)
};
__device__ __forceinline__ Row row_geom(int C, i64 S, int V, int cl) {
    Row r;
    if (cl) {
        r.lanes = C / V;
        r.n = blockIdx.y;
        r.c0 = (threadIdx.x % r.lanes) * V;
        r.cstep = 1;
        r.base = (i64)r.n * S * C;
        r.nvec = S * r.lanes;
    } else {
        r.lanes = 1;
        r.n = blockIdx.y / C;
        r.c0 = blockIdx.y % C;
        r.cstep = 0;
        r.base = (i64)blockIdx.y * S;
        r.nvec = S / V;
    }
    r.start = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    r.step = (i64)gridDim.x * blockDim.x;
    return r;
}

// F<T, V>(args...) with T from `bf` and V one of 1, 4, 8 (8 only for bf16).
#define DISPATCH_V(bf, V, F, ...)                  \
    do {                                           \
        if (bf) {                                  \
            if (V == 8)                            \
                F<bf16, 8>(__VA_ARGS__);           \
            else if (V == 4)                       \
                F<bf16, 4>(__VA_ARGS__);           \
            else                                   \
                F<bf16, 1>(__VA_ARGS__);           \
        } else {                                   \
            if (V == 4)                            \
                F<float, 4>(__VA_ARGS__);          \
            else                                   \
                F<float, 1>(__VA_ARGS__);          \
        }                                          \
    } while (0)

// bf16 helpers of the tensor-core kernels: two values packed into one 32-bit register (lower index
// in the low half, as mma fragments hold them), and D = A*B + D on mma.m16n8k16 (row.col, f32 sums).
// The packing is one cvt.rn.bf16x2.f32: round to nearest even as f2bf, bit for bit except for a
// NaN's payload (the hardware gives the canonical NaN), in one instruction instead of ~10 a value.
__device__ __forceinline__ u32 pack_bf2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// A 16-byte global → shared copy (cp.async, sm_80+), zero-filled where !ok (src then unread).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    const u32 d = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
