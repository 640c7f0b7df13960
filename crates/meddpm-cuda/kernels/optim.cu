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
