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

// out = (x - mu) * r * gamma + beta; when act != null also act = silu(out) (from the unrounded value).
// x, out, act: activations of the type `bf` selects; the rest f32.
template <typename T>
__device__ void gn_apply_t(const void* xv, const float* mean, const float* rstd, const float* gamma,
                           const float* beta, void* outv, void* actv, int C, i64 S, int G, i64 total, int cl) {
    const T* x = (const T*)xv;
    T *out = (T*)outv, *act = (T*)actv;
    int cpg = C / G;
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        int ng = sample_of(i, (i64)C * S) * G + c / cpg;
        float v = (ld(x, i) - mean[ng]) * rstd[ng] * gamma[c] + beta[c];
        st(out, i, v);
        if (act) st(act, i, v * sigmoid_f(v));
    }
}
extern "C" __global__ void gn_apply(const void* x, const float* mean, const float* rstd, const float* gamma,
                                    const float* beta, void* out, void* act, int C, i64 S, int G, i64 total, int cl,
                                    int bf) {
    DISPATCH(bf, gn_apply_t, x, mean, rstd, gamma, beta, out, act, C, S, G, total, cl);
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

// dx = r * (gamma_c * g - m1 - xhat * m2), g = dout (* silu'(y) when y != null). dout, x, y, dx:
// activations of the type `bf` selects. dx may be dout itself (each element is read before it is
// written, by the same thread).
template <typename T>
__device__ void gn_bwd_apply_t(const void* doutv, const void* xv, const void* yv, const float* mean,
                               const float* rstd, const float* gamma, const float* coef, void* dxv, int C, i64 S,
                               int G, i64 total, int cl, int accum) {
    const T *dout = (const T*)doutv, *x = (const T*)xv, *y = (const T*)yv;
    T* dx = (T*)dxv;
    int cpg = C / G;
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        int ng = sample_of(i, (i64)C * S) * G + c / cpg;
        float g = ld(dout, i);
        if (y) g *= silu_grad(ld(y, i));
        float r = rstd[ng];
        float xh = (ld(x, i) - mean[ng]) * r;
        float v = r * (gamma[c] * g - coef[2 * ng] - xh * coef[2 * ng + 1]);
        st(dx, i, accum ? ld(dx, i) + v : v);
    }
}
extern "C" __global__ void gn_bwd_apply(const void* dout, const void* x, const void* y, const float* mean,
                                        const float* rstd, const float* gamma, const float* coef, void* dx, int C,
                                        i64 S, int G, i64 total, int cl, int accum, int bf) {
    DISPATCH(bf, gn_bwd_apply_t, dout, x, y, mean, rstd, gamma, coef, dx, C, S, G, total, cl, accum);
}

// Vectorised versions of gn_apply / gn_bwd_apply: four consecutive elements per thread (16-byte f32
// or 8-byte bf16 accesses). Host condition: total % 4 == 0 and (NDHWC: C % 4 == 0, the four are
// channels c..c+3 of one voxel; NCDHW: S % 4 == 0, the four share channel c).
template <typename T>
__device__ void gn_apply4_t(const void* xv, const float* mean, const float* rstd, const float* gamma,
                            const float* beta, void* outv, void* actv, int C, i64 S, int G, i64 total, int cl) {
    const T* x = (const T*)xv;
    T *out = (T*)outv, *act = (T*)actv;
    int cpg = C / G;
    i64 total4 = total / 4;
    GRID_STRIDE(i4, total4) {
        i64 i = 4 * i4;
        int c = chan_of(i, C, S, cl);
        int nG = sample_of(i, (i64)C * S) * G;
        float xs[4], ys[4], as[4];
        ld4(x, i4, xs);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int cj = cl ? c + j : c;
            int ng = nG + cj / cpg;
            float v = (xs[j] - mean[ng]) * rstd[ng] * gamma[cj] + beta[cj];
            ys[j] = v;
            as[j] = v * sigmoid_f(v);
        }
        st4(out, i4, ys);
        if (act) st4(act, i4, as);
    }
}
extern "C" __global__ void gn_apply4(const void* x, const float* mean, const float* rstd, const float* gamma,
                                     const float* beta, void* out, void* act, int C, i64 S, int G, i64 total, int cl,
                                     int bf) {
    DISPATCH(bf, gn_apply4_t, x, mean, rstd, gamma, beta, out, act, C, S, G, total, cl);
}

template <typename T>
__device__ void gn_bwd_apply4_t(const void* doutv, const void* xv, const void* yv, const float* mean,
                                const float* rstd, const float* gamma, const float* coef, void* dxv, int C, i64 S,
                                int G, i64 total, int cl, int accum) {
    const T *dout = (const T*)doutv, *x = (const T*)xv, *y = (const T*)yv;
    T* dx = (T*)dxv;
    int cpg = C / G;
    i64 total4 = total / 4;
    GRID_STRIDE(i4, total4) {
        i64 i = 4 * i4;
        int c = chan_of(i, C, S, cl);
        int nG = sample_of(i, (i64)C * S) * G;
        float ds[4], xs[4], os[4] = {0.0f, 0.0f, 0.0f, 0.0f}, r4[4];
        ld4(dout, i4, ds);
        ld4(x, i4, xs);
        if (y) {
            float ys[4];
            ld4(y, i4, ys);
#pragma unroll
            for (int j = 0; j < 4; j++) ds[j] *= silu_grad(ys[j]);
        }
        if (accum) ld4(dx, i4, os);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int cj = cl ? c + j : c;
            int ng = nG + cj / cpg;
            float r = rstd[ng];
            float xh = (xs[j] - mean[ng]) * r;
            r4[j] = os[j] + r * (gamma[cj] * ds[j] - coef[2 * ng] - xh * coef[2 * ng + 1]);
        }
        st4(dx, i4, r4);
    }
}
extern "C" __global__ void gn_bwd_apply4(const void* dout, const void* x, const void* y, const float* mean,
                                         const float* rstd, const float* gamma, const float* coef, void* dx, int C,
                                         i64 S, int G, i64 total, int cl, int accum, int bf) {
    DISPATCH(bf, gn_bwd_apply4_t, dout, x, y, mean, rstd, gamma, coef, dx, C, S, G, total, cl, accum);
}
