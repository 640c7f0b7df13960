// optim.cu: torch.optim.Adam (no weight decay, no amsgrad) and the EMA update, elementwise.
// step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t) are computed on the host in double,
// as PyTorch does in Python floats.

extern "C" __global__ void adam_step(float* p, const float* g, float* m, float* v, float beta1, float beta2, float eps,
                                     float step_size, float bc2_sqrt, i64 n) {
    GRID_STRIDE(i, n) {
        float gi = g[i];
        float mi = m[i] + (1.0f - beta1) * (gi - m[i]);  // exp_avg.lerp_(grad, 1 - beta1)
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] -= step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    }
}

extern "C" __global__ void ema_update(float* ema, const float* p, float decay, i64 n) {
    GRID_STRIDE(i, n) ema[i] = decay * ema[i] + (1.0f - decay) * p[i];
}

// ---- multi-tensor versions: one launch over a table of tensors ------------------------------------
// Table entry: up to four pointers, the element count, and the first block of this tensor
// (block b belongs to the last entry with b0 <= b; each block covers MT_CHUNK elements).
struct MTensor {
    u64 p[4];
    i64 n;
    i64 b0;
};
#define MT_CHUNK 4096

__device__ __forceinline__ int mt_find(const MTensor* t, int nt) {
    int lo = 0, hi = nt - 1;
    long long b = blockIdx.x;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (t[mid].b0 <= b)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

// Adam on every tensor (p, g, m, v) of the table; the same arithmetic as adam_step. With zero_g the
// gradient is set to 0 after use (no separate memset pass).
extern "C" __global__ void adam_multi(const MTensor* t, int nt, float beta1, float beta2, float eps, float step_size,
                                      float bc2_sqrt, int zero_g) {
    const MTensor& e = t[mt_find(t, nt)];
    float *p = (float*)e.p[0], *g = (float*)e.p[1], *m = (float*)e.p[2], *v = (float*)e.p[3];
    i64 i0 = ((i64)blockIdx.x - e.b0) * MT_CHUNK, i1 = min(e.n, i0 + MT_CHUNK);
    for (i64 i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        float gi = g[i];
        float mi = m[i] + (1.0f - beta1) * (gi - m[i]);
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] -= step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
        if (zero_g) g[i] = 0.0f;
    }
}

// ema <- decay*ema + (1-decay)*p on every tensor (p[0] = ema, p[1] = p); decay 0 copies exactly.
extern "C" __global__ void ema_multi(const MTensor* t, int nt, float decay) {
    const MTensor& e = t[mt_find(t, nt)];
    float* ema = (float*)e.p[0];
    const float* p = (const float*)e.p[1];
    i64 i0 = ((i64)blockIdx.x - e.b0) * MT_CHUNK, i1 = min(e.n, i0 + MT_CHUNK);
    for (i64 i = i0 + threadIdx.x; i < i1; i += blockDim.x)
        ema[i] = decay == 0.0f ? p[i] : decay * ema[i] + (1.0f - decay) * p[i];
}

// dst <- src converted to dst's type on every tensor (p[0] = dst, p[1] = src; p[2] bit 0: dst is
// bf16, bit 1: src is bf16): the bf16 weight copies in one launch.
// out = a + b over f32 vectors, one table row (out, a, b, 0) per vector: a network's folded biases
// (Backend::add_bias_vectors_all), in one launch.
extern "C" __global__ void add_multi(const MTensor* t, int nt) {
    const MTensor& e = t[mt_find(t, nt)];
    i64 i0 = ((i64)blockIdx.x - e.b0) * MT_CHUNK, i1 = min(e.n, i0 + MT_CHUNK);
    const float *a = (const float*)e.p[1], *b = (const float*)e.p[2];
    for (i64 i = i0 + threadIdx.x; i < i1; i += blockDim.x) ((float*)e.p[0])[i] = a[i] + b[i];
}

extern "C" __global__ void cast_multi(const MTensor* t, int nt) {
    const MTensor& e = t[mt_find(t, nt)];
    int dt = (int)e.p[2];
    i64 i0 = ((i64)blockIdx.x - e.b0) * MT_CHUNK, i1 = min(e.n, i0 + MT_CHUNK);
    for (i64 i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        float x = (dt & 2) ? bf2f(((const bf16*)e.p[1])[i]) : ((const float*)e.p[1])[i];
        if (dt & 1)
            ((bf16*)e.p[0])[i] = f2bf(x);
        else
            ((float*)e.p[0])[i] = x;
    }
}
