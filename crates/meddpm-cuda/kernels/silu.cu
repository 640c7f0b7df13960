// silu.cu: SiLU x*sigmoid(x) forward and backward (torch.nn.SiLU), elementwise over the buffer;
// all three buffers of a call share the storage type `bf` selects.

template <typename T>
__device__ void silu_fwd_t(void* outv, const void* xv, i64 n) {
    T* out = (T*)outv;
    const T* x = (const T*)xv;
    GRID_STRIDE(i, n) {
        float v = ld(x, i);
        st(out, i, v * sigmoid_f(v));
    }
}
extern "C" __global__ void silu_fwd(void* out, const void* x, i64 n, int bf) { DISPATCH(bf, silu_fwd_t, out, x, n); }

template <typename T>
__device__ void silu_bwd_t(void* dxv, const void* doutv, const void* xv, i64 n, int accum) {
    T* dx = (T*)dxv;
    const T *dout = (const T*)doutv, *x = (const T*)xv;
    GRID_STRIDE(i, n) {
        float v = ld(dout, i) * silu_grad(ld(x, i));
        st(dx, i, accum ? ld(dx, i) + v : v);
    }
}
extern "C" __global__ void silu_bwd(void* dx, const void* dout, const void* x, i64 n, int accum, int bf) {
    DISPATCH(bf, silu_bwd_t, dx, dout, x, n, accum);
}
