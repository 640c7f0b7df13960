// groupnorm.cu: GroupNorm (eps given, affine) forward and backward, optionally fused with SiLU,
// for both layouts. Semantics: torch.nn.GroupNorm / crates/meddpm/src/cpu (biased variance).
//
// Forward  = chan_stats_* (reduce.cu, many blocks per group) -> gn_stats_finalize (one block per
//            group, combining the chunk partials in double) -> gn_apply (elementwise).
// Backward = chan_gnbwd_* -> gn_bwd_finalize (dgamma, dbeta and two per-(n, g) coefficients)
//            -> gn_bwd_apply (elementwise). With xhat = (x - mu) * r and g = dL/dy:
//   dx = r * (gamma_c * g - m1 - xhat * m2),  m1 = mean_group(gamma*g),  m2 = mean_group(gamma*g*xhat).

// grid G, block 256 (loops over n). Writes mean[n*G + g], rstd[n*G + g].
extern "C" __global__ void gn_stats_finalize(const float* part, float* mean, float* rstd, int N, int C, i64 S, int G,
                                             int chunk_len, int nchunks, float eps) {
    __shared__ double sh[32];
    int g = blockIdx.x, cpg = C / G;
    int items = nchunks * cpg;
    double total = (double)S * cpg;
    for (int n = 0; n < N; n++) {
        double sm = 0.0;
        for (int j = threadIdx.x; j < items; j += blockDim.x) {
            int k = j / cpg, c = g * cpg + j % cpg;
            i64 cnt = min((i64)chunk_len, S - (i64)k * chunk_len);
            sm += (double)cnt * (double)part[(((i64)n * nchunks + k) * C + c) * 2];
        }
        double mu = block_sum_d(sm, sh) / total;
        double m2 = 0.0;
        for (int j = threadIdx.x; j < items; j += blockDim.x) {
            int k = j / cpg, c = g * cpg + j % cpg;
            i64 cnt = min((i64)chunk_len, S - (i64)k * chunk_len);
            i64 idx = (((i64)n * nchunks + k) * C + c) * 2;
            double d = (double)part[idx] - mu;
            m2 += (double)part[idx + 1] + (double)cnt * d * d;
        }
        m2 = block_sum_d(m2, sh);
        if (threadIdx.x == 0) {
            mean[n * G + g] = (float)mu;
            rstd[n * G + g] = (float)(1.0 / sqrt(m2 / total + (double)eps));
        }
    }
}

// out = (x - mu) * r * gamma + beta; when act != null also act = silu(out).
extern "C" __global__ void gn_apply(const float* x, const float* mean, const float* rstd, const float* gamma,
                                    const float* beta, float* out, float* act, int C, i64 S, int G, i64 total, int cl) {
    int cpg = C / G;
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        int ng = sample_of(i, (i64)C * S) * G + c / cpg;
        float v = (x[i] - mean[ng]) * rstd[ng] * gamma[c] + beta[c];
        out[i] = v;
        if (act) act[i] = v * sigmoid_f(v);
    }
}

// grid G, block 256. dgamma[c] += sum_n r*B, dbeta[c] += sum_n A; coef[(n*G+g)*2] = (m1, m2).
extern "C" __global__ void gn_bwd_finalize(const float* part, const float* rstd, const float* gamma, float* dgamma,
                                           float* dbeta, float* coef, int N, int C, i64 S, int G, int nchunks) {
    __shared__ double sh[32];
    int g = blockIdx.x, cpg = C / G;
    double inv = 1.0 / ((double)S * cpg);
    for (int cc = 0; cc < cpg; cc++) {
        int c = g * cpg + cc;
        double ta = 0.0, tb = 0.0;
        for (int n = 0; n < N; n++) {
            double a = 0.0, b = 0.0;
            for (int k = threadIdx.x; k < nchunks; k += blockDim.x) {
                i64 idx = (((i64)n * nchunks + k) * C + c) * 2;
                a += (double)part[idx];
                b += (double)part[idx + 1];
            }
            a = block_sum_d(a, sh);
            b = block_sum_d(b, sh);
            double r = (double)rstd[n * G + g];
            ta += a;
            tb += b * r;
            if (threadIdx.x == 0) {
                double m1 = (double)gamma[c] * a * inv, m2 = (double)gamma[c] * b * r * inv;
                float* cf = coef + ((i64)n * G + g) * 2;
                cf[0] = cc == 0 ? (float)m1 : cf[0] + (float)m1;
                cf[1] = cc == 0 ? (float)m2 : cf[1] + (float)m2;
            }
        }
        if (threadIdx.x == 0) {
            dgamma[c] += (float)tb;
            dbeta[c] += (float)ta;
        }
    }
}

// dx = r * (gamma_c * g - m1 - xhat * m2), g = dout (* silu'(y) when y != null).
extern "C" __global__ void gn_bwd_apply(const float* dout, const float* x, const float* y, const float* mean,
                                        const float* rstd, const float* gamma, const float* coef, float* dx, int C,
                                        i64 S, int G, i64 total, int cl, int accum) {
    int cpg = C / G;
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        int ng = sample_of(i, (i64)C * S) * G + c / cpg;
        float g = dout[i];
        if (y) g *= silu_grad(y[i]);
        float r = rstd[ng];
        float xh = (x[i] - mean[ng]) * r;
        float v = r * (gamma[c] * g - coef[2 * ng] - xh * coef[2 * ng + 1]);
        dx[i] = accum ? dx[i] + v : v;
    }
}

// Vectorised versions of gn_apply / gn_bwd_apply: four consecutive elements per thread with 16-byte
// accesses. Host condition: total % 4 == 0 and (NDHWC: C % 4 == 0, the four are channels c..c+3 of
// one voxel; NCDHW: S % 4 == 0, the four share channel c).
extern "C" __global__ void gn_apply4(const float* x, const float* mean, const float* rstd, const float* gamma,
                                     const float* beta, float* out, float* act, int C, i64 S, int G, i64 total, int cl) {
    int cpg = C / G;
    i64 total4 = total / 4;
    GRID_STRIDE(i4, total4) {
        i64 i = 4 * i4;
        int c = chan_of(i, C, S, cl);
        int nG = sample_of(i, (i64)C * S) * G;
        float4 xv = reinterpret_cast<const float4*>(x)[i4];
        float xs[4] = {xv.x, xv.y, xv.z, xv.w}, ys[4], as[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int cj = cl ? c + j : c;
            int ng = nG + cj / cpg;
            float v = (xs[j] - mean[ng]) * rstd[ng] * gamma[cj] + beta[cj];
            ys[j] = v;
            as[j] = v * sigmoid_f(v);
        }
        reinterpret_cast<float4*>(out)[i4] = make_float4(ys[0], ys[1], ys[2], ys[3]);
        if (act) reinterpret_cast<float4*>(act)[i4] = make_float4(as[0], as[1], as[2], as[3]);
    }
}

extern "C" __global__ void gn_bwd_apply4(const float* dout, const float* x, const float* y, const float* mean,
                                         const float* rstd, const float* gamma, const float* coef, float* dx, int C,
                                         i64 S, int G, i64 total, int cl, int accum) {
    int cpg = C / G;
    i64 total4 = total / 4;
    GRID_STRIDE(i4, total4) {
        i64 i = 4 * i4;
        int c = chan_of(i, C, S, cl);
        int nG = sample_of(i, (i64)C * S) * G;
        float4 dv = reinterpret_cast<const float4*>(dout)[i4];
        float4 xv = reinterpret_cast<const float4*>(x)[i4];
        float ds[4] = {dv.x, dv.y, dv.z, dv.w}, xs[4] = {xv.x, xv.y, xv.z, xv.w}, r4[4];
        if (y) {
            float4 yv = reinterpret_cast<const float4*>(y)[i4];
            ds[0] *= silu_grad(yv.x);
            ds[1] *= silu_grad(yv.y);
            ds[2] *= silu_grad(yv.z);
            ds[3] *= silu_grad(yv.w);
        }
        float4 old = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (accum) old = reinterpret_cast<const float4*>(dx)[i4];
        float os[4] = {old.x, old.y, old.z, old.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int cj = cl ? c + j : c;
            int ng = nG + cj / cpg;
            float r = rstd[ng];
            float xh = (xs[j] - mean[ng]) * r;
            r4[j] = os[j] + r * (gamma[cj] * ds[j] - coef[2 * ng] - xh * coef[2 * ng + 1]);
        }
        reinterpret_cast<float4*>(dx)[i4] = make_float4(r4[0], r4[1], r4[2], r4[3]);
    }
}
