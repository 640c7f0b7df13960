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
        int ng = (int)(i / ((i64)C * S)) * G + c / cpg;
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
        int ng = (int)(i / ((i64)C * S)) * G + c / cpg;
        float g = dout[i];
        if (y) g *= silu_grad(y[i]);
        float r = rstd[ng];
        float xh = (x[i] - mean[ng]) * r;
        float v = r * (gamma[c] * g - coef[2 * ng] - xh * coef[2 * ng + 1]);
        dx[i] = accum ? dx[i] + v : v;
    }
}
