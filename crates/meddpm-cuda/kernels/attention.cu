// attention.cu: the row softmax of QKVAttentionLegacy (fp32, over keys) and its backward; the
// GEMMs around it are cuBLAS strided-batched calls (src/attention.rs). One block per row of T.

// att[row, :] = softmax(att[row, :]) in place.
extern "C" __global__ void softmax_rows(float* att, int T) {
    __shared__ float sh[32];
    float* r = att + (i64)blockIdx.x * T;
    float m = -3.402823466e38f;
    for (int j = threadIdx.x; j < T; j += blockDim.x) m = fmaxf(m, r[j]);
    m = block_max(m, sh);
    float s = 0.0f;
    for (int j = threadIdx.x; j < T; j += blockDim.x) {
        float e = expf(r[j] - m);
        r[j] = e;
        s += e;
    }
    s = block_sum(s, sh);
    float inv = 1.0f / s;
    for (int j = threadIdx.x; j < T; j += blockDim.x) r[j] *= inv;
}

// datt[row, :] = att * (datt - sum_j att_j * datt_j) in place (softmax backward).
extern "C" __global__ void softmax_bwd_rows(float* datt, const float* att, int T) {
    __shared__ float sh[32];
    float* d = datt + (i64)blockIdx.x * T;
    const float* a = att + (i64)blockIdx.x * T;
    float dot = 0.0f;
    for (int j = threadIdx.x; j < T; j += blockDim.x) dot += a[j] * d[j];
    dot = block_sum(dot, sh);
    for (int j = threadIdx.x; j < T; j += blockDim.x) d[j] = a[j] * (d[j] - dot);
}
