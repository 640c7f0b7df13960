// silu.cu: SiLU x*sigmoid(x) forward and backward (torch.nn.SiLU), elementwise over the buffer.

extern "C" __global__ void silu_fwd(float* out, const float* x, i64 n) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        out[i] = v * sigmoid_f(v);
    }
}

extern "C" __global__ void silu_bwd(float* dx, const float* dout, const float* x, i64 n, int accum) {
    GRID_STRIDE(i, n) {
        float v = dout[i] * silu_grad(x[i]);
        dx[i] = accum ? dx[i] + v : v;
    }
}
