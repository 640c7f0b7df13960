// conv3d.cu: the weight gradient of 3x3x3, stride-1, pad-1 convolutions with few output channels
// (Cout <= 4: the U-Net's last conv, 64 -> 1 whole-head, 64 -> 4 BraTS). cuDNN 9.19 falls back to a
// slow sm80 kernel for these (13.2 ms of a 185 ms whole-head TF32 training step on the H200,
// docs/analysis/h200-whole-head); the sum is a skinny reduction over every voxel, so it is done here
// in fp32, twin of the CPU reference's conv3d backward (src/cpu/conv3d.rs):
//   dW[co, ci, t] += sum over n and voxels v of dy[n, co, v] * x[n, ci, v + off(t)]  (0 outside),
//   off(t) = (kd - 1, kh - 1, kw - 1).
// Stage 1 (conv3d_wgrad_small<CO>): grid (chunks, channel groups, N), block 256. A block takes one
// chunk of voxels of one sample: NCDHW: one input channel, its 256 threads stride over the voxels
// (coalesced); NDHWC: up to 64 input channels, thread = (voxel row, channel) with the channel
// fastest (coalesced), 256 / 64 rows stride over the voxels. Each thread keeps CO*27 sums; the
// block adds its threads' sums per input channel and writes
//   part[((n * nchunks + chunk) * C + ci) * CO*27 + co*27 + t].
// Stage 2 (conv3d_wgrad_small_finalize): one block per weight sums the chunks in double and adds
// into dW in the layout's weight order (NCDHW: co, ci, kd, kh, kw; NDHWC: co, kd, kh, kw, ci).

template <int CO>
__device__ void conv3d_wgrad_small(const float* x, const float* dy, float* part, int C, int D, int H, int W,
                                   int chunk_len, int nchunks, int cl) {
    __shared__ float red[256];
    __shared__ float sh[32];
    const i64 S = (i64)D * H * W;
    const int n = blockIdx.z, chunk = blockIdx.x, t = threadIdx.x;
    const int cg = cl ? min(C, 64) : 1;  // channels per block
    const int rows = blockDim.x / cg;
    const int r = t / cg, ci = cl ? blockIdx.y * cg + t % cg : blockIdx.y;
    const bool live = r < rows && ci < C;
    float acc[CO][27];
#pragma unroll
    for (int co = 0; co < CO; co++)
#pragma unroll
        for (int k = 0; k < 27; k++) acc[co][k] = 0.0f;
    const i64 v0 = (i64)chunk * chunk_len, v1 = min(S, v0 + (i64)chunk_len);
    if (live) {
        for (i64 v = v0 + r; v < v1; v += rows) {
            const int w = (int)(v % W), h = (int)((v / W) % H), d = (int)(v / ((i64)W * H));
            float g[CO];
#pragma unroll
            for (int co = 0; co < CO; co++) g[co] = cl ? dy[((i64)n * S + v) * CO + co] : dy[((i64)n * CO + co) * S + v];
#pragma unroll
            for (int kd = 0; kd < 3; kd++) {
                const int dd = d + kd - 1;
                if (dd < 0 || dd >= D) continue;
#pragma unroll
                for (int kh = 0; kh < 3; kh++) {
                    const int hh = h + kh - 1;
                    if (hh < 0 || hh >= H) continue;
#pragma unroll
                    for (int kw = 0; kw < 3; kw++) {
                        const int ww = w + kw - 1;
                        if (ww < 0 || ww >= W) continue;
                        const i64 u = ((i64)dd * H + hh) * W + ww;
                        const float xv = cl ? x[((i64)n * S + u) * C + ci] : x[((i64)n * C + ci) * S + u];
#pragma unroll
                        for (int co = 0; co < CO; co++) acc[co][(kd * 3 + kh) * 3 + kw] += g[co] * xv;
                    }
                }
            }
        }
    }
    // block sums per input channel
    const i64 base = (((i64)n * nchunks + chunk) * C + ci) * (CO * 27);
#pragma unroll
    for (int co = 0; co < CO; co++) {
#pragma unroll
        for (int k = 0; k < 27; k++) {
            float s = live ? acc[co][k] : 0.0f;
            if (cl) {
                red[t] = s;
                __syncthreads();
                if (r == 0 && ci < C) {
                    float tot = 0.0f;
                    for (int rr = 0; rr < rows; rr++) tot += red[rr * cg + t];
                    part[base + co * 27 + k] = tot;
                }
                __syncthreads();
            } else {
                s = block_sum(s, sh);
                if (t == 0) part[base + co * 27 + k] = s;
            }
        }
    }
}

extern "C" __global__ void conv3d_wgrad_small1(const float* x, const float* dy, float* part, int C, int D, int H,
                                               int W, int chunk_len, int nchunks, int cl) {
    conv3d_wgrad_small<1>(x, dy, part, C, D, H, W, chunk_len, nchunks, cl);
}
extern "C" __global__ void conv3d_wgrad_small2(const float* x, const float* dy, float* part, int C, int D, int H,
                                               int W, int chunk_len, int nchunks, int cl) {
    conv3d_wgrad_small<2>(x, dy, part, C, D, H, W, chunk_len, nchunks, cl);
}
extern "C" __global__ void conv3d_wgrad_small3(const float* x, const float* dy, float* part, int C, int D, int H,
                                               int W, int chunk_len, int nchunks, int cl) {
    conv3d_wgrad_small<3>(x, dy, part, C, D, H, W, chunk_len, nchunks, cl);
}
extern "C" __global__ void conv3d_wgrad_small4(const float* x, const float* dy, float* part, int C, int D, int H,
                                               int W, int chunk_len, int nchunks, int cl) {
    conv3d_wgrad_small<4>(x, dy, part, C, D, H, W, chunk_len, nchunks, cl);
}

// grid CO*C*27 (one block per weight, index j = (co*C + ci)*27 + t), block 256.
extern "C" __global__ void conv3d_wgrad_small_finalize(const float* part, float* dw, int N, int C, int CO,
                                                       int nchunks, int cl) {
    __shared__ double sh[32];
    const int j = blockIdx.x;
    const int t = j % 27, ci = (j / 27) % C, co = j / (27 * C);
    double s = 0.0;
    for (int k = threadIdx.x; k < N * nchunks; k += blockDim.x)
        s += (double)part[((i64)k * C + ci) * (CO * 27) + co * 27 + t];
    s = block_sum_d(s, sh);
    if (threadIdx.x == 0) {
        const i64 o = cl ? ((i64)co * 27 + t) * C + ci : ((i64)co * C + ci) * 27 + t;
        dw[o] += (float)s;
    }
}
