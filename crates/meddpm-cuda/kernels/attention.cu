// attention.cu: the row softmax of QKVAttentionLegacy (over keys) and its backward; the GEMMs
// around it are cuBLAS strided-batched calls (src/attention.rs). One block per row of T.
// Storage is f32 or bf16 (`bf`), arithmetic f32 (a bf16 row is stored rounded once, as PyTorch
// autocast's softmax(x.float()).type(bf16)).
// - softmax_rows4 / softmax_bwd_rows4 (T % 4 == 0, T ≤ 4·SM_R·blockDim): each thread keeps its
//   SM_R four-element vectors of the row in registers, so a row is read once and written once
//   with 8-byte (bf16) or 16-byte (f32) accesses;
// - softmax_rows / softmax_bwd_rows (any T): with `cache` (the host passes T·4 bytes of dynamic
//   shared memory) the row is read once; without it (rows too long for shared memory) it is read
//   again per pass, with the same results.

// att[row, :] = softmax(att[row, :]) in place.
template <typename T>
__device__ void softmax_rows_t(void* attv, int Tn, int cache) {
    extern __shared__ float srow[];
    __shared__ float sh[32];
    T* r = (T*)attv + (i64)blockIdx.x * Tn;
    float m = -3.402823466e38f;
    for (int j = threadIdx.x; j < Tn; j += blockDim.x) {
        float v = ld(r, j);
        if (cache) srow[j] = v;
        m = fmaxf(m, v);
    }
    m = block_max(m, sh);
    float s = 0.0f;
    for (int j = threadIdx.x; j < Tn; j += blockDim.x) {
        float e = expf((cache ? srow[j] : ld(r, j)) - m);
        if (cache) srow[j] = e;
        s += e;
    }
    s = block_sum(s, sh);
    float inv = 1.0f / s;
    // without the cache the exponential is taken again (the same f32 value): one rounding per store
    for (int j = threadIdx.x; j < Tn; j += blockDim.x) st(r, j, (cache ? srow[j] : expf(ld(r, j) - m)) * inv);
}

extern "C" __global__ void softmax_rows(void* att, int T, int bf, int cache) {
    DISPATCH(bf, softmax_rows_t, att, T, cache);
}

// datt[row, :] = att * (datt - sum_j att_j * datt_j) in place (softmax backward). With `cache`
// the host passes T·4 bytes of shared memory (datt's row; att is read twice).
template <typename T>
__device__ void softmax_bwd_rows_t(void* dattv, const void* attv, int Tn, int cache) {
    extern __shared__ float srow[];
    __shared__ float sh[32];
    T* d = (T*)dattv + (i64)blockIdx.x * Tn;
    const T* a = (const T*)attv + (i64)blockIdx.x * Tn;
    float dot = 0.0f;
    for (int j = threadIdx.x; j < Tn; j += blockDim.x) {
        float dv = ld(d, j);
        if (cache) srow[j] = dv;
        dot += ld(a, j) * dv;
    }
    dot = block_sum(dot, sh);
    for (int j = threadIdx.x; j < Tn; j += blockDim.x) st(d, j, ld(a, j) * ((cache ? srow[j] : ld(d, j)) - dot));
}

extern "C" __global__ void softmax_bwd_rows(void* datt, const void* att, int T, int bf, int cache) {
    DISPATCH(bf, softmax_bwd_rows_t, datt, att, T, cache);
}

#define SM_R 8

// softmax_rows for T % 4 == 0 and T / 4 ≤ SM_R · blockDim (the row in registers).
template <typename T>
__device__ void softmax_rows4_t(void* attv, int Tn) {
    __shared__ float sh[32];
    T* a = (T*)attv;
    int n4 = Tn / 4;
    i64 b4 = (i64)blockIdx.x * n4;
    float v[SM_R][4];
    float m = -3.402823466e38f;
#pragma unroll
    for (int k = 0; k < SM_R; k++) {
        int j = threadIdx.x + k * blockDim.x;
        if (j < n4) {
            ld4(a, b4 + j, v[k]);
            m = fmaxf(m, fmaxf(fmaxf(v[k][0], v[k][1]), fmaxf(v[k][2], v[k][3])));
        }
    }
    m = block_max(m, sh);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < SM_R; k++) {
        if (threadIdx.x + k * blockDim.x < n4) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                v[k][e] = expf(v[k][e] - m);
                s += v[k][e];
            }
        }
    }
    s = block_sum(s, sh);
    float inv = 1.0f / s;
#pragma unroll
    for (int k = 0; k < SM_R; k++) {
        int j = threadIdx.x + k * blockDim.x;
        if (j < n4) {
#pragma unroll
            for (int e = 0; e < 4; e++) v[k][e] *= inv;
            st4(a, b4 + j, v[k]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(512) softmax_rows4(void* att, int T, int bf) { DISPATCH(bf, softmax_rows4_t, att, T); }

// softmax_bwd_rows for T % 4 == 0 and T / 4 ≤ SM_R · blockDim (both rows in registers).
template <typename T>
__device__ void softmax_bwd_rows4_t(void* dattv, const void* attv, int Tn) {
    __shared__ float sh[32];
    T* d = (T*)dattv;
    const T* a = (const T*)attv;
    int n4 = Tn / 4;
    i64 b4 = (i64)blockIdx.x * n4;
    float dv[SM_R][4], av[SM_R][4];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < SM_R; k++) {
        int j = threadIdx.x + k * blockDim.x;
        if (j < n4) {
            ld4(d, b4 + j, dv[k]);
            ld4(a, b4 + j, av[k]);
#pragma unroll
            for (int e = 0; e < 4; e++) dot += av[k][e] * dv[k][e];
        }
    }
    dot = block_sum(dot, sh);
#pragma unroll
    for (int k = 0; k < SM_R; k++) {
        int j = threadIdx.x + k * blockDim.x;
        if (j < n4) {
#pragma unroll
            for (int e = 0; e < 4; e++) dv[k][e] = av[k][e] * (dv[k][e] - dot);
            st4(d, b4 + j, dv[k]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(512) softmax_bwd_rows4(void* datt, const void* att, int T, int bf) {
    DISPATCH(bf, softmax_bwd_rows4_t, datt, att, T);
}
