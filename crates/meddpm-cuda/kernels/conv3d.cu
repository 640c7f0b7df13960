// conv3d.cu: direct 3x3x3, stride-1, pad-1 convolutions with few input or few output channels:
// the U-Net's first conv (Cin = 3 -> 64) and last (64 -> 1 whole-head, 64 -> 4 BraTS). cuDNN is slow
// on these (no tensor-core kernel fits 3 or 1 channels; layout conversions around the generic ones),
// while they are nearly memory-bound, so they are done here with f32 FMA arithmetic, twins of the
// CPU reference (src/cpu/conv3d.rs). They run wherever they apply (MEDDPM_SMALL_CONV=0 forbids
// them, =auto times them against cuDNN per shape; conv3d.rs). In bf16 the forward of Cin <= 8 and
// the data gradient of Cout <= 4 use the tensor cores instead (small_cin_mma_body, below).
//   off(t) = (kd - 1, kh - 1, kw - 1) for tap t = kd*9 + kh*3 + kw.
//
// ---- weight gradient of Cout <= 4 convs ----------------------------------------------------------
// cuDNN 9.19 falls back to a slow sm80 kernel for these (13.2 ms of a 185 ms whole-head TF32 training
// step on the H200, docs/analysis/h200-whole-head); the sum is a skinny reduction over every voxel:
//   dW[co, ci, t] += sum over n and voxels v of dy[n, co, v] * x[n, ci, v + off(t)]  (0 outside).
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
// LB: __launch_bounds__ of the instantiation. CO = 1 asks for 3 blocks of 256 per SM (at most 85
// registers): ncu showed it waiting on its loads at 2 blocks (98 registers, 25 % occupancy;
// docs/perf/h200-2026-12-01c/ncu-small-convs). Larger CO keep their 27 * CO sums unspilled.
#define WGRAD_SMALL(CO, BF16, LB)                                                                                 \
    extern "C" __global__ void LB conv3d_wgrad_small##CO(const void* x, const void* dy, float* part, int N, int C, \
                                                      int D, int H, int W, int lines_per_block, int cl, int bf) { \
        if (BF16 && bf)                                                                                          \
            conv3d_wgrad_small<bf16, bf16, CO>(x, dy, part, N, C, D, H, W, lines_per_block, cl);                 \
        else                                                                                                     \
            conv3d_wgrad_small<float, float, CO>(x, dy, part, N, C, D, H, W, lines_per_block, cl);               \
    }
WGRAD_SMALL(1, 1, __launch_bounds__(256, 3))
WGRAD_SMALL(2, 0, )
WGRAD_SMALL(3, 0, )
WGRAD_SMALL(4, 1, )

// -- conv3d_wgrad_small{1,4}_mma: stage 1 of the Cout = 1 and 4 weight gradients on the tensor cores
// (bf16, NDHWC, C a multiple of 16: the whole-head output conv 64 -> 1 and BraTS' 64 -> 4). The
// tap shift moves from x to dy:  dW[co, ci, t] = sum over voxels u of dy[co, u - off(t)] * x[ci, u],
// for each co an M x N x K GEMM with M = the 27 taps (padded to 32, two m16 tiles), N = the input
// channels, K = the voxels, on mma.m16n8k16 (bf16 operands, f32 sums). A block takes 1 x 8 x 32
// voxel tiles (persistent, grid-stride) of NT 8-channel chunks of x (blockIdx.y picks which: NT = 8
// for Cout = 1, NT = 2 for Cout = 4 so that its 4 x 2 x NT x 4 sums a thread fit two blocks an SM):
// x's tile in shared memory, 16-byte chunks swizzled by the voxel (the 8 rows an ldmatrix reads fall
// in distinct banks), read as B fragments by ldmatrix.x4.trans, each B fragment used for every co;
// dy's 3 x 10 x 34 halo per co as pairs along w (ps[co][i] = dy[i], dy[i + 1]), so an A register
// (two consecutive voxels of one tap) is one 32-bit load at any shift. Warp i takes row h0 + i (two
// k16 steps). Warp i of block b writes its sums to part[((b * 8 + i) * C + ci) * CO*27 + co*27 + t]
// (conv3d_wgrad_small_finalize's layout, a chunk per warp). The FMA kernel above needed 10 loads per
// 27 FMAs and waited on them (Cout = 1: 1.38 ms at 128^3, docs/perf/h200-2026-12-01c/ncu-small-convs;
// Cout = 4: 10.8 ms of a 194 ms BraTS training step, docs/perf/h200-2026-12-01l).
// (pack_bf2 and mma_bf16_16816, the bf16 helpers of the tensor-core kernels, are in common.cu.)
#define WG_TH 8
#define WG_TW 32
#define WG_HALO (3 * (WG_TH + 2) * (WG_TW + 2))
__device__ __forceinline__ void ldsm_x4_trans(u32* r, const void* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// slot of 16-byte chunk ch of voxel row vi in a tile of NT chunks a row: the 8 consecutive rows an
// ldmatrix reads (8 / NT rows per 128 bytes) land on distinct 16-byte bank groups
template <int NT>
__device__ __forceinline__ int wg_slot(int vi, int ch) {
    return vi * NT + (ch ^ ((vi / (8 / NT)) & (NT - 1)));
}
template <int CO, int NT>
__device__ __forceinline__ void wgrad_small_mma(const bf16* x, const bf16* dy, float* part, int N, int C, int D,
                                                int H, int W) {
    __shared__ __align__(16) uint4 xs[WG_TH * WG_TW * NT];
    __shared__ u32 ps[CO * WG_HALO];
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
    const int cb0 = blockIdx.y * NT * 8;              // this block's first input channel
    const int nch = min(NT, (C - cb0) / 8);           // its 16-byte chunks a voxel (even: C % 16 == 0)
    const int hb = (H + WG_TH - 1) / WG_TH, wb = (W + WG_TW - 1) / WG_TW;
    const i64 ntiles = (i64)N * D * hb * wb;
    float acc[CO][2][NT][4];
#pragma unroll
    for (int co = 0; co < CO; co++)
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[co][mt][nt][e] = 0.0f;
    // this thread's A rows (taps) and their dy-halo offsets (a = 2 - kd, b = wi + 2 - kh, c = 2 - kw + voxel)
    int aoff[2][2];
    bool alive[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const int t = mt * 16 + g + 8 * hr;
            alive[mt][hr] = t < 27;
            const int kd = t / 9, kh = (t / 3) % 3, kw = t % 3;
            aoff[mt][hr] = alive[mt][hr] ? ((2 - kd) * (WG_TH + 2) + wi + 2 - kh) * (WG_TW + 2) + 2 - kw : 0;
        }
    for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const int w0 = (int)(tile % wb) * WG_TW;
        const int h0 = (int)((tile / wb) % hb) * WG_TH;
        const int d = (int)((tile / ((i64)wb * hb)) % D);
        const int n = (int)(tile / ((i64)wb * hb * D));
        __syncthreads();  // the previous tile's reads are done
        for (int i = threadIdx.x; i < WG_TH * WG_TW * nch; i += blockDim.x) {
            const int vi = i / nch, ch = i - vi * nch;
            const int h = h0 + vi / WG_TW, w = w0 + vi % WG_TW;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (h < H && w < W) {
                const i64 o = ((((i64)n * D + d) * H + h) * W + w) * C + cb0 + ch * 8;
                v = *reinterpret_cast<const uint4*>(x + o);
            }
            xs[wg_slot<NT>(vi, ch)] = v;
        }
        // the halo voxel by voxel; CO = 4: one 8-byte load gives a voxel's four channels, split
        // into the four pair planes (byte permutes) — a load and index computation per channel
        // made the first version 2.6 ms at BraTS' 144 x 192 x 192
        for (int k = threadIdx.x; k < WG_HALO; k += blockDim.x) {
            const int c = k % (WG_TW + 2), r = (k / (WG_TW + 2)) % (WG_TH + 2), a = k / ((WG_TW + 2) * (WG_TH + 2));
            const int dd = d + a - 1, hh = h0 + r - 1, ww = w0 + c - 1;
            const bool row = dd >= 0 && dd < D && hh >= 0 && hh < H;
            const bool vlo = row && ww >= 0 && ww < W, vhi = row && ww + 1 < W && c + 1 < WG_TW + 2;
            const i64 v = (((i64)n * D + dd) * H + hh) * W + ww;
            if (CO == 4) {
                const uint2 q0 = vlo ? *reinterpret_cast<const uint2*>(dy + v * 4) : make_uint2(0u, 0u);
                const uint2 q1 = vhi ? *reinterpret_cast<const uint2*>(dy + (v + 1) * 4) : make_uint2(0u, 0u);
                ps[k] = __byte_perm(q0.x, q1.x, 0x5410);
                ps[WG_HALO + k] = __byte_perm(q0.x, q1.x, 0x7632);
                ps[2 * WG_HALO + k] = __byte_perm(q0.y, q1.y, 0x5410);
                ps[3 * WG_HALO + k] = __byte_perm(q0.y, q1.y, 0x7632);
            } else {
#pragma unroll
                for (int co = 0; co < CO; co++) {
                    const u32 lo = vlo ? (u32)dy[v * CO + co].b : 0u;
                    const u32 hi = vhi ? (u32)dy[(v + 1) * CO + co].b : 0u;
                    ps[co * WG_HALO + k] = lo | (hi << 16);
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
            const int j = ks * 16 + tig * 2;  // this thread's first voxel (k) of the step, along w
            u32 a[CO][2][4];
#pragma unroll
            for (int co = 0; co < CO; co++)
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    const u32* pc = ps + co * WG_HALO;
                    a[co][mt][0] = alive[mt][0] ? pc[aoff[mt][0] + j] : 0u;
                    a[co][mt][1] = alive[mt][1] ? pc[aoff[mt][1] + j] : 0u;
                    a[co][mt][2] = alive[mt][0] ? pc[aoff[mt][0] + j + 8] : 0u;
                    a[co][mt][3] = alive[mt][1] ? pc[aoff[mt][1] + j + 8] : 0u;
                }
#pragma unroll
            for (int p = 0; p < NT / 2; p++) {
                if (2 * p >= nch) break;
                // matrices: (k 0-7, chunk 2p), (k 8-15, chunk 2p), (k 0-7, chunk 2p+1), (k 8-15, chunk 2p+1)
                const int mi = lane >> 3;
                const int vi = wi * WG_TW + ks * 16 + (mi & 1) * 8 + (lane & 7);
                const int ch = 2 * p + (mi >> 1);
                u32 b[4];
                ldsm_x4_trans(b, &xs[wg_slot<NT>(vi, ch)]);
#pragma unroll
                for (int co = 0; co < CO; co++)
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        mma_bf16_16816(acc[co][mt][2 * p], a[co][mt], b[0], b[1]);
                        mma_bf16_16816(acc[co][mt][2 * p + 1], a[co][mt], b[2], b[3]);
                    }
            }
        }
    }
    // c0, c1: row (tap) g, columns (channels) tig*2 + {0, 1}; c2, c3: row g + 8
#pragma unroll
    for (int co = 0; co < CO; co++)
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const int t = mt * 16 + g + 8 * hr;
                if (t >= 27) continue;
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    if (nt >= nch) break;
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int ci = cb0 + nt * 8 + tig * 2 + e;
                        part[(((i64)blockIdx.x * 8 + wi) * C + ci) * (CO * 27) + co * 27 + t] =
                            acc[co][mt][nt][2 * hr + e];
                    }
                }
            }
}
extern "C" __global__ void __launch_bounds__(256, 2)
    conv3d_wgrad_small1_mma(const bf16* x, const bf16* dy, float* part, int N, int C, int D, int H, int W) {
    wgrad_small_mma<1, 8>(x, dy, part, N, C, D, H, W);
}
extern "C" __global__ void __launch_bounds__(256, 2)
    conv3d_wgrad_small4_mma(const bf16* x, const bf16* dy, float* part, int N, int C, int D, int H, int W) {
    wgrad_small_mma<4, 2>(x, dy, part, N, C, D, H, W);
}

// -- conv3d_wgrad_small_cin_mma: stage 1 of the weight gradient of a conv with Cin <= 8 (the U-Net's
// first conv: 3 -> 64 whole-head, 8 -> 64 BraTS) on the tensor cores (bf16, NDHWC, Cout 16, 32 or
// 64). cuDNN pads the input to 8 channels and runs an sm80 kernel (0.43 ms whole-head,
// 1.39 ms BraTS on the H200, docs/perf/h200-2026-12-01l/prof-before). Per tap t an M x N x K GEMM:
//   dW[co, ci, t] = sum over voxels u of dy[co, u] * x[ci, u + off(t)]   (x = 0 outside)
// with M = the output channels (m16 tiles), N = the 8 (padded) input channels, K = the voxels, on
// mma.m16n8k16. A block takes 1 x 8 x 32 voxel tiles (persistent, grid-stride) and loads each once:
// dy's tile as rows of CO channels (16-byte chunks swizzled by the voxel so the 8 rows an ldmatrix
// reads hit distinct banks), read as A fragments by ldmatrix.x4.trans; x's 3 x 10 x 34 halo as one
// 16-byte row of 8 channels a voxel, so the B fragment of any tap is ldmatrix.trans of 8 consecutive
// halo rows (contiguous: no conflicts). Warp w owns output-channel tiles 2 (w / 3) and 2 (w / 3) + 1
// and tap plane kd = w % 3 over all 16 k-steps of the tile: 2 x 9 n8 tiles of sums, each B fragment
// used for both m-tiles. Every (co, t) has one owner warp, so the block writes its sums straight to
// part[(blockIdx.x * C + ci) * CO*27 + co*27 + t] (conv3d_wgrad_small_finalize's layout, a chunk per
// block). Two earlier layouts (a block per 16 output channels: all 27 taps a warp, 217 registers;
// or 9 taps and a block per tap plane, which read dy three times) took 2.64 and 2.06 ms at BraTS'
// size, slower than cuDNN.
#define WC_HALO (3 * (WG_TH + 2) * (WG_TW + 2))
extern "C" __global__ void __launch_bounds__(192, 2)
    conv3d_wgrad_small_cin_mma(const bf16* x, const bf16* dy, float* part, int N, int C, int CO, int D, int H,
                               int W) {
    __shared__ __align__(16) uint4 ys[WG_TH * WG_TW * 8];
    __shared__ __align__(16) uint4 xh[WC_HALO];
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
    const int nch = CO / 8;                      // dy's 16-byte chunks a voxel: 2, 4 or 8
    const int rpb = 8 / nch;                     // voxel rows per 128 bytes of ys
    const int m0 = 2 * (wi / 3), kd = wi % 3;    // this warp's first m-tile and its tap plane
    const bool two = m0 + 1 < CO / 16;           // whether it has a second m-tile
    const bool live = m0 < CO / 16;
    const int hb = (H + WG_TH - 1) / WG_TH, wb = (W + WG_TW - 1) / WG_TW;
    const i64 ntiles = (i64)N * D * hb * wb;
    float acc[2][9][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int t = 0; t < 9; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[m][t][e] = 0.0f;
    for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const int w0 = (int)(tile % wb) * WG_TW;
        const int h0 = (int)((tile / wb) % hb) * WG_TH;
        const int d = (int)((tile / ((i64)wb * hb)) % D);
        const int n = (int)(tile / ((i64)wb * hb * D));
        __syncthreads();  // the previous tile's reads are done
        for (int i = threadIdx.x; i < WG_TH * WG_TW * nch; i += blockDim.x) {
            const int vi = i / nch, ch = i - vi * nch;
            const int h = h0 + vi / WG_TW, w = w0 + vi % WG_TW;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (h < H && w < W)
                v = *reinterpret_cast<const uint4*>(dy + ((((i64)n * D + d) * H + h) * W + w) * CO + ch * 8);
            ys[vi * nch + (ch ^ ((vi / rpb) & (nch - 1)))] = v;
        }
        for (int k = threadIdx.x; k < WC_HALO; k += blockDim.x) {
            const int c = k % (WG_TW + 2), r = (k / (WG_TW + 2)) % (WG_TH + 2), a = k / ((WG_TW + 2) * (WG_TH + 2));
            const int dd = d + a - 1, hh = h0 + r - 1, ww = w0 + c - 1;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (dd >= 0 && dd < D && hh >= 0 && hh < H && ww >= 0 && ww < W) {
                const i64 o = ((((i64)n * D + dd) * H + hh) * W + ww) * C;
                if (C == 8) {
                    v = *reinterpret_cast<const uint4*>(x + o);
                } else {
                    u32 p[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                    for (int ci = 0; ci < 8; ci++)
                        if (ci < C) p[ci >> 1] |= (u32)x[o + ci].b << (16 * (ci & 1));
                    v = make_uint4(p[0], p[1], p[2], p[3]);
                }
            }
            xh[k] = v;
        }
        __syncthreads();
        if (!live) continue;
        const int mi = lane >> 3;
        for (int r = 0; r < WG_TH; r++) {
#pragma unroll
            for (int ks = 0; ks < 2; ks++) {
                // A of m-tile m: matrices (k 0-7, co 0-7), (k 0-7, co 8-15), (k 8-15, co 0-7), (k 8-15, co 8-15)
                const int vi = r * WG_TW + ks * 16 + (mi >> 1) * 8 + (lane & 7);
                u32 a[2][4];
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    const int ch = 2 * (m0 + (two ? m : 0)) + (mi & 1);
                    ldsm_x4_trans(a[m], &ys[vi * nch + (ch ^ ((vi / rpb) & (nch - 1)))]);
                }
                // B of taps t, t + 1 of plane kd: matrices (tap t, k 0-7), (t, k 8-15), (t + 1, k 0-7),
                // (t + 1, k 8-15); tap (kh, kw) of voxel (r, j) reads halo row (kd, r + kh, j + kw)
                const int j = ks * 16 + (mi & 1) * 8 + (lane & 7);
#pragma unroll
                for (int t = 0; t < 9; t += 2) {
                    const int tt = (t + (mi >> 1)) < 9 ? t + (mi >> 1) : 8;
                    const int kh = tt / 3, kw = tt % 3;
                    u32 b[4];
                    ldsm_x4_trans(b, &xh[(kd * (WG_TH + 2) + r + kh) * (WG_TW + 2) + j + kw]);
#pragma unroll
                    for (int m = 0; m < 2; m++) {
                        mma_bf16_16816(acc[m][t], a[m], b[0], b[1]);
                        if (t + 1 < 9) mma_bf16_16816(acc[m][t + 1], a[m], b[2], b[3]);
                    }
                }
            }
        }
    }
    // c0, c1: row (co) g, columns (ci) tig*2 + {0, 1}; c2, c3: row g + 8
    if (!live) return;
#pragma unroll
    for (int m = 0; m < 2; m++) {
        if (m == 1 && !two) break;
#pragma unroll
        for (int t = 0; t < 9; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int co = (m0 + m) * 16 + g + 8 * (e >> 1), ci = tig * 2 + (e & 1);
                if (ci < C) part[((i64)blockIdx.x * C + ci) * (CO * 27) + co * 27 + kd * 9 + t] = acc[m][t][e];
            }
    }
}

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

// ---- forward and data gradient of few-channel convs -----------------------------------------------
// Shared by both kernels below: a thread owns SC_V consecutive voxels (n, d, h, w0 .. w0 + SC_V - 1)
// of one line, a "voxel group" (groups enumerate (n, d, h, segment) with the segment fastest; the
// last segment of a line may be partial). For each of the 9 neighbour lines (kd, kh) it loads the
// SC_V + 2 inputs at w0 - 1 .. w0 + SC_V once and applies the 3 taps kw to them from registers.
// Weights live in shared memory as f32 (read from f32 or bf16, flag `wbf`); sums are f32 FMAs;
// outputs are f32 or bf16 (flag `ybf`), rounded once when stored, added to (accum) or overwritten.
#define SC_V 4    // voxels per thread
#define SC_COT 8  // output channels per thread of conv3d_small_cin
#define SC_CC 64  // input channels per shared-memory weight chunk of conv3d_fwd_small_cout*

// Decode voxel group g (segs segments per line): sample n, voxel index of its line start vline
// (n*S + (d*H + h)*W), d, h, first w.
struct VGroup {
    int n, d, h, w0;
    i64 vline;
};
__device__ __forceinline__ VGroup vgroup(i64 g, int segs, int D, int H, int W) {
    VGroup r;
    const i64 line = g / segs;
    r.w0 = (int)(g - line * segs) * SC_V;
    r.h = (int)(line % H);
    const i64 nd = line / H;
    r.d = (int)(nd % D);
    r.n = (int)(nd / D);
    r.vline = line * W;  // lines are (n, d, h) in order, W voxels each
    return r;
}

// This block's run of voxel groups [*g0, *g1): blocks take consecutive runs of whole block steps of
// `step` groups, so a block walks consecutive lines and the neighbour lines of its next step are
// mostly those of this one (cache hits).
__device__ __forceinline__ void block_run(i64 ngroups, int step, i64* g0, i64* g1) {
    const i64 steps = (ngroups + step - 1) / step;
    const i64 per = (steps + gridDim.x - 1) / gridDim.x * step;
    *g0 = (i64)blockIdx.x * per;
    *g1 = min(*g0 + per, ngroups);
}

// xr[p] = x[row + w0 - 1 + p] for p = 0 .. SC_V + 1 (0 outside 0 .. W-1), unit stride along w;
// 16-byte (f32) / 8-byte (bf16) loads for the middle SC_V when `vec` (W % SC_V == 0: aligned, whole).
template <typename T>
__device__ __forceinline__ void load_row(const T* x, i64 row, int w0, int W, bool vec, float* xr) {
    xr[0] = w0 > 0 ? ld(x, row + w0 - 1) : 0.0f;
    if (vec) {
        ldv<SC_V>(x, row + w0, xr + 1);
    } else {
#pragma unroll
        for (int p = 0; p < SC_V; p++) xr[p + 1] = w0 + p < W ? ld(x, row + w0 + p) : 0.0f;
    }
    xr[SC_V + 1] = w0 + SC_V < W ? ld(x, row + w0 + SC_V) : 0.0f;
}

// p[i + k] = v[k] (or += when accum) for k < n <= NMAX, of type T: NMAX / V vectors (ldv/stv) when
// `vec` (i % V == 0) and n == NMAX, else element by element. Every index into v is a compile-time
// constant, so v stays in registers.
template <typename T, int V, int NMAX>
__device__ __forceinline__ void put(T* p, i64 i, float* v, int n, bool vec, int accum) {
    if (vec && n == NMAX) {
#pragma unroll
        for (int k = 0; k < NMAX; k += V) {
            if (accum) {
                float o[V];
                ldv<V>(p, i + k, o);
#pragma unroll
                for (int e = 0; e < V; e++) v[k + e] += o[e];
            }
            stv<V>(p, i + k, v + k);
        }
    } else {
#pragma unroll
        for (int k = 0; k < NMAX; k++)
            if (k < n) st(p, i + k, accum ? ld(p, i + k) + v[k] : v[k]);
    }
}

// Weight element (co, ci, t) of a conv with CO outputs and CI inputs: (CO, CI, 27) NCDHW,
// (CO, 27, CI) NDHWC; f32 or bf16.
__device__ __forceinline__ float wat(const void* w, int wbf, int co, int ci, int t, int CO, int CI, int cl) {
    const i64 o = cl ? ((i64)co * 27 + t) * CI + ci : ((i64)co * CI + ci) * 27 + t;
    return wbf ? ld((const bf16*)w, o) : ld((const float*)w, o);
}

// -- small_cin_body (conv3d_fwd_small_cin, conv3d_dgrad_small_cout):
//   out[n, co, v] (= or +=) b[co] + sum over ci < CI, t of w'[co, ci, t] * x[n, ci, v + off(t)]
// with CI <= 4 and any CO. Block: (CO channel groups of SC_COT, up to 8) warps; warp = channel group
// (all lanes read the same weights: shared-memory broadcasts), lane = voxel group; grid (x: runs of
// steps of 32 voxel groups, `block_run`; y: blocks of 8 * SC_COT output channels). Per (neighbour
// line, ci) a thread reads 6 inputs and 6 16-byte weight vectors and does 3 * SC_V * SC_COT = 96 FMAs.
//   NDHWC with W % SC_V == 0 (the network's shapes): a block's 32 voxel groups are 128 consecutive
//   voxels, and so are their inputs on each neighbour line (shifted by a constant, plus one voxel each
//   side), CI channels each: the block stages those 9 x 130 x CI inputs in shared memory with
//   coalesced loads, channel-planar (xs[(j*CI + ci)*SC_TILE + 3 + k], k = 0 .. 129; the middle 4 of a
//   thread's 6 are one aligned float4). Read straight from memory instead, neighbouring lanes sit
//   4*CI elements apart and each warp load touches a dozen cache lines.
//   Otherwise (NCDHW: unit-stride rows, coalesced; odd W) inputs are read from memory.
// Rows outside the volume (d, h) are skipped; w outside the line is 0 (xr[0] at w0 = 0, xr[5] at the
// line's end), which also masks the staged voxels of neighbouring lines.
//   tw == 0: forward; w' = w, this conv's weights (CO, CI) as `wat` reads them.
//   tw == 1: data gradient of the conv with CI outputs and CO inputs (x = its output gradient, out =
//            its input gradient): w'[co, ci, t] = w[ci, co, 26 - t] (off(26 - t) = -off(t)).
// ws, xs: shared memory of SC_CIN_WS and SC_CIN_XS floats, declared by the kernel (the two type
// instantiations share them).
#define SC_TILE 136  // 3 + 130 staged voxels + 3, a multiple of 4
#define SC_CIN_WS (4 * 27 * 8 * SC_COT)
#define SC_CIN_XS (9 * 4 * SC_TILE)
template <typename TX>
__device__ __noinline__ void small_cin_body(float* ws, float* xs, const void* xv, const void* w, int wbf,
                                            const float* bias, void* y, int ybf, int N, int CI, int CO, int D,
                                            int H, int W, int cl, int accum, int tw) {
    const TX* x = (const TX*)xv;
    const int COB = (blockDim.x >> 5) * SC_COT;  // output channels of this block
    const int cob0 = blockIdx.y * COB;
    // ws[(ci*27 + t)*COB + j] = w'[cob0 + j, ci, t] (0 past CO)
    for (int i = threadIdx.x; i < CI * 27 * COB; i += blockDim.x) {
        const int j = i % COB, ct = i / COB, t = ct % 27, ci = ct / 27, co = cob0 + j;
        float v = 0.0f;
        if (co < CO) v = tw ? wat(w, wbf, ci, co, 26 - t, CI, CO, cl) : wat(w, wbf, co, ci, t, CO, CI, cl);
        ws[i] = v;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, cg = threadIdx.x >> 5;
    const int co0 = cob0 + cg * SC_COT;
    const int nco = max(0, min(SC_COT, CO - co0));  // 0: a warp past CO (it still helps staging)
    const int segs = (W + SC_V - 1) / SC_V;
    const i64 S = (i64)D * H * W;
    const i64 NS = (i64)N * S;
    const i64 ngroups = (i64)N * D * H * segs;
    const bool staged = cl && W % SC_V == 0;
    const bool xvec = W % SC_V == 0;  // NCDHW rows: aligned 4-voxel vectors
    // block-uniform loop (barriers inside when staged)
    i64 gbeg, gend;
    block_run(ngroups, 32, &gbeg, &gend);
    for (i64 gb = gbeg; gb < gend; gb += 32) {
        if (staged) {
            __syncthreads();  // the previous iteration's reads are done
            const i64 vs = gb * SC_V;  // first voxel of the block's groups
            const int row = 130 * CI;  // staged elements of one neighbour line, contiguous in memory
            for (int j = 0; j < 9; j++) {
                const i64 u0 = (vs - 1 + ((i64)(j / 3 - 1) * H + (j % 3 - 1)) * W) * CI;
                for (int r = threadIdx.x; r < row; r += blockDim.x) {
                    const int k = r / CI, ci = r - k * CI;
                    const i64 o = u0 + r;
                    xs[(j * CI + ci) * SC_TILE + 3 + k] = (o >= 0 && o < NS * CI) ? ld(x, o) : 0.0f;
                }
            }
            __syncthreads();
        }
        const i64 g = gb + lane;
        if (nco == 0 || g >= gend) continue;
        const VGroup q = vgroup(g, segs, D, H, W);
        float acc[SC_COT][SC_V];
#pragma unroll
        for (int o = 0; o < SC_COT; o++)
#pragma unroll
            for (int v = 0; v < SC_V; v++) acc[o][v] = 0.0f;
#pragma unroll 1
        for (int j = 0; j < 9; j++) {
            const int dd = q.d + j / 3 - 1, hh = q.h + j % 3 - 1;
            if (dd < 0 || dd >= D || hh < 0 || hh >= H) continue;
#pragma unroll 1
            for (int ci = 0; ci < CI; ci++) {
                float xr[SC_V + 2];
                if (staged) {
                    const float* xb = xs + (j * CI + ci) * SC_TILE + 4 * lane;
                    const float4 m = *reinterpret_cast<const float4*>(xb + 4);
                    xr[0] = q.w0 > 0 ? xb[3] : 0.0f;
                    xr[1] = m.x;
                    xr[2] = m.y;
                    xr[3] = m.z;
                    xr[4] = m.w;
                    xr[5] = q.w0 + SC_V < W ? xb[8] : 0.0f;
                } else if (cl) {
                    const i64 vrow = (i64)q.n * S + ((i64)dd * H + hh) * W;  // voxel index of (n, dd, hh, 0)
#pragma unroll
                    for (int p = 0; p < SC_V + 2; p++) {
                        const int ww = q.w0 - 1 + p;
                        xr[p] = (ww >= 0 && ww < W) ? ld(x, (vrow + ww) * CI + ci) : 0.0f;
                    }
                } else {
                    load_row(x, ((i64)q.n * CI + ci) * S + ((i64)dd * H + hh) * W, q.w0, W, xvec, xr);
                }
                const float* wp = ws + (ci * 27 + j * 3) * COB + cg * SC_COT;
#pragma unroll
                for (int kw = 0; kw < 3; kw++) {
                    float wr[SC_COT];
#pragma unroll
                    for (int k = 0; k < SC_COT / 4; k++) {
                        const float4 t4 = reinterpret_cast<const float4*>(wp + kw * COB)[k];
                        wr[4 * k] = t4.x;
                        wr[4 * k + 1] = t4.y;
                        wr[4 * k + 2] = t4.z;
                        wr[4 * k + 3] = t4.w;
                    }
#pragma unroll
                    for (int o = 0; o < SC_COT; o++)
#pragma unroll
                        for (int v = 0; v < SC_V; v++) acc[o][v] = fmaf(wr[o], xr[v + kw], acc[o][v]);
                }
            }
        }
        if (bias != nullptr) {
#pragma unroll
            for (int o = 0; o < SC_COT; o++) {
                const float b = o < nco ? bias[co0 + o] : 0.0f;
#pragma unroll
                for (int v = 0; v < SC_V; v++) acc[o][v] += b;
            }
        }
        const int nv = min(SC_V, W - q.w0);
        if (cl) {
            // per voxel, nco consecutive channels: 16-byte vectors where CO allows
#pragma unroll
            for (int v = 0; v < SC_V; v++) {
                if (v >= nv) break;
                float r[SC_COT];
#pragma unroll
                for (int o = 0; o < SC_COT; o++) r[o] = acc[o][v];
                const i64 base = (q.vline + q.w0 + v) * CO + co0;
                if (ybf)
                    put<bf16, 8, SC_COT>((bf16*)y, base, r, nco, CO % 8 == 0, accum);
                else
                    put<float, 4, SC_COT>((float*)y, base, r, nco, CO % 4 == 0, accum);
            }
        } else {
            // per channel, nv consecutive voxels
            const i64 vin = q.vline - (i64)q.n * S + q.w0;  // voxel within the sample
#pragma unroll
            for (int o = 0; o < SC_COT; o++) {
                if (o >= nco) break;
                const i64 i = ((i64)q.n * CO + co0 + o) * S + vin;
                if (ybf)
                    put<bf16, 4, SC_V>((bf16*)y, i, acc[o], nv, xvec, accum);
                else
                    put<float, 4, SC_V>((float*)y, i, acc[o], nv, xvec, accum);
            }
        }
    }
}

// dt: bit 0 x bf16, bit 1 w bf16, bit 2 y bf16. b: f32 (CO).
extern "C" __global__ void __launch_bounds__(256, 2)
    conv3d_fwd_small_cin(const void* x, const void* w, const float* b, void* y, int N, int CI, int CO, int D, int H,
                         int W, int cl, int dt) {
    __shared__ __align__(16) float ws[SC_CIN_WS];
    __shared__ __align__(16) float xs[SC_CIN_XS];
    const int wbf = (dt >> 1) & 1, ybf = (dt >> 2) & 1;
    if (dt & 1)
        small_cin_body<bf16>(ws, xs, x, w, wbf, b, y, ybf, N, CI, CO, D, H, W, cl, 0, 0);
    else
        small_cin_body<float>(ws, xs, x, w, wbf, b, y, ybf, N, CI, CO, D, H, W, cl, 0, 0);
}

// The input gradient of a conv with COUT <= 4 outputs and CIN inputs: dx (= or += accum) from dy and
// that conv's weights w. dt: bit 0 dy bf16, bit 1 w bf16, bit 2 dx bf16.
extern "C" __global__ void __launch_bounds__(256, 2)
    conv3d_dgrad_small_cout(const void* dy, const void* w, void* dx, int N, int COUT, int CIN, int D, int H, int W,
                            int cl, int dt, int accum) {
    __shared__ __align__(16) float ws[SC_CIN_WS];
    __shared__ __align__(16) float xs[SC_CIN_XS];
    const int wbf = (dt >> 1) & 1, xbf = (dt >> 2) & 1;
    if (dt & 1)
        small_cin_body<bf16>(ws, xs, dy, w, wbf, nullptr, dx, xbf, N, COUT, CIN, D, H, W, cl, accum, 1);
    else
        small_cin_body<float>(ws, xs, dy, w, wbf, nullptr, dx, xbf, N, COUT, CIN, D, H, W, cl, accum, 1);
}

// -- conv3d_fwd_small_cin_mma / conv3d_dgrad_small_cout_mma: small_cin_body's job on the tensor
// cores, for NDHWC with CI <= 8 and CO a multiple of 8 up to 64 (the whole-head first conv 3 -> 64,
// BraTS' 8 -> 64, and the output convs' data gradients 1 -> 64 and 4 -> 64). ncu showed the FMA
// kernel issue-bound (docs/perf/h200-2026-12-01c); here the 27 taps x CIP channels (CI padded with
// zeros to CIP = 4, or 8 where CI > 4) are the K of an implicit GEMM: 108 padded to 112 = 7 steps
// of mma.m16n8k16 (four taps a step), or 216 padded to 224 = 14 steps (two taps a step), bf16
// operands, f32 sums. (cuDNN ran BraTS' 8 -> 64 forward in 3.64 ms at 144 x 192 x 192 on the H200,
// 120 blocks of an sm90 segment-k kernel: docs/perf/h200-2026-12-02i/call11-prof-brats-bf16.)
// Inputs are rounded to bf16 when staged (as cuDNN's bf16 convs and PyTorch's autocast round
// them); bias, accumulation and the output (f32 or bf16) as small_cin_body.
//   The job is writing the CO-channel output: a memory-bound pass (268 MB at 128^3 x 64 bf16). A
// block walks a column of 8 (h) x 16 (w) voxels through DC planes of d (one work item; the host
// picks DC, see small_mma_run): warp i takes row h0 + i, one m16 tile along w, all CO outputs
// (CO / 8 n8 tiles, 32 f32 sums a thread). The input halo sits in a ring of four 10 x 18 planes
// (CIP bf16 channels a voxel, zeros outside the volume): the three the current plane's taps read
// and the next one, loaded into registers during the previous plane's MMAs and stored after them,
// so a plane costs one halo plane of loads and one barrier. Each warp stages its 16 x CO results
// in f32 through shared memory (32 channels at a time) and writes them as 16-byte vectors, whole
// 32-byte sectors. The first version (a 3-plane halo reloaded per 8 x 16 tile, 4-byte stores of
// the fragments) wrote at 0.8 TB/s (324 us at 128^3, docs/perf/h200-2026-12-01p); this one takes
// 199 us (docs/perf/h200-2026-12-02a; ncu on a draft: issue-bound, which the straight-line mma
// loop below and one cvt a bf16 pair answered).
//   Shared memory (dynamic, conv3d.rs small_mma_smem bytes): the per-channel bias, the staging,
// the halo ring, and the weights in B-fragment order (wf[(ks*8 + nt)*32 + lane] = the two 32-bit
// registers lane needs), arranged once per block. A fragment register = the 2 channels
// (ci, ci + 1) of one tap at one voxel: a single 32-bit shared-memory load.
//   tw as small_cin_body: 0 forward (w = (CO, CI) weights), 1 data gradient of the conv with CI
// outputs and CO inputs (w'[co, ci, t] = w[ci, co, 26 - t]).
#define MMA_TH 8
#define MMA_TW 16
#define MMA_PL ((MMA_TH + 2) * (MMA_TW + 2))  // one halo plane: 180 voxels
#define MMA_RING 4                             // halo planes held: three read, one being filled
#define MMA_SROW 36                            // staging row: 32 f32 channels + 4 (bank offset)
// The work items of the kernels walking along d (conv3d_fwd_small_cin_mma, its data gradient
// twin, conv3d_fwd_gn_small_cout; conv3d_wgmma with tiles of th x tw = 32 x 8): a column of
// th x tw voxels of sample n cut into chunks of DC planes [d0, d1); the host's col_items counts
// them the same way.
struct ColGrid {
    int hb, wb, db, th, tw;
    i64 items;
};
struct ColItem {
    int n, d0, d1, h0, w0;
};
__device__ __forceinline__ ColGrid col_grid(int N, int D, int H, int W, int DC, int th = MMA_TH, int tw = MMA_TW) {
    ColGrid c;
    c.th = th;
    c.tw = tw;
    c.hb = (H + th - 1) / th;
    c.wb = (W + tw - 1) / tw;
    c.db = (D + DC - 1) / DC;
    c.items = (i64)N * c.db * c.hb * c.wb;
    return c;
}
__device__ __forceinline__ ColItem col_item(const ColGrid& c, i64 it, int D, int DC) {
    ColItem r;
    r.w0 = (int)(it % c.wb) * c.tw;
    r.h0 = (int)((it / c.wb) % c.hb) * c.th;
    r.d0 = (int)((it / ((i64)c.wb * c.hb)) % c.db) * DC;
    r.n = (int)(it / ((i64)c.wb * c.hb * c.db));
    r.d1 = min(r.d0 + DC, D);
    return r;
}
// raw bits of element i (read now, converted after the MMAs that hide the load)
__device__ __forceinline__ u32 raw_ld(const bf16* p, i64 i) { return (u32)p[i].b; }
__device__ __forceinline__ u32 raw_ld(const float* p, i64 i) { return __float_as_uint(p[i]); }
__device__ __forceinline__ float raw_f(u32 r, const bf16*) { return __uint_as_float(r << 16); }
__device__ __forceinline__ float raw_f(u32 r, const float*) { return __uint_as_float(r); }
// this thread's voxel of halo plane dd (threads < MMA_PL), zeros outside the volume and past CI;
// the 8 channels of an aligned voxel in one or two 16-byte loads
template <typename TX, int CIP>
__device__ __forceinline__ void mma_plane_load(u32 (&r)[CIP], const TX* x, int CI, int n, int dd, int h0, int w0,
                                               int D, int H, int W) {
#pragma unroll
    for (int ci = 0; ci < CIP; ci++) r[ci] = 0u;
    const int i = threadIdx.x;
    const int c = i % (MMA_TW + 2), rr = i / (MMA_TW + 2);
    const int hh = h0 + rr - 1, ww = w0 + c - 1;
    if (i >= MMA_PL || dd < 0 || dd >= D || hh < 0 || hh >= H || ww < 0 || ww >= W) return;
    const i64 o = ((((i64)n * D + dd) * H + hh) * W + ww) * CI;
    if constexpr (CIP == 8 && sizeof(TX) == 2) {
        if (CI == 8 && (reinterpret_cast<size_t>(x) & 15) == 0) {
            const uint4 v = *reinterpret_cast<const uint4*>(x + o);
            const u32 p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < CIP / 2; j++) {
                r[2 * j] = p[j] & 0xffffu;
                r[2 * j + 1] = p[j] >> 16;
            }
            return;
        }
    }
    if constexpr (CIP == 8 && sizeof(TX) == 4) {
        if (CI == 8 && (reinterpret_cast<size_t>(x) & 15) == 0) {
            const float4 v0 = *reinterpret_cast<const float4*>(x + o);
            const float4 v1 = *reinterpret_cast<const float4*>(x + o + 4);
            const float f[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
            for (int j = 0; j < 8; j++) r[j] = __float_as_uint(f[j]);
            return;
        }
    }
#pragma unroll
    for (int ci = 0; ci < CIP; ci++)
        if (ci < CI) r[ci] = raw_ld(x, o + ci);
}
template <typename TX, int CIP>
__device__ __forceinline__ void mma_plane_store(u32* xs, int plane, const u32 (&r)[CIP]) {
    const TX* t = nullptr;
    if (threadIdx.x >= MMA_PL) return;
    u32* dst = xs + (((plane + 1) & (MMA_RING - 1)) * MMA_PL + threadIdx.x) * (CIP / 2);
    if constexpr (CIP == 4) {
        *reinterpret_cast<uint2*>(dst) =
            make_uint2(pack_bf2(raw_f(r[0], t), raw_f(r[1], t)), pack_bf2(raw_f(r[2], t), raw_f(r[3], t)));
    } else {
        *reinterpret_cast<uint4*>(dst) =
            make_uint4(pack_bf2(raw_f(r[0], t), raw_f(r[1], t)), pack_bf2(raw_f(r[2], t), raw_f(r[3], t)),
                       pack_bf2(raw_f(r[4], t), raw_f(r[5], t)), pack_bf2(raw_f(r[6], t), raw_f(r[7], t)));
    }
}
// k steps of 16 over the 27 taps x CIP channels
__host__ __device__ constexpr int mma_ksteps(int cip) { return (27 * cip + 15) / 16; }
template <typename TX, int CIP>
__device__ void small_cin_mma_body(uint2* wf, u32* xs, float* st, float* sb, const void* xv, const void* w, int wbf,
                                   const float* bias, void* y, int ybf, int N, int CI, int CO, int D, int H, int W,
                                   int DC, int accum, int tw) {
    constexpr int UPV = CIP / 2;  // 32-bit words a voxel in the ring
    constexpr int KS = mma_ksteps(CIP);
    const TX* x = (const TX*)xv;
    // W'(n, k) for k = tap*CIP + ci: 0 past the 27 taps, CI or CO
    auto wk = [&](int n, int k) -> float {
        const int t = k / CIP, ci = k % CIP;
        if (t >= 27 || ci >= CI || n >= CO) return 0.0f;
        return tw ? wat(w, wbf, ci, n, 26 - t, CI, CO, 1) : wat(w, wbf, n, ci, t, CO, CI, 1);
    };
    for (int i = threadIdx.x; i < KS * 8 * 32; i += blockDim.x) {
        const int l = i & 31, nt = (i >> 5) & 7, ks = i >> 8;
        const int n = nt * 8 + (l >> 2), k = ks * 16 + (l & 3) * 2;
        wf[i] = make_uint2(pack_bf2(wk(n, k), wk(n, k + 1)), pack_bf2(wk(n, k + 8), wk(n, k + 9)));
    }
    for (int i = threadIdx.x; i < 64; i += blockDim.x) sb[i] = bias != nullptr && i < CO ? bias[i] : 0.0f;
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
    const ColGrid cg = col_grid(N, D, H, W, DC);
    float* sw = st + wi * 16 * MMA_SROW;  // this warp's staging rows
    // this thread's A fragments: k = ks*16 + tig*2 (+ 8). CIP 4: taps ks*4 + tig/2 (+ 2), channels
    // (tig & 1) * 2 + {0, 1}; CIP 8: taps ks*2 (+ 1), channels tig*2 + {0, 1}. The word index of
    // tap (0, 0, 0)'s a0 voxel within a ring slot is tb.
    const bool hi = (tig >> 1) != 0;
    const int tb = (wi * (MMA_TW + 2) + g) * UPV + (CIP == 4 ? (tig & 1) : tig);
    // word offset of tap t within the three slots sl
    auto toff = [&](const int (&sl)[3], int t) {
        return sl[t / 9] + ((t / 3) % 3) * (MMA_TW + 2) * UPV + (t % 3) * UPV;
    };
    for (i64 it = blockIdx.x; it < cg.items; it += gridDim.x) {
        const ColItem ci = col_item(cg, it, D, DC);
        const int n = ci.n, d0 = ci.d0, d1 = ci.d1, h0 = ci.h0, w0 = ci.w0;
        __syncthreads();  // the weights are arranged / the previous item's reads of the ring are done
        u32 r[CIP];
#pragma unroll 1
        for (int p = d0 - 1; p <= d0 + 1; p++) {
            mma_plane_load<TX, CIP>(r, x, CI, n, p, h0, w0, D, H, W);
            mma_plane_store<TX, CIP>(xs, p, r);
        }
        mma_plane_load<TX, CIP>(r, x, CI, n, d0 + 2, h0, w0, D, H, W);
        __syncthreads();
        const int h = h0 + wi, nv = min(MMA_TW, W - w0);
#pragma unroll 1
        for (int z = d0; z < d1; z++) {
            float acc[8][4];  // from the bias: b + Σ taps
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                const float2 b = *reinterpret_cast<const float2*>(sb + nt * 8 + tig * 2);
                acc[nt][0] = acc[nt][2] = b.x;
                acc[nt][1] = acc[nt][3] = b.y;
            }
            // tap (kd, kh, kw) of output plane z reads plane z - 1 + kd, in ring slot (z + kd) & 3
            int sl[3];
#pragma unroll
            for (int kd = 0; kd < 3; kd++) sl[kd] = ((z + kd) & (MMA_RING - 1)) * (MMA_PL * UPV);
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                // fragment order a0 (row g, k lo), a1 (row g + 8, k lo), a2 (row g, k hi), a3 (row g + 8, k hi)
                u32 a[4];
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    int base;
                    bool live;
                    if constexpr (CIP == 4) {
                        // the thread's tap is t0 or t0 + 1 (tig >> 1): both known at compile time
                        const int t0 = ks * 4 + 2 * half, t1 = t0 + 1;
                        const int o0 = t0 < 27 ? toff(sl, t0) : 0;
                        const int o1 = t1 < 27 ? toff(sl, t1) : 0;
                        live = hi ? t1 < 27 : t0 < 27;
                        base = (hi ? o1 : o0) + tb;
                    } else {
                        const int t = ks * 2 + half;
                        live = t < 27;
                        base = (t < 27 ? toff(sl, t) : 0) + tb;
                    }
                    a[2 * half] = live ? xs[base] : 0u;
                    a[2 * half + 1] = live ? xs[base + 8 * UPV] : 0u;
                }
                // all 8 n tiles whatever CO (the weights past CO are zeros): a runtime exit here
                // made ptxas shuffle the sums between registers around every mma (~15 moves each)
#pragma unroll
                for (int nt = 0; nt < 8; nt++) {
                    const uint2 b = wf[(ks * 8 + nt) * 32 + lane];
                    mma_bf16_16816(acc[nt], a, b.x, b.y);
                }
            }
            // the next plane into the free slot, the one after into registers
            if (z + 1 < d1) {
                mma_plane_store<TX, CIP>(xs, z + 2, r);
                if (z + 2 < d1) mma_plane_load<TX, CIP>(r, x, CI, n, z + 3, h0, w0, D, H, W);
            }
            // c0, c1: row g, columns tig*2 + {0, 1}; c2, c3: row g + 8 (the bias already in them).
            // Staged 32 channels at a time (rows of MMA_SROW f32), then written by the warp in
            // 16-byte vectors: bf16, lane = voxel (lane >> 2) + 8·pass, chunk of 8 channels lane & 3;
            // f32, voxel (lane >> 3) + 4·pass, chunk of 4 channels lane & 7.
            const i64 row = ((((i64)n * D + z) * H + h) * W + w0) * CO;
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                if (hf * 32 >= CO) break;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int nt = hf * 4 + q;
                    *reinterpret_cast<float2*>(sw + g * MMA_SROW + q * 8 + tig * 2) = make_float2(acc[nt][0], acc[nt][1]);
                    *reinterpret_cast<float2*>(sw + (g + 8) * MMA_SROW + q * 8 + tig * 2) =
                        make_float2(acc[nt][2], acc[nt][3]);
                }
                __syncwarp();
                const int ch = min(32, CO - hf * 32);  // channels staged (a multiple of 8)
                if (h < H && ybf) {
                    const int q = lane & 3;
                    bf16* yr = (bf16*)y + row + hf * 32 + q * 8;
#pragma unroll
                    for (int pass = 0; pass < 2; pass++) {
                        const int v = (lane >> 2) + 8 * pass;
                        if (q * 8 >= ch || v >= nv) continue;
                        const float4 s0 = *reinterpret_cast<const float4*>(sw + v * MMA_SROW + q * 8);
                        const float4 s1 = *reinterpret_cast<const float4*>(sw + v * MMA_SROW + q * 8 + 4);
                        float f[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
                        uint4* p = reinterpret_cast<uint4*>(yr + v * CO);
                        if (accum) {
                            const uint4 o = *p;
                            const u32 ow[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                f[2 * e] += __uint_as_float(ow[e] << 16);
                                f[2 * e + 1] += __uint_as_float(ow[e] & 0xffff0000u);
                            }
                        }
                        *p = make_uint4(pack_bf2(f[0], f[1]), pack_bf2(f[2], f[3]), pack_bf2(f[4], f[5]),
                                        pack_bf2(f[6], f[7]));
                    }
                } else if (h < H) {
                    const int q = lane & 7;
                    float* yr = (float*)y + row + hf * 32 + q * 4;
#pragma unroll
                    for (int pass = 0; pass < 4; pass++) {
                        const int v = (lane >> 3) + 4 * pass;
                        if (q * 4 >= ch || v >= nv) continue;
                        float4 s = *reinterpret_cast<const float4*>(sw + v * MMA_SROW + q * 4);
                        float4* p = reinterpret_cast<float4*>(yr + v * CO);
                        if (accum) {
                            const float4 o = *p;
                            s.x += o.x;
                            s.y += o.y;
                            s.z += o.z;
                            s.w += o.w;
                        }
                        *p = s;
                    }
                }
                __syncwarp();
            }
            __syncthreads();  // the next plane is stored; this plane's reads of the ring are done
        }
    }
}

// The two entry points (one profiler category each): the forward of a Cin <= 8 conv (bias b, f32
// CO) and the data gradient of a Cout <= 8 conv (CI = that conv's Cout, CO = its Cin; no bias).
// dt: bit 0 x bf16, bit 1 w bf16, bit 2 y bf16. NDHWC only; CO % 8 == 0, CO <= 64, CI <= 8. DC:
// planes of d a work item. Dynamic shared memory: small_mma_smem(CIP) bytes (CIP = 4 where
// CI <= 4, else 8).
__host__ __device__ constexpr int small_mma_smem(int cip) {
    return 64 * 4 + 8 * 16 * MMA_SROW * 4 + MMA_RING * MMA_PL * (cip / 2) * 4 + mma_ksteps(cip) * 8 * 32 * 8;
}
template <typename TX>
__device__ __forceinline__ void small_mma_entry(const void* x, const void* w, const float* b, void* y, int N, int CI,
                                                int CO, int D, int H, int W, int DC, int dt, int accum, int tw) {
    extern __shared__ __align__(16) float smm[];
    float* sb = smm;
    float* st = sb + 64;
    u32* xs = reinterpret_cast<u32*>(st + 8 * 16 * MMA_SROW);
    const int wbf = (dt >> 1) & 1, ybf = (dt >> 2) & 1;
    if (CI <= 4) {
        uint2* wf = reinterpret_cast<uint2*>(xs + MMA_RING * MMA_PL * 2);
        small_cin_mma_body<TX, 4>(wf, xs, st, sb, x, w, wbf, b, y, ybf, N, CI, CO, D, H, W, DC, accum, tw);
    } else {
        uint2* wf = reinterpret_cast<uint2*>(xs + MMA_RING * MMA_PL * 4);
        small_cin_mma_body<TX, 8>(wf, xs, st, sb, x, w, wbf, b, y, ybf, N, CI, CO, D, H, W, DC, accum, tw);
    }
}
#define SMALL_MMA_ENTRY(NAME, TW)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 3)                                                   \
        NAME(const void* x, const void* w, const float* b, void* y, int N, int CI, int CO, int D, int H, int W, \
             int DC, int dt, int accum) {                                                                  \
        if (dt & 1)                                                                                        \
            small_mma_entry<bf16>(x, w, b, y, N, CI, CO, D, H, W, DC, dt, accum, TW);                      \
        else                                                                                               \
            small_mma_entry<float>(x, w, b, y, N, CI, CO, D, H, W, DC, dt, accum, TW);                     \
    }
SMALL_MMA_ENTRY(conv3d_fwd_small_cin_mma, 0)
SMALL_MMA_ENTRY(conv3d_dgrad_small_cout_mma, 1)

// -- conv3d_fwd_gn_small_cout: the output head GroupNorm -> SiLU -> Conv3 (C = 64 bf16 inputs in
// NDHWC, CO <= 4 outputs, 3x3x3, stride 1) in one pass over x: silu(GN(x)) is never stored. Per
// input plane, a block stages silu(GN(x)) of a 10 x 18 halo of voxels in shared memory (bf16,
// computed as gn_apply computes it: gn_y, silu_t<bf16>, rounded to nearest even), then per
// group of taps forms the tap products P[v][t*CO + co] = sum_c act[v][c] w[co][c][t] of every
// halo voxel on the tensor cores (mma.m16n8k16, K = 64 channels, N = taps x CO padded to n8
// tiles) and adds those that land on each of its 8 x 16 output voxels, tap (kd, kh, kw) into
// plane u + 1 - kd's sums, held in registers (three planes in flight). The GEMM + tap-sum route
// this replaces stored silu(GN(x)) and 27*CO f32 products per voxel and read both back
// (docs/perf/h200-2026-12-02a). The halo plane's loads are issued a plane ahead (gh_load). Work items as conv3d_fwd_small_cin_mma's (small_mma_items).
// mean/rstd: the statistics (N*G); gamma/beta: C; w: (CO, 64, 27) in the NDHWC weight layout
// (wat, cl = 1); b: CO f32 (may be null); y: (N, D, H, W, CO), f32 or bf16 (ybf).
//   Shared memory (dynamic, conv3d.rs gn_head_smem bytes): act 192 x GH_AS bf16 (rows past the
// 180 halo voxels stay zero), P 180 x PS f32, the weights in B-fragment order, the per-channel
// (sc, sh). CO <= 2 forms all 27 taps' products in one pass (two barriers a plane), CO 3 and 4
// one kd at a time (seven): a first version with a pass per kd for every CO took 424-462 us for
// the whole-head head (CO = 1), no faster than the two calls it replaces.
#define GH_TH MMA_TH  // the work items are col_item's
#define GH_TW MMA_TW
#define GH_PW (GH_TW + 2)            // 18 halo voxels a row
#define GH_PL ((GH_TH + 2) * GH_PW)  // 180 halo voxels a plane
#define GH_MT 12                     // m16 tiles over them (192 rows)
#define GH_AS 72                     // act row: 64 bf16 channels + 8 (ldmatrix rows on distinct banks)
__device__ __forceinline__ void ldsm_x4(u32* r, const void* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
#define GH_SJ ((GH_PL * 8 + 255) / 256)  // 16-byte chunks of a halo plane a thread (6)
// this thread's chunks of halo plane u (chunk i = tid + 256 j: voxel i / 8, channels 8 (i % 8) ..
// + 7), bit j of m set where the voxel is inside the volume (zeros loaded elsewhere)
__device__ __forceinline__ void gh_load(uint4 (&xq)[GH_SJ], u32& m, const bf16* x, int n, int u, int h0, int w0, int D,
                                        int H, int W) {
    m = 0u;
#pragma unroll
    for (int j = 0; j < GH_SJ; j++) {
        const int i = threadIdx.x + 256 * j, v = i >> 3, q = i & 7;
        const int hh = h0 + v / GH_PW - 1, ww = w0 + v % GH_PW - 1;
        xq[j] = make_uint4(0u, 0u, 0u, 0u);
        if (i < GH_PL * 8 && u >= 0 && u < D && hh >= 0 && hh < H && ww >= 0 && ww < W) {
            xq[j] = *reinterpret_cast<const uint4*>(x + ((((i64)n * D + u) * H + hh) * W + ww) * 64 + q * 8);
            m |= 1u << j;
        }
    }
}
template <int CO>
__device__ void gn_small_cout_body(unsigned char* smem, const bf16* x, const float* mean, const float* rstd,
                                   const float* gamma, const float* beta, int G, const void* w, int wbf,
                                   const float* bias, void* y, int ybf, int N, int D, int H, int W, int DC) {
    // the 27 taps in KG groups of TG (one group where 27·CO columns fit 7 n8 tiles: one pass of
    // MMAs and sums a plane, two barriers; else a group per kd)
    constexpr int KG = CO <= 2 ? 1 : 3, TG = 27 / KG;
    constexpr int NK = (TG * CO + 7) / 8;  // n8 tiles a group
    constexpr int PS = NK * 8 + 4;         // P row (f32): the group's columns + 4 (bank offset)
    constexpr int PAIRS = 128 * CO;        // (output voxel, co) sums of a plane
    constexpr int PT = (PAIRS + 255) / 256;
    u16* act = reinterpret_cast<u16*>(smem);
    float* P = reinterpret_cast<float*>(smem + 192 * GH_AS * 2);
    uint2* wf = reinterpret_cast<uint2*>(smem + 192 * GH_AS * 2 + GH_PL * PS * 4);
    float2* tab = reinterpret_cast<float2*>(smem + 192 * GH_AS * 2 + GH_PL * PS * 4 + KG * 4 * NK * 32 * 8);
    const int tid = threadIdx.x, lane = tid & 31, wi = tid >> 5, g = lane >> 2, tig = lane & 3;
    // B fragments: wf[((kg*4 + ks)*NK + nt)*32 + lane], column n = nt*8 + g = (t - kg*TG)*CO + co
    for (int i = tid; i < KG * 4 * NK * 32; i += blockDim.x) {
        const int l = i & 31, nt = (i >> 5) % NK, ks = (i / (32 * NK)) & 3, kg = i / (128 * NK);
        const int n = nt * 8 + (l >> 2), k = ks * 16 + (l & 3) * 2;
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (n < TG * CO) {
            const int co = n % CO, t = kg * TG + n / CO;
            v[0] = wat(w, wbf, co, k, t, CO, 64, 1);
            v[1] = wat(w, wbf, co, k + 1, t, CO, 64, 1);
            v[2] = wat(w, wbf, co, k + 8, t, CO, 64, 1);
            v[3] = wat(w, wbf, co, k + 9, t, CO, 64, 1);
        }
        wf[i] = make_uint2(pack_bf2(v[0], v[1]), pack_bf2(v[2], v[3]));
    }
    for (int i = tid; i < (192 - GH_PL) * GH_AS / 2; i += blockDim.x)
        reinterpret_cast<u32*>(act + GH_PL * GH_AS)[i] = 0u;
    // this thread's (output voxel, co) sums: pair p = tid + 256*j, voxel p / CO (row oh, column ow)
    int pr[PT], pco[PT];
    bool pon[PT];
#pragma unroll
    for (int j = 0; j < PT; j++) {
        const int p = tid + 256 * j, v = p / CO;
        pon[j] = p < PAIRS;
        pco[j] = p % CO;
        pr[j] = (v / GH_TW) * GH_PW + (v % GH_TW);  // halo index of tap (0, 0)
    }
    float bj[PT];
#pragma unroll
    for (int j = 0; j < PT; j++) bj[j] = bias != nullptr ? bias[pco[j]] : 0.0f;
    const ColGrid cg = col_grid(N, D, H, W, DC);
    const int cpg = 64 / G;
    int tab_n = -1;
    for (i64 it = blockIdx.x; it < cg.items; it += gridDim.x) {
        const ColItem ci = col_item(cg, it, D, DC);
        const int n = ci.n, d0 = ci.d0, d1 = ci.d1, h0 = ci.h0, w0 = ci.w0;
        if (n != tab_n) {  // uniform over the block
            __syncthreads();
            for (int c = tid; c < 64; c += blockDim.x) {
                const int ng = n * G + c / cpg;
                float sc, sh;
                gn_affine(rstd[ng], gamma[c], beta[c], mean[ng], sc, sh);
                tab[c] = make_float2(sc, sh);
            }
            tab_n = n;
        }
        // sums of output planes u - 1, u, u + 1 (from the bias)
        float om[PT], o0[PT], op[PT];
#pragma unroll
        for (int j = 0; j < PT; j++) om[j] = o0[j] = op[j] = bj[j];
        uint4 xq[GH_SJ];
        u32 xm;
        gh_load(xq, xm, x, n, max(d0 - 1, 0), h0, w0, D, H, W);
        for (int u = d0 - 1; u <= d1; u++) {
            if (u >= 0 && u < D) {
                __syncthreads();  // the table is written / the previous plane's reads of act are done
                // silu(GN(x)) of the halo plane from the loads issued a plane ago, 8 channels a
                // thread-step; then the next plane's loads, in flight during this plane's MMAs
                // (a loop of load, wait, convert took ~6 us a plane)
#pragma unroll
                for (int j = 0; j < GH_SJ; j++) {
                    const int i = tid + 256 * j, v = i >> 3, q = i & 7;
                    if (i >= GH_PL * 8) break;
                    const u32 xw[4] = {xq[j].x, xq[j].y, xq[j].z, xq[j].w};
                    u32 r[4];
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float2 t0 = tab[q * 8 + 2 * e], t1 = tab[q * 8 + 2 * e + 1];
                        const float y0 = gn_y(__uint_as_float(xw[e] << 16), t0.x, t0.y);
                        const float y1 = gn_y(__uint_as_float(xw[e] & 0xffff0000u), t1.x, t1.y);
                        r[e] = pack_bf2(silu_t<bf16>(y0), silu_t<bf16>(y1));
                    }
                    // outside the volume silu(GN) is not applied: the conv's zero padding
                    const uint4 o = (xm >> j) & 1 ? make_uint4(r[0], r[1], r[2], r[3]) : make_uint4(0u, 0u, 0u, 0u);
                    *reinterpret_cast<uint4*>(act + v * GH_AS + q * 8) = o;
                }
                gh_load(xq, xm, x, n, u + 1, h0, w0, D, H, W);
#pragma unroll
                for (int kg = 0; kg < KG; kg++) {
                    __syncthreads();  // act is staged / the previous group's reads of P are done
                    // warp wi: m tiles wi and wi + 8 (the latter for wi < 4), one after the other
                    const int nm = wi < GH_MT - 8 ? 2 : 1;
#pragma unroll 1
                    for (int m = 0; m < nm; m++) {
                        float acc[NK][4];
#pragma unroll
                        for (int nt = 0; nt < NK; nt++)
#pragma unroll
                            for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
                        const int m0 = (wi + 8 * m) * 16;
#pragma unroll
                        for (int ks = 0; ks < 4; ks++) {
                            u32 a[4];
                            ldsm_x4(a, act + (m0 + (lane & 15)) * GH_AS + ks * 16 + (lane >> 4) * 8);
#pragma unroll
                            for (int nt = 0; nt < NK; nt++) {
                                const uint2 b = wf[((kg * 4 + ks) * NK + nt) * 32 + lane];
                                mma_bf16_16816(acc[nt], a, b.x, b.y);
                            }
                        }
                        const int r0 = m0 + g;
#pragma unroll
                        for (int nt = 0; nt < NK; nt++) {
                            const int c = nt * 8 + tig * 2;
                            if (r0 < GH_PL) *reinterpret_cast<float2*>(P + r0 * PS + c) = make_float2(acc[nt][0], acc[nt][1]);
                            if (r0 + 8 < GH_PL)
                                *reinterpret_cast<float2*>(P + (r0 + 8) * PS + c) = make_float2(acc[nt][2], acc[nt][3]);
                        }
                    }
                    __syncthreads();
                    // the group's taps that land on each output voxel: tap (kd, kh, kw) on plane
                    // u + 1 - kd
#pragma unroll
                    for (int j = 0; j < PT; j++) {
                        if (!pon[j]) continue;
                        float s[3] = {0.0f, 0.0f, 0.0f};
#pragma unroll
                        for (int tt = 0; tt < TG; tt++) {
                            const int t = kg * TG + tt, kd = t / 9, kh = (t / 3) % 3, kw = t % 3;
                            s[kd] += P[(pr[j] + kh * GH_PW + kw) * PS + tt * CO + pco[j]];
                        }
                        op[j] += s[0];
                        o0[j] += s[1];
                        om[j] += s[2];
                    }
                }
            }
            // plane u - 1 is complete
            const int z = u - 1;
            if (z >= d0 && z < d1) {
#pragma unroll
                for (int j = 0; j < PT; j++) {
                    const int p = tid + 256 * j, v = p / CO;
                    const int hh = h0 + v / GH_TW, ww = w0 + v % GH_TW;
                    if (!pon[j] || hh >= H || ww >= W) continue;
                    const i64 o = ((((i64)n * D + z) * H + hh) * W + ww) * CO + pco[j];
                    if (ybf)
                        ((bf16*)y)[o] = f2bf(om[j]);
                    else
                        ((float*)y)[o] = om[j];
                }
            }
#pragma unroll
            for (int j = 0; j < PT; j++) {
                om[j] = o0[j];
                o0[j] = op[j];
                op[j] = bj[j];
            }
        }
    }
}
// dt: bit 1 w bf16, bit 2 y bf16 (x is bf16). CO 1..4; C = 64; dynamic shared memory gh_smem(CO).
extern "C" __global__ void __launch_bounds__(256, 2)
    conv3d_fwd_gn_small_cout(const void* x, const float* mean, const float* rstd, const float* gamma, const float* beta,
                             int G, const void* w, const float* b, void* y, int N, int CO, int D, int H, int W, int DC,
                             int dt) {
    extern __shared__ __align__(16) unsigned char gh_smem[];
    const int wbf = (dt >> 1) & 1, ybf = (dt >> 2) & 1;
    const bf16* xb = (const bf16*)x;
    switch (CO) {
        case 1: gn_small_cout_body<1>(gh_smem, xb, mean, rstd, gamma, beta, G, w, wbf, b, y, ybf, N, D, H, W, DC); break;
        case 2: gn_small_cout_body<2>(gh_smem, xb, mean, rstd, gamma, beta, G, w, wbf, b, y, ybf, N, D, H, W, DC); break;
        case 3: gn_small_cout_body<3>(gh_smem, xb, mean, rstd, gamma, beta, G, w, wbf, b, y, ybf, N, D, H, W, DC); break;
        default: gn_small_cout_body<4>(gh_smem, xb, mean, rstd, gamma, beta, G, w, wbf, b, y, ybf, N, D, H, W, DC); break;
    }
}

// -- conv3d_fwd_small_cout_mma: the forward of a conv with few outputs (CO <= 8: the output conv,
// 64 -> 4 BraTS, 64 -> 1 whole-head) on the tensor cores, bf16 x in NDHWC with C a multiple of 16:
//   y[v, co] = b[co] + sum over t, ci of x[v + off(t), ci] * w[co, ci, t]
// an M x N x K GEMM per tap with M = voxels (m16 tiles along w), N = the outputs (one n8 tile,
// CO <= 8 of it used), K = 16-channel chunks, on mma.m16n8k16 (bf16 operands, f32 sums). cuDNN
// ran BraTS' 64 -> 4 on an sm80 kernel at 2.07 ms (docs/perf/h200-2026-12-01l/prof-before).
// A block takes 1 x 8 x 32 voxel tiles (persistent, grid-stride); per 16-channel chunk of x it
// stages the tile's 3 x 10 x 34 halo in shared memory (32-byte rows, the two 16-byte halves
// swizzled by voxel / 4 so that the 8 rows an ldmatrix reads hit distinct banks) and warp i (row
// h0 + i, two m16 tiles) takes the A fragments of each tap with ldmatrix.x4 at the tap's shift.
// The weights come pre-arranged as B fragments (conv3d_small_cout_wfrag: wfrag[(t * NCC + cc) * 32
// + lane] = the lane's two registers), read through L1. A thread holds 2 x 4 sums, so four blocks
// share an SM and hide each other's staging.
#define FC_TH 8
#define FC_TW 32
#define FC_HALO (3 * (FC_TH + 2) * (FC_TW + 2))
extern "C" __global__ void conv3d_small_cout_wfrag(const void* w, int wbf, int C, int CO, uint2* wfrag) {
    const int ncc = C / 16;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 27 * ncc * 32) return;
    const int lane = i & 31, cc = (i >> 5) % ncc, t = (i >> 5) / ncc;
    const int n = lane >> 2, k = cc * 16 + (lane & 3) * 2;  // b0: k, k + 1; b1: k + 8, k + 9 (column n)
    auto wv = [&](int ci) -> float { return n < CO ? wat(w, wbf, n, ci, t, CO, C, 1) : 0.0f; };
    wfrag[i] = make_uint2(pack_bf2(wv(k), wv(k + 1)), pack_bf2(wv(k + 8), wv(k + 9)));
}
extern "C" __global__ void __launch_bounds__(256, 4)
    conv3d_fwd_small_cout_mma(const bf16* x, const uint2* wfrag, const float* b, void* y, int N, int C, int CO,
                              int D, int H, int W, int ybf) {
    __shared__ __align__(16) uint4 xh[FC_HALO * 2];
    const int lane = threadIdx.x & 31, wi = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
    const int ncc = C / 16, mi = lane >> 3;
    const int hb = (H + FC_TH - 1) / FC_TH, wb = (W + FC_TW - 1) / FC_TW;
    const i64 ntiles = (i64)N * D * hb * wb;
    for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const int w0 = (int)(tile % wb) * FC_TW;
        const int h0 = (int)((tile / wb) % hb) * FC_TH;
        const int d = (int)((tile / ((i64)wb * hb)) % D);
        const int n = (int)(tile / ((i64)wb * hb * D));
        float acc[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][e] = 0.0f;
        for (int cc = 0; cc < ncc; cc++) {
            __syncthreads();  // the previous chunk's reads are done
            for (int i = threadIdx.x; i < FC_HALO * 2; i += blockDim.x) {
                const int k = i >> 1, half = i & 1;
                const int c = k % (FC_TW + 2), r = (k / (FC_TW + 2)) % (FC_TH + 2), a = k / ((FC_TW + 2) * (FC_TH + 2));
                const int dd = d + a - 1, hh = h0 + r - 1, ww = w0 + c - 1;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (dd >= 0 && dd < D && hh >= 0 && hh < H && ww >= 0 && ww < W)
                    v = *reinterpret_cast<const uint4*>(x + ((((i64)n * D + dd) * H + hh) * W + ww) * C + cc * 16 +
                                                        half * 8);
                xh[k * 2 + (half ^ ((k >> 2) & 1))] = v;
            }
            __syncthreads();
#pragma unroll 3
            for (int t = 0; t < 27; t++) {
                const int kd = t / 9, kh = (t / 3) % 3, kw = t % 3;
                const uint2 bf = wfrag[(t * ncc + cc) * 32 + lane];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    // matrices (voxels 0-7, ch 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) of the m-tile
                    const int k = (kd * (FC_TH + 2) + wi + kh) * (FC_TW + 2) + mt * 16 + (mi & 1) * 8 + (lane & 7) + kw;
                    const int half = mi >> 1;
                    u32 a[4];
                    ldsm_x4(a, &xh[k * 2 + (half ^ ((k >> 2) & 1))]);
                    mma_bf16_16816(acc[mt], a, bf.x, bf.y);
                }
            }
        }
        // c0, c1: voxel g, outputs tig*2 + {0, 1}; c2, c3: voxel g + 8
        const int h = h0 + wi;
        if (h >= H) continue;
        const i64 row = (((i64)n * D + d) * H + h) * W;
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int ww = w0 + mt * 16 + g + 8 * (e >> 1), co = tig * 2 + (e & 1);
                if (ww >= W || co >= CO) continue;
                const float v = acc[mt][e] + (b != nullptr ? b[co] : 0.0f);
                const i64 o = (row + ww) * CO + co;
                if (ybf)
                    ((bf16*)y)[o] = f2bf(v);
                else
                    ((float*)y)[o] = v;
            }
    }
}

// -- conv3d_fwd_small_cout<COT>: out[n, co, v] = b[co] + sum over ci < CI, t of w[co, ci, t] * x[n, ci, v + off(t)]
// for CO <= COT output channels (COT = 1, or 4 for 2..4), any CI: a skinny reduction over 27 * CI
// terms per output. Block 256; the input channels go through shared memory in chunks of SC_CC.
//  NDHWC: a voxel group is served by LPV = SC_CC / VEC lanes, lane l holding channels
//         chunk*SC_CC + l*VEC .. + VEC - 1 (16-byte loads: VEC = 8 bf16 / 4 f32); the lanes' sums are
//         added by shuffles at the end. Weights: for each tap, lane l reads its VEC*COT weights as
//         K float4s at ((t*K + k)*LPV + l): consecutive lanes, consecutive 16 bytes (no bank
//         conflicts); the 32 / LPV voxel groups of a warp read the same ones (broadcast).
//  NCDHW: a thread = a voxel group, walking every input channel (unit-stride rows, 16-/8-byte loads
//         when W % 4 == 0); weights ws[(c*27 + t)*COT + co], all lanes reading the same (broadcast).
// ws: shared memory of SC_CC * 27 * COT floats (declared by the kernel).
template <typename TX, int COT>
__device__ void small_cout_body(float* ws, const void* xv, const void* w, int wbf, const float* bias, void* y,
                                int ybf, int N, int CI, int CO, int D, int H, int W, int cl) {
    constexpr int VEC = 16 / sizeof(TX);
    constexpr int LPV = SC_CC / VEC;
    constexpr int K = VEC * COT / 4;
    const TX* x = (const TX*)xv;
    const int segs = (W + SC_V - 1) / SC_V;
    const i64 S = (i64)D * H * W;
    const i64 ngroups = (i64)N * D * H * segs;
    const int nch = (CI + SC_CC - 1) / SC_CC;
    // voxel groups per block iteration, this thread's group in it, its lane in the group
    const int gpb = cl ? (int)(blockDim.x / LPV) : (int)blockDim.x;
    const int gib = cl ? (int)(threadIdx.x / LPV) : (int)threadIdx.x;
    const int l = cl ? (int)(threadIdx.x % LPV) : 0;
    auto fill = [&](int ch) {
        for (int f = threadIdx.x; f < SC_CC * 27 * COT; f += blockDim.x) {
            int c, co, t;
            if (cl) {
                const int j4 = f & 3, l4 = f >> 2, ll = l4 % LPV, tk = l4 / LPV, k = tk % K;
                const int q = k * 4 + j4;
                t = tk / K;
                co = q % COT;
                c = ch * SC_CC + ll * VEC + q / COT;
            } else {
                co = f % COT;
                t = (f / COT) % 27;
                c = ch * SC_CC + f / (COT * 27);
            }
            ws[f] = (c < CI && co < CO) ? wat(w, wbf, co, c, t, CO, CI, cl) : 0.0f;
        }
    };
    if (nch == 1) {
        fill(0);
        __syncthreads();
    }
    float bv[COT];
#pragma unroll
    for (int co = 0; co < COT; co++) bv[co] = co < CO ? bias[co] : 0.0f;
    // block-uniform loop (barriers inside when nch > 1; shuffles after)
    i64 gbeg, gend;
    block_run(ngroups, gpb, &gbeg, &gend);
    for (i64 gb = gbeg; gb < gend; gb += gpb) {
        const i64 g = gb + gib;
        const bool live = g < gend;
        const VGroup q = vgroup(live ? g : 0, segs, D, H, W);
        float acc[SC_V][COT];
#pragma unroll
        for (int v = 0; v < SC_V; v++)
#pragma unroll
            for (int co = 0; co < COT; co++) acc[v][co] = 0.0f;
        for (int ch = 0; ch < nch; ch++) {
            if (nch > 1) {
                __syncthreads();
                fill(ch);
                __syncthreads();
            }
            if (!live) continue;
            if (cl) {
                const int c0 = ch * SC_CC + l * VEC;
                if (c0 >= CI) continue;
                const bool vec = CI % VEC == 0;
#pragma unroll 1
                for (int j = 0; j < 9; j++) {
                    const int dd = q.d + j / 3 - 1, hh = q.h + j % 3 - 1;
                    if (dd < 0 || dd >= D || hh < 0 || hh >= H) continue;
                    const i64 vrow = (i64)q.n * S + ((i64)dd * H + hh) * W;
                    float xr[SC_V + 2][VEC];
#pragma unroll
                    for (int p = 0; p < SC_V + 2; p++) {
                        const int ww = q.w0 - 1 + p;
                        const i64 i = (vrow + ww) * CI + c0;
                        if (ww < 0 || ww >= W) {
#pragma unroll
                            for (int e = 0; e < VEC; e++) xr[p][e] = 0.0f;
                        } else if (vec) {
                            ldv<VEC>(x, i, xr[p]);
                        } else {
#pragma unroll
                            for (int e = 0; e < VEC; e++) xr[p][e] = c0 + e < CI ? ld(x, i + e) : 0.0f;
                        }
                    }
#pragma unroll
                    for (int kw = 0; kw < 3; kw++) {
                        const float4* wp = reinterpret_cast<const float4*>(ws) + (j * 3 + kw) * K * LPV + l;
#pragma unroll
                        for (int k = 0; k < K; k++) {
                            const float4 t4 = wp[k * LPV];
                            const float wr[4] = {t4.x, t4.y, t4.z, t4.w};
#pragma unroll
                            for (int i = 0; i < 4; i++) {
                                const int e = (4 * k + i) / COT, co = (4 * k + i) % COT;
#pragma unroll
                                for (int v = 0; v < SC_V; v++) acc[v][co] = fmaf(wr[i], xr[v + kw][e], acc[v][co]);
                            }
                        }
                    }
                }
            } else {
                const bool xvec = W % SC_V == 0;
                const int cn = min(SC_CC, CI - ch * SC_CC);
#pragma unroll 1
                for (int cc = 0; cc < cn; cc++) {
                    const i64 plane = ((i64)q.n * CI + ch * SC_CC + cc) * S;
#pragma unroll 1
                    for (int j = 0; j < 9; j++) {
                        const int dd = q.d + j / 3 - 1, hh = q.h + j % 3 - 1;
                        if (dd < 0 || dd >= D || hh < 0 || hh >= H) continue;
                        float xr[SC_V + 2];
                        load_row(x, plane + ((i64)dd * H + hh) * W, q.w0, W, xvec, xr);
                        const float* wp = ws + (cc * 27 + j * 3) * COT;
#pragma unroll
                        for (int kw = 0; kw < 3; kw++) {
                            float wr[COT];
                            if constexpr (COT == 4) {
                                const float4 t4 = reinterpret_cast<const float4*>(wp)[kw];
                                wr[0] = t4.x;
                                wr[1] = t4.y;
                                wr[2] = t4.z;
                                wr[3] = t4.w;
                            } else {
#pragma unroll
                                for (int co = 0; co < COT; co++) wr[co] = wp[kw * COT + co];
                            }
#pragma unroll
                            for (int v = 0; v < SC_V; v++)
#pragma unroll
                                for (int co = 0; co < COT; co++) acc[v][co] = fmaf(wr[co], xr[v + kw], acc[v][co]);
                        }
                    }
                }
            }
        }
        const int nv = live ? min(SC_V, W - q.w0) : 0;
        if (cl) {
            // add the LPV lanes' partial sums (aligned groups of LPV lanes: xor stays inside)
#pragma unroll
            for (int v = 0; v < SC_V; v++)
#pragma unroll
                for (int co = 0; co < COT; co++)
#pragma unroll
                    for (int o = LPV / 2; o > 0; o >>= 1) acc[v][co] += __shfl_xor_sync(0xffffffffu, acc[v][co], o);
            // lane l of the group stores outputs (v, co) = (i / COT, i % COT) for i = l, l + LPV, ...
            for (int i = l; i < SC_V * COT; i += LPV) {
                const int v = i / COT, co = i % COT;
                float r = 0.0f;
#pragma unroll
                for (int vv = 0; vv < SC_V; vv++)
#pragma unroll
                    for (int cc = 0; cc < COT; cc++)
                        if (vv * COT + cc == i) r = acc[vv][cc];
                if (v < nv && co < CO) {
                    r += bias[co];
                    const i64 o = (q.vline + q.w0 + v) * CO + co;
                    if (ybf)
                        st((bf16*)y, o, r);
                    else
                        st((float*)y, o, r);
                }
            }
        } else if (nv > 0) {
            const i64 vin = q.vline - (i64)q.n * S + q.w0;
#pragma unroll
            for (int co = 0; co < COT; co++) {
                if (co < CO) {
                    float r[SC_V];
#pragma unroll
                    for (int v = 0; v < SC_V; v++) r[v] = acc[v][co] + bv[co];
                    const i64 i = ((i64)q.n * CO + co) * S + vin;
                    if (ybf)
                        put<bf16, 4, SC_V>((bf16*)y, i, r, nv, W % SC_V == 0, 0);
                    else
                        put<float, 4, SC_V>((float*)y, i, r, nv, W % SC_V == 0, 0);
                }
            }
        }
    }
}

// dt: bit 0 x bf16, bit 1 w bf16, bit 2 y bf16. b: f32 (CO). COT = 4 serves CO = 2, 3, 4.
#define FWD_SMALL_COUT(COT)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                           \
        conv3d_fwd_small_cout##COT(const void* x, const void* w, const float* b, void* y, int N, int CI, int CO,  \
                                   int D, int H, int W, int cl, int dt) {                                          \
        __shared__ __align__(16) float ws[SC_CC * 27 * COT];                                                       \
        if (dt & 1)                                                                                                \
            small_cout_body<bf16, COT>(ws, x, w, (dt >> 1) & 1, b, y, (dt >> 2) & 1, N, CI, CO, D, H, W, cl);          \
        else                                                                                                       \
            small_cout_body<float, COT>(ws, x, w, (dt >> 1) & 1, b, y, (dt >> 2) & 1, N, CI, CO, D, H, W, cl);         \
    }
FWD_SMALL_COUT(1)
FWD_SMALL_COUT(4)

// ---- forward of Cout <= 4 convs as a GEMM and a tap sum (NDHWC; conv3d.rs takes it for Cout = 1) --
// The skinny forward y[v, co] = b[co] + sum over t, ci of w[co, t, ci] * x[v + off(t), ci] split in
// two (conv3d.rs, small_cout_gemm): cuBLAS computes the per-voxel tap products
//   P[co*27 + t][u] = sum over ci of w[co, t, ci] * x[u, ci]       (one GEMM, f32 out)
// over a slab of planes (with one halo plane each side), and this kernel adds the 27 taps:
//   y[v, co] = b[co] + sum over t of P[co*27 + t][v + off(t)]  (0 outside the volume).
// P[co*27 + t][u] is read only by the output v = u - off(t), so each P element is read once, and a
// warp's 32 consecutive voxels read 32 consecutive floats per tap. Sums in f32, taps in order t.
// grid ceil(vox / 256), block 256: vox = (d1 - d0) * H * W outputs of planes d0 .. d1 - 1 of sample
// n; P holds planes h0 .. h0 + m / (H * W) - 1, m = its column length. y of type ybf (bf16 / f32).
extern "C" __global__ void conv3d_small_cout_taps(const float* P, const float* b, void* y, int ybf, int CO, int D,
                                                  int H, int W, int n, int d0, int d1, int h0, i64 m) {
    const i64 hw = (i64)H * W;
    const i64 v = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= (i64)(d1 - d0) * hw) return;
    const int d = d0 + (int)(v / hw), h = (int)((v % hw) / W), w = (int)(v % W);
    for (int co = 0; co < CO; co++) {
        float s = 0.0f;
        const float* pc = P + (i64)co * 27 * m;
#pragma unroll
        for (int kd = 0; kd < 3; kd++) {
            const int dd = d + kd - 1;
            if (dd < 0 || dd >= D) continue;
#pragma unroll
            for (int kh = 0; kh < 3; kh++) {
                const int hh = h + kh - 1;
                if (hh < 0 || hh >= H) continue;
                const i64 row = ((i64)(dd - h0) * H + hh) * W;
#pragma unroll
                for (int kw = 0; kw < 3; kw++) {
                    const int ww = w + kw - 1;
                    if (ww < 0 || ww >= W) continue;
                    s += pc[(i64)((kd * 3 + kh) * 3 + kw) * m + row + ww];
                }
            }
        }
        const i64 o = (((i64)n * D + d) * hw + (i64)h * W + w) * CO + co;
        if (ybf)
            st((bf16*)y, o, s + b[co]);
        else
            st((float*)y, o, s + b[co]);
    }
}
