// conv3d.cu: the weight gradient of 3x3x3, stride-1, pad-1 convolutions with few output channels
// (Cout <= 4: the U-Net's last conv, 64 -> 1 whole-head, 64 -> 4 BraTS). cuDNN 9.19 falls back to a
// slow sm80 kernel for these (13.2 ms of a 185 ms whole-head TF32 training step on the H200,
// docs/analysis/h200-whole-head); the sum is a skinny reduction over every voxel, so it is done here
// in fp32, twin of the CPU reference's conv3d backward (src/cpu/conv3d.rs):
//   dW[co, ci, t] += sum over n and voxels v of dy[n, co, v] * x[n, ci, v + off(t)]  (0 outside),
//   off(t) = (kd - 1, kh - 1, kw - 1).
// Stage 1 (conv3d_wgrad_small<CO>): grid (chunks, channel groups), block 256. The volume is cut
// into lines (n, d, h) of W voxels; a block takes `lines_per_block` consecutive lines. NCDHW: one
// input channel per block, thread = line; NDHWC: up to 64 input channels, thread = (line slot,
// channel) with the channel fastest (coalesced), 256 / 64 line slots. A thread walks its lines
// along w keeping, for the 9 neighbour lines (kd, kh), the inputs at w - 1 and w in registers, so
// each voxel costs 9 loads and 27 * CO FMAs; it holds CO*27 sums. The block adds its threads'
// sums per input channel and writes part[(chunk * C + ci) * CO*27 + co*27 + t].
// (First version, one thread per voxel with 27 bounds-checked loads and 64-bit index divisions:
// 6.4 ms for the whole-head 64 -> 1 conv on the H200.)

// x and dy may each be f32 or bf16 (TX, TY); the sums are f32.
template <typename TX, typename TY, int CO>
__device__ void conv3d_wgrad_small(const void* xv, const void* dyv, float* part, int N, int C, int D, int H, int W,
                                   int lines_per_block, int cl) {
    const TX* x = (const TX*)xv;
    const TY* dy = (const TY*)dyv;
    __shared__ float red[256];
    __shared__ float sh[32];
    const i64 S = (i64)D * H * W;
    const int chunk = blockIdx.x, t = threadIdx.x;
    const int cg = cl ? min(C, 64) : 1;  // channels per block
    const int rows = blockDim.x / cg;     // line slots
    const int r = t / cg, ci = cl ? blockIdx.y * cg + t % cg : blockIdx.y;
    const bool live = r < rows && ci < C;
    float acc[CO][27];
#pragma unroll
    for (int co = 0; co < CO; co++)
#pragma unroll
        for (int k = 0; k < 27; k++) acc[co][k] = 0.0f;
    const int nlines = N * D * H;
    const int l0 = chunk * lines_per_block, l1 = min(nlines, l0 + lines_per_block);
    const i64 xstep = cl ? C : 1;     // x: next w
    const i64 gstep = cl ? CO : 1;    // dy: next w
    const i64 gcs = cl ? 1 : S;       // dy: next output channel
    if (live) {
        for (int l = l0 + r; l < l1; l += rows) {
            const int n = l / (D * H), dh = l % (D * H), d = dh / H, h = dh % H;
            i64 nb[9];
#pragma unroll
            for (int j = 0; j < 9; j++) {
                const int dd = d + j / 3 - 1, hh = h + j % 3 - 1;
                const i64 line = ((i64)dd * H + hh) * W;
                nb[j] = (dd < 0 || dd >= D || hh < 0 || hh >= H) ? -1
                        : (cl ? ((i64)n * S + line) * C + ci : ((i64)n * C + ci) * S + line);
            }
            const i64 gb = cl ? ((i64)n * S + ((i64)d * H + h) * W) * CO : (i64)n * CO * S + ((i64)d * H + h) * W;
            float xm[9], xc[9];
#pragma unroll
            for (int j = 0; j < 9; j++) {
                xm[j] = 0.0f;
                xc[j] = nb[j] >= 0 ? ld(x, nb[j]) : 0.0f;
            }
            for (int w = 0; w < W; w++) {
                float g[CO];
#pragma unroll
                for (int co = 0; co < CO; co++) g[co] = ld(dy, gb + w * gstep + co * gcs);
#pragma unroll
                for (int j = 0; j < 9; j++) {
                    const float xn = (nb[j] >= 0 && w + 1 < W) ? ld(x, nb[j] + (w + 1) * xstep) : 0.0f;
#pragma unroll
                    for (int co = 0; co < CO; co++) {
                        acc[co][j * 3 + 0] += g[co] * xm[j];
                        acc[co][j * 3 + 1] += g[co] * xc[j];
                        acc[co][j * 3 + 2] += g[co] * xn;
                    }
                    xm[j] = xc[j];
                    xc[j] = xn;
                }
            }
        }
    }
    // block sums per input channel
    const i64 base = ((i64)chunk * C + ci) * (CO * 27);
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

// x and dy are both f32 or both bf16 (`bf`). bf16 is instantiated for CO = 1 and 4 only (the
// whole-head and BraTS output convs; see small_cout_wgrad in conv3d.rs): each instantiation costs
// seconds of NVRTC time at start-up.
#define WGRAD_SMALL(CO, BF16)                                                                                     \
    extern "C" __global__ void conv3d_wgrad_small##CO(const void* x, const void* dy, float* part, int N, int C,  \
                                                      int D, int H, int W, int lines_per_block, int cl, int bf) { \
        if (BF16 && bf)                                                                                          \
            conv3d_wgrad_small<bf16, bf16, CO>(x, dy, part, N, C, D, H, W, lines_per_block, cl);                 \
        else                                                                                                     \
            conv3d_wgrad_small<float, float, CO>(x, dy, part, N, C, D, H, W, lines_per_block, cl);               \
    }
WGRAD_SMALL(1, 1)
WGRAD_SMALL(2, 0)
WGRAD_SMALL(3, 0)
WGRAD_SMALL(4, 1)

// Stage 2: grid CO*C*27 (one block per weight, index j = (co*C + ci)*27 + t), block 256.
extern "C" __global__ void conv3d_wgrad_small_finalize(const float* part, float* dw, int C, int CO, int nchunks,
                                                       int cl) {
    __shared__ double sh[32];
    const int j = blockIdx.x;
    const int t = j % 27, ci = (j / 27) % C, co = j / (27 * C);
    double s = 0.0;
    for (int k = threadIdx.x; k < nchunks; k += blockDim.x)
        s += (double)part[((i64)k * C + ci) * (CO * 27) + co * 27 + t];
    s = block_sum_d(s, sh);
    if (threadIdx.x == 0) {
        const i64 o = cl ? ((i64)co * 27 + t) * C + ci : ((i64)co * C + ci) * 27 + t;
        dw[o] += (float)s;
    }
}
