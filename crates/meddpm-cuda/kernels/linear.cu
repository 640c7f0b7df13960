// linear.cu: nn.Linear (w stored (O, I)) for the time embedding's few rows, and the bias parts of
// the cuBLAS path. With N <= LIN_ROWS rows (the batch: the time-embedding MLP and every ResBlock's
// emb_layers) a Linear is one launch each way, bias and bias gradient included:
//   linear_rows_fwd  out[n, o] = b[o] + sum_i inp[n, i] * w[o, i]
//   linear_rows_bwd  dw[o, i] += sum_n dout[n, o] * inp[n, i], db[o] += sum_n dout[n, o],
//                    dinp[n, i] (+)= sum_o dout[n, o] * w[o, i]
// (cuBLAS's GEMM and our bias kernel took two to three launches of ~2-4 µs each, 22 Linears a
// forward). All sums f32 in a fixed order. Larger N: cuBLAS, then add_channel_bias (S = 1) /
// rows_sum_accum below.
#define LIN_ROWS 8

// grid O, block 256: a block an output o, a thread four i's of each 1024 (loads first, into
// registers, then the products: with the loads inside the loop they went one round trip at a
// time, ~4.5 µs a call), then the block's sum in a fixed order: warp shuffles, then warp 0.
extern "C" __global__ void linear_rows_fwd(float* out, const float* inp, const float* w, const float* b, int N,
                                           int I, int O) {
    __shared__ float red[8][LIN_ROWS];
    const int o = blockIdx.x, t = threadIdx.x, lane = t & 31, wid = t >> 5;
    const float* wr = w + (i64)o * I;
    float s[LIN_ROWS];
#pragma unroll
    for (int n = 0; n < LIN_ROWS; n++) s[n] = 0.0f;
    for (int i0 = 0; i0 < I; i0 += 1024) {
        float wv[4], xv[LIN_ROWS][4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int i = i0 + t + 256 * k;
            wv[k] = i < I ? wr[i] : 0.0f;
        }
#pragma unroll
        for (int n = 0; n < LIN_ROWS; n++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int i = i0 + t + 256 * k;
                xv[n][k] = (n < N && i < I) ? inp[(i64)n * I + i] : 0.0f;
            }
#pragma unroll
        for (int n = 0; n < LIN_ROWS; n++)
#pragma unroll
            for (int k = 0; k < 4; k++) s[n] = fmaf(xv[n][k], wv[k], s[n]);
    }
#pragma unroll
    for (int n = 0; n < LIN_ROWS; n++) {
        const float v = warp_sum(s[n]);
        if (lane == 0) red[wid][n] = v;
    }
    __syncthreads();
    if (t < N) {
        float v = red[0][t];
        for (int k = 1; k < 8; k++) v += red[k][t];
        out[(i64)t * O + o] = b[o] + v;
    }
}

// grid ceil(O·I / 1024) + ceil(I / 32), block 1024. Blocks below ceil(O·I / 1024): a thread an
// element (o, i) of dw += sum_n dout[n, o] * inp[n, i], and with i = 0 db[o] += sum_n dout[n, o].
// The others: 32 columns i a block; warp k takes o = k, k + 32, ... (eight a round, loaded before
// the products), then the 32 warps' sums are added in order in shared memory: dinp, overwritten or
// added (acc); dinp null: no input gradient.
extern "C" __global__ void __launch_bounds__(1024) linear_rows_bwd(float* dw, float* db, float* dinp,
                                                                   const float* dout, const float* inp,
                                                                   const float* w, int N, int I, int O, int acc) {
    const int t = threadIdx.x, wid = t >> 5, lane = t & 31;
    const i64 nbw = ((i64)O * I + 1023) / 1024;
    if ((i64)blockIdx.x < nbw) {
        const i64 e = (i64)blockIdx.x * 1024 + t;
        if (e >= (i64)O * I) return;
        const int o = (int)(e / I), i = (int)(e % I);
        float g[LIN_ROWS], x[LIN_ROWS];
#pragma unroll
        for (int n = 0; n < LIN_ROWS; n++) {
            g[n] = n < N ? dout[(i64)n * O + o] : 0.0f;
            x[n] = n < N ? inp[(i64)n * I + i] : 0.0f;
        }
        const float d0 = dw[e];
        float v = 0.0f, gs = 0.0f;
#pragma unroll
        for (int n = 0; n < LIN_ROWS; n++) {
            if (n >= N) break;
            v = fmaf(g[n], x[n], v);
            gs += g[n];
        }
        dw[e] = d0 + v;
        if (i == 0) db[o] += gs;
        return;
    }
    if (!dinp) return;
    __shared__ float red[32][LIN_ROWS][32];
    const int i = (int)(blockIdx.x - nbw) * 32 + lane;
    float s[LIN_ROWS];
#pragma unroll
    for (int n = 0; n < LIN_ROWS; n++) s[n] = 0.0f;
    for (int o0 = 0; o0 < O; o0 += 256) {
        float wv[8];
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int o = o0 + wid + 32 * k;
            wv[k] = (o < O && i < I) ? w[(i64)o * I + i] : 0.0f;
        }
#pragma unroll
        for (int n = 0; n < LIN_ROWS; n++) {
            if (n >= N) break;
            float gv[8];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int o = o0 + wid + 32 * k;
                gv[k] = o < O ? dout[(i64)n * O + o] : 0.0f;
            }
#pragma unroll
            for (int k = 0; k < 8; k++) s[n] = fmaf(gv[k], wv[k], s[n]);
        }
    }
#pragma unroll
    for (int n = 0; n < LIN_ROWS; n++) red[wid][n][lane] = s[n];
    __syncthreads();
    if (wid < N && i < I) {  // warp n: row n's sums over the 32 warps, in order
        float v = red[0][wid][lane];
        for (int k = 1; k < 32; k++) v += red[k][wid][lane];
        float* d = dinp + (i64)wid * I + i;
        *d = acc ? *d + v : v;
    }
}

extern "C" __global__ void rows_sum_accum(float* db, const float* dout, int N, int O) {
    for (int o = blockIdx.x * blockDim.x + threadIdx.x; o < O; o += gridDim.x * blockDim.x) {
        double t = 0.0;
        for (int n = 0; n < N; n++) t += (double)dout[(i64)n * O + o];
        db[o] += (float)t;
    }
}
