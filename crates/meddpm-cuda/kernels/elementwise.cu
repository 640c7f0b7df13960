// elementwise.cu: residual adds, scaling, per-channel broadcast adds, channel concat/split, the
// conv channel padding, and type conversion, for both layouts and both storage types.
// Semantics: crates/meddpm/src/backend.rs (add_assign, scale, add_channel_bias, concat_channels,
// split_channels) and the conv/linear bias adds. Activation pointers are `void*` with a type flag
// (common.cu): `bf` when all of a kernel's activation pointers share one type, else a bit mask `dt`.

template <typename T>
__device__ void add_assign_t(void* dstv, const void* srcv, i64 n) {
    T* dst = (T*)dstv;
    const T* src = (const T*)srcv;
    GRID_STRIDE(i, n) st(dst, i, ld(dst, i) + ld(src, i));
}
extern "C" __global__ void add_assign(void* dst, const void* src, i64 n, int bf) {
    DISPATCH(bf, add_assign_t, dst, src, n);
}

template <typename T>
__device__ void scale_t(void* bufv, float s, i64 n) {
    T* buf = (T*)bufv;
    GRID_STRIDE(i, n) st(buf, i, ld(buf, i) * s);
}
extern "C" __global__ void scale_buf(void* buf, float s, i64 n, int bf) {
    DISPATCH(bf, scale_t, buf, s, n);
}

// x[n, c, s] += bias[per_n ? n*C + c : c] over an (N, C, S) activation in layout cl; bias is f32.
template <typename T>
__device__ void add_channel_bias_t(void* xv, const float* bias, int C, i64 S, i64 total, int cl, int per_n) {
    T* x = (T*)xv;
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        int j = per_n ? (int)(i / ((i64)C * S)) * C + c : c;
        st(x, i, ld(x, i) + bias[j]);
    }
}
extern "C" __global__ void add_channel_bias(void* x, const float* bias, int C, i64 S, i64 total, int cl, int per_n,
                                            int bf) {
    DISPATCH(bf, add_channel_bias_t, x, bias, C, S, total, cl, per_n);
}

// out (N, ca+cb, S) = cat(a (N, ca, S), b (N, cb, S)) along channels.
template <typename T>
__device__ void concat_t(void* outv, const void* av, const void* bv, int ca, int cb, i64 S, i64 total, int cl) {
    T* out = (T*)outv;
    const T *a = (const T*)av, *b = (const T*)bv;
    int C = ca + cb;
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        i64 n = i / ((i64)C * S);
        i64 s = cl ? (i / C) % S : i % S;
        out[i] = c < ca ? (cl ? a[(n * S + s) * ca + c] : a[(n * ca + c) * S + s])
                        : (cl ? b[(n * S + s) * cb + (c - ca)] : b[(n * cb + (c - ca)) * S + s]);
    }
}
extern "C" __global__ void concat_channels(void* out, const void* a, const void* b, int ca, int cb, i64 S, i64 total,
                                           int cl, int bf) {
    DISPATCH(bf, concat_t, out, a, b, ca, cb, S, total, cl);
}

// Backward of concat: da, db from dout, each overwritten or accumulated.
template <typename T>
__device__ void split_t(void* dav, void* dbv, const void* doutv, int ca, int cb, i64 S, i64 total, int cl, int acc_a,
                        int acc_b) {
    T *da = (T*)dav, *db = (T*)dbv;
    const T* dout = (const T*)doutv;
    int C = ca + cb;
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        i64 n = i / ((i64)C * S);
        i64 s = cl ? (i / C) % S : i % S;
        float v = ld(dout, i);
        if (c < ca) {
            i64 j = cl ? (n * S + s) * ca + c : (n * ca + c) * S + s;
            st(da, j, acc_a ? ld(da, j) + v : v);
        } else {
            i64 j = cl ? (n * S + s) * cb + (c - ca) : (n * cb + (c - ca)) * S + s;
            st(db, j, acc_b ? ld(db, j) + v : v);
        }
    }
}
extern "C" __global__ void split_channels(void* da, void* db, const void* dout, int ca, int cb, i64 S, i64 total,
                                          int cl, int acc_a, int acc_b, int bf) {
    DISPATCH(bf, split_t, da, db, dout, ca, cb, S, total, cl, acc_a, acc_b);
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
