// loss.cu: mean L1 / L2 loss of pred against target (kind 0 = L1, 1 = L2) and its gradient.
// Forward: loss_partial (one float per block) then loss_final (one block, double).

extern "C" __global__ void loss_partial(const float* pred, const float* target, float* part, i64 n, int kind) {
    __shared__ float sh[32];
    float s = 0.0f;
    GRID_STRIDE(i, n) {
        float d = pred[i] - target[i];
        s += kind == 0 ? fabsf(d) : d * d;
    }
    s = block_sum(s, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

extern "C" __global__ void loss_final(const float* part, int nparts, float* loss, double inv_n) {
    __shared__ double sh[32];
    double s = 0.0;
    for (int j = threadIdx.x; j < nparts; j += blockDim.x) s += (double)part[j];
    s = block_sum_d(s, sh);
    if (threadIdx.x == 0) loss[0] = (float)(s * inv_n);
}

// dpred = scale/n * sign(pred - target) (L1, sign(0) = 0) or scale/n * 2 (pred - target) (L2).
extern "C" __global__ void loss_bwd(float* dpred, const float* pred, const float* target, i64 n, int kind, float k) {
    GRID_STRIDE(i, n) {
        float d = pred[i] - target[i];
        float g = kind == 0 ? (d > 0.0f ? 1.0f : (d < 0.0f ? -1.0f : 0.0f)) : 2.0f * d;
        dpred[i] = k * g;
    }
}
