// elementwise.cu: residual adds, scaling, per-channel broadcast adds, channel concat/split, the
// conv channel padding, and type conversion, for both layouts and both storage types.
// Semantics: crates/meddpm/src/backend.rs (add_assign, scale, add_channel_bias, concat_channels,
// split_channels) and the conv/linear bias adds. Activation pointers are `void*` with a type flag
// (common.cu): `bf` when all of a kernel's activation pointers share one type, else a bit mask `dt`.
// The hot kernels move V elements per access (16 bytes: V = 4 f32, 8 bf16; the host picks V = 1
// where shapes or alignment do not allow it) and, where channels matter, use the channel-constant
// traversal of common.cu (`Row`), so no element index is divided.

// dst += src over n elements (n % V == 0), grid-stride over vectors.
template <typename T, int V>
__device__ void add_assign_t(void* dstv, const void* srcv, i64 n) {
    T* dst = (T*)dstv;
    const T* src = (const T*)srcv;
    i64 nv = n / V;
    for (i64 v = (i64)blockIdx.x * blockDim.x + threadIdx.x; v < nv; v += (i64)gridDim.x * blockDim.x) {
        float a[V], b[V];
        ldv<V>(dst, v * V, a);
        ldv<V>(src, v * V, b);
#pragma unroll
        for (int j = 0; j < V; j++) a[j] += b[j];
        stv<V>(dst, v * V, a);
    }
}
extern "C" __global__ void add_assign(void* dst, const void* src, i64 n, int bf, int V) {
    DISPATCH_V(bf, V, add_assign_t, dst, src, n);
}

template <typename T>
__device__ void scale_t(void* bufv, float s, i64 n) {
    T* buf = (T*)bufv;
    GRID_STRIDE(i, n) st(buf, i, ld(buf, i) * s);
}
extern "C" __global__ void scale_buf(void* buf, float s, i64 n, int bf) {
    DISPATCH(bf, scale_t, buf, s, n);
}

// y[n, c, s] = x[n, c, s] + bias[per_n ? n*C + c : c] over an (N, C, S) activation (Row
// traversal); y may be x (in place); bias f32.
template <typename T, int V>
__device__ void add_channel_bias_t(void* yv, const void* xv, const float* bias, int C, i64 S, int cl, int per_n) {
    T* y = (T*)yv;
    const T* x = (const T*)xv;
    Row r = row_geom(C, S, V, cl);
    float b[V];
#pragma unroll
    for (int j = 0; j < V; j++) {
        int c = r.c0 + j * r.cstep;
        b[j] = bias[per_n ? r.n * C + c : c];
    }
    for (i64 v = r.start; v < r.nvec; v += r.step) {
        i64 i = r.base + v * V;
        float a[V];
        ldv<V>(x, i, a);
#pragma unroll
        for (int j = 0; j < V; j++) a[j] += b[j];
        stv<V>(y, i, a);
    }
}
extern "C" __global__ void add_channel_bias(void* y, const void* x, const float* bias, int C, i64 S, int cl,
                                            int per_n, int bf, int V) {
    DISPATCH_V(bf, V, add_channel_bias_t, y, x, bias, C, S, cl, per_n);
}

// The source of output row element (Row traversal over the (ca+cb)-channel concatenation): for the
// thread's vectors, the a or b tensor (its own channel count) and the first channel in it.
struct CatSrc {
    int from_b, cc, c;
};
__device__ __forceinline__ CatSrc cat_src(const Row& r, int ca, int cb) {
    CatSrc s;
    s.from_b = r.c0 >= ca;
    s.cc = s.from_b ? cb : ca;
    s.c = s.from_b ? r.c0 - ca : r.c0;
    return s;
}
// Element index in a or b of the thread's vector number u = v / lanes (the voxel in NDHWC, the
// vector along the row in NCDHW; Row of the concatenation, C = ca+cb channels). Block and grid
// strides are multiples of lanes, so u advances by step / lanes: no division in the loop.
__device__ __forceinline__ i64 cat_index(const Row& r, const CatSrc& s, i64 u, int V, i64 S, int cl) {
    if (cl) return ((i64)r.n * S + u) * s.cc + s.c;
    return ((i64)r.n * s.cc + s.c) * S + u * V;
}

// out (N, ca+cb, S) = cat(a (N, ca, S) + abias[c], b (N, cb, S)) along channels (NDHWC: ca, cb %
// V == 0); abias f32 (ca) or null (a copied as is).
template <typename T, int V>
__device__ void concat_t(void* outv, const void* av, const void* bv, const float* abias, int ca, int cb, i64 S,
                         int cl) {
    T* out = (T*)outv;
    Row r = row_geom(ca + cb, S, V, cl);
    CatSrc s = cat_src(r, ca, cb);
    const T* src = s.from_b ? (const T*)bv : (const T*)av;
    const bool add = !s.from_b && abias != nullptr;
    float bv4[V];
#pragma unroll
    for (int j = 0; j < V; j++) bv4[j] = add ? abias[s.c + j * r.cstep] : 0.0f;
    i64 u = r.start / r.lanes, ustep = r.step / r.lanes;
    for (i64 v = r.start; v < r.nvec; v += r.step, u += ustep) {
        float x[V];
        ldv<V>(src, cat_index(r, s, u, V, S, cl), x);
        if (add) {
#pragma unroll
            for (int j = 0; j < V; j++) x[j] += bv4[j];
        }
        stv<V>(out, r.base + v * V, x);
    }
}
extern "C" __global__ void concat_channels(void* out, const void* a, const void* b, const float* abias, int ca, int cb,
                                           i64 S, int cl, int bf, int V) {
    DISPATCH_V(bf, V, concat_t, out, a, b, abias, ca, cb, S, cl);
}

// Backward of concat: da, db from dout, each overwritten or accumulated.
template <typename T, int V>
__device__ void split_t(void* dav, void* dbv, const void* doutv, int ca, int cb, i64 S, int cl, int acc_a,
                        int acc_b) {
    const T* dout = (const T*)doutv;
    Row r = row_geom(ca + cb, S, V, cl);
    CatSrc s = cat_src(r, ca, cb);
    T* dst = s.from_b ? (T*)dbv : (T*)dav;
    int acc = s.from_b ? acc_b : acc_a;
    i64 u = r.start / r.lanes, ustep = r.step / r.lanes;
    for (i64 v = r.start; v < r.nvec; v += r.step, u += ustep) {
        float g[V], o[V];
        ldv<V>(dout, r.base + v * V, g);
        i64 j0 = cat_index(r, s, u, V, S, cl);
        if (acc) {
            ldv<V>(dst, j0, o);
#pragma unroll
            for (int j = 0; j < V; j++) g[j] += o[j];
        }
        stv<V>(dst, j0, g);
    }
}
extern "C" __global__ void split_channels(void* da, void* db, const void* dout, int ca, int cb, i64 S, int cl,
                                          int acc_a, int acc_b, int bf, int V) {
    DISPATCH_V(bf, V, split_t, da, db, dout, ca, cb, S, cl, acc_a, acc_b);
}
// Zero-padding along N and C for the conv channel padding (conv3d.rs): dst (Np, Cp, S) gets
// src (N, C, S) with zeros where n >= N or c >= C. Conv weights (Cout, Cin, k³) use N = Cout.
// dt: bit 0 dst is bf16, bit 1 src is bf16 (the padding also converts).
template <typename TD, typename TS>
__device__ void pad_nc_t(void* dstv, const void* srcv, int N, int C, int Cp, i64 S, i64 total, int cl) {
    TD* dst = (TD*)dstv;
    const TS* src = (const TS*)srcv;
    GRID_STRIDE(i, total) {
        int c = chan_of(i, Cp, S, cl);
        i64 n = i / ((i64)Cp * S);
        i64 s = cl ? (i / Cp) % S : i % S;
        st(dst, i, (c < C && n < N) ? ld(src, cl ? (n * S + s) * C + c : (n * C + c) * S + s) : 0.0f);
    }
}

// The inverse for a padded conv output: dst (N, C, S) = src (N, Cp, S)[:, :C] (+ bias[c] if bias).
// dt as pad_nc.
template <typename TD, typename TS>
__device__ void unpad_c_bias_t(void* dstv, const void* srcv, const float* bias, int C, int Cp, i64 S, i64 total,
                               int cl) {
    TD* dst = (TD*)dstv;
    const TS* src = (const TS*)srcv;
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        i64 n = i / ((i64)C * S);
        i64 s = cl ? (i / C) % S : i % S;
        st(dst, i, ld(src, cl ? (n * S + s) * Cp + c : (n * Cp + c) * S + s) + (bias ? bias[c] : 0.0f));
    }
}

// dst = src (or dst += src with accum) converting between storage types; dt as pad_nc.
template <typename TD, typename TS>
__device__ void cast_t(void* dstv, const void* srcv, i64 n, int accum) {
    TD* dst = (TD*)dstv;
    const TS* src = (const TS*)srcv;
    GRID_STRIDE(i, n) st(dst, i, accum ? ld(dst, i) + ld(src, i) : ld(src, i));
}

// Two-type dispatch on dt (bit 0: first pointer bf16, bit 1: second pointer bf16).
#define DISPATCH2(dt, F, ...)                       \
    do {                                            \
        switch (dt & 3) {                           \
            case 0: F<float, float>(__VA_ARGS__); break; \
            case 1: F<bf16, float>(__VA_ARGS__); break;  \
            case 2: F<float, bf16>(__VA_ARGS__); break;  \
            default: F<bf16, bf16>(__VA_ARGS__); break;  \
        }                                           \
    } while (0)

extern "C" __global__ void pad_nc(void* dst, const void* src, int N, int C, int Cp, i64 S, i64 total, int cl, int dt) {
    DISPATCH2(dt, pad_nc_t, dst, src, N, C, Cp, S, total, cl);
}
extern "C" __global__ void unpad_c_bias(void* dst, const void* src, const float* bias, int C, int Cp, i64 S, i64 total,
                                        int cl, int dt) {
    DISPATCH2(dt, unpad_c_bias_t, dst, src, bias, C, Cp, S, total, cl);
}
extern "C" __global__ void cast_buf(void* dst, const void* src, i64 n, int dt, int accum) {
    DISPATCH2(dt, cast_t, dst, src, n, accum);
}

// dw[o * ld + c] += (sum over n < N of s[n * O + o]) * v[c], for o < O, c < K (f32): the part of a
// 1x1 conv's weight gradient that a per-channel offset v of its input contributes, s being dout's
// per-sample channel sums (conv3d::backward_filter_1x1_from_parts: the decoder's skip conv over
// cat([h + bias, skip]) with the GEMM reading h alone). One thread per (o, c).
extern "C" __global__ void rank1_add(float* dw, const float* s, const float* v, int N, int O, int K, int ld) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= O * K) return;
    int o = i / K, c = i % K;
    float t = 0.0f;
    for (int n = 0; n < N; n++) t += s[n * O + o];
    dw[(i64)o * ld + c] += t * v[c];
}
