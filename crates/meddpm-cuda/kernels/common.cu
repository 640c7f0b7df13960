// common.cu: helpers shared by every meddpm NVRTC kernel (prepended to each source file).
//
// Conventions (binding for all kernels, see crates/meddpm/src/backend.rs):
// - Activations have a logical shape (N, C, D, H, W); S = D*H*W. `cl` selects the memory layout:
//   cl == 0: NCDHW, element (n, c, s) at (n*C + c)*S + s;  cl == 1: NDHWC, at (n*S + s)*C + c.
// - Flat indices are 64-bit (a 128^3 x 512 x 2 activation has more than 2^31 elements).
// - `accum` == 1 adds into the destination (Accum::Add), 0 overwrites it.
// No #include: NVRTC compiles these without the CUDA headers.

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

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
__device__ float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = (lane < nw) ? sh[lane] : -3.402823466e38f;
    return warp_max(v);
}
