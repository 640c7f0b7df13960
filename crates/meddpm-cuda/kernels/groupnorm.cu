// groupnorm.cu: GroupNorm (eps given, affine) forward and backward, optionally fused with SiLU,
// for both layouts. Semantics: torch.nn.GroupNorm / crates/meddpm/src/cpu (biased variance).
//
// Forward  = chan_stats_* (reduce.cu, many blocks per group) -> gn_stats_finalize (one block per
//            group, combining the chunk partials in double) -> gn_apply (elementwise; with SiLU only
//            the SiLU output is written).
// Backward = chan_gnbwd_* -> gn_bwd_finalize (dgamma, dbeta and two per-(n, g) coefficients; with
//            chan_gnbwd3_*'s third sum also dx's channel sums, see gn_bwd_finalize)
//            -> gn_bwd_apply (elementwise); with SiLU both recompute y = GN(x) from the saved
//            statistics instead of reading a stored GroupNorm output. With xhat = (x - mu) * r and
//            g = dL/dy:
//   dx = r * (gamma_c * g - m1 - xhat * m2),  m1 = mean_group(gamma*g),  m2 = mean_group(gamma*g*xhat).
//
// Input offset (`off`, f32 [N*C], may be null): the GroupNorm's input is x + off[n*C + c], summed
// in f32 and never stored (the ResBlock's time-embedding add, folded in). The statistics pass
// reads x alone: gn_stats_finalize adds the offset to each chunk's channel mean (the chunk's M2
// does not move), and every elementwise pass uses mu - off[n*C + c] as the channel's mean.

// grid G, block 256 (loops over n). Writes mean[n*G + g], rstd[n*G + g] of x + off. One pass over
// the chunk partials (count c_k, mean m_k, M2_k): in double, sum c_k*m_k and sum (M2_k + c_k*m_k^2),
// one block reduction of both; var = the second / count - mu^2 (double: the f32 partials' own
// rounding, ~1e-7 relative, dominates the cancellation by far). chunk_len 0: the partials carry
// their counts, (m_k, M2_k, c_k) per (n, chunk, c) (a conv epilogue's tiles, conv3d_wgmma_fwd_gn).
extern "C" __global__ void gn_stats_finalize(const float* part, const float* off, float* mean, float* rstd, int N,
                                             int C, i64 S, int G, int chunk_len, int nchunks, float eps) {
    __shared__ double2 sh[32];
    int g = blockIdx.x, cpg = C / G;
    int items = nchunks * cpg;
    double total = (double)S * cpg;
    const int stride = chunk_len ? 2 : 3;
    for (int n = 0; n < N; n++) {
        double s1 = 0.0, s2 = 0.0;
        for (int j = threadIdx.x; j < items; j += blockDim.x) {
            int k = j / cpg, c = g * cpg + j % cpg;
            i64 idx = (((i64)n * nchunks + k) * C + c) * stride;
            double cnt = chunk_len ? (double)min((i64)chunk_len, S - (i64)k * chunk_len) : (double)part[idx + 2];
            double m = (double)part[idx] + (off ? (double)off[n * C + c] : 0.0);
            s1 += cnt * m;
            s2 += (double)part[idx + 1] + cnt * m * m;
        }
        block_sum_d2(s1, s2, sh);
        if (threadIdx.x == 0) {
            double mu = s1 / total;
            double var = fmax(s2 / total - mu * mu, 0.0);
            mean[n * G + g] = (float)mu;
            rstd[n * G + g] = (float)(1.0 / sqrt(var + (double)eps));
        }
    }
}

// grid G, block 256. dgamma[c] += sum_n r*B, dbeta[c] += sum_n A; coef[(n*G+g)*2] = (m1, m2).
// part holds `stride` floats per (n, chunk, c): (A, B) partials, and with stride 3 also U =
// sum (x - mu) (chan_gnbwd3_*). With dsum (stride 3, N * C/G <= GNB_MAXNC): dsum[n*C + c] = the
// channel sum of dx, r * (gamma_c * A - S * m1 - m2 * r * U) (sum over the channel's voxels of
// dx = r * (gamma_c * g - m1 - xhat * m2), xhat = (x - mu) * r), no pass over dx needed.
// The group's (channel, sample) items go a warp each (the warp sums the item's chunk partials in
// double, one shuffle reduction: no block barrier per item; with an item at a time and a block
// reduction each, a training step's 39 calls averaged 11 µs, 16 items a group at 512 channels), in rounds of whole channels over a
// slice of at most GNB_MAXNC samples; then one thread a sample adds the round's channels to its
// coefficients and one thread a channel adds the slice's samples to dgamma and dbeta, each in the
// order the one-item-at-a-time version did (bit for bit its results, up to the double sums' order).
#define GNB_MAXNC 256
extern "C" __global__ void gn_bwd_finalize(const float* part, const float* rstd, const float* gamma, float* dgamma,
                                           float* dbeta, float* coef, int N, int C, i64 S, int G, int nchunks,
                                           int stride, float* dsum) {
    __shared__ double ra[GNB_MAXNC], rb[GNB_MAXNC], ru[GNB_MAXNC];
    __shared__ float rm1[GNB_MAXNC], rm2[GNB_MAXNC];
    int g = blockIdx.x, cpg = C / G;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5, t = threadIdx.x;
    double inv = 1.0 / ((double)S * cpg);
    for (int n0 = 0; n0 < N; n0 += GNB_MAXNC) {
        int ns = min(GNB_MAXNC, N - n0), cpr = max(1, GNB_MAXNC / ns);
        for (int cc0 = 0; cc0 < cpg; cc0 += cpr) {
            int ncr = min(cpr, cpg - cc0), count = ncr * ns;
            // item i: channel cc0 + i / ns, sample n0 + i % ns
            for (int i = wid; i < count; i += nw) {
                int n = n0 + i % ns, c = g * cpg + cc0 + i / ns;
                double a = 0.0, b = 0.0, u = 0.0;
                for (int k = lane; k < nchunks; k += 32) {
                    i64 idx = (((i64)n * nchunks + k) * C + c) * stride;
                    a += (double)part[idx];
                    b += (double)part[idx + 1];
                    if (dsum) u += (double)part[idx + 2];
                }
                a = warp_sum_d(a);
                b = warp_sum_d(b);
                if (dsum) u = warp_sum_d(u);
                if (lane == 0) {
                    double r = (double)rstd[n * G + g];
                    ra[i] = a;
                    rb[i] = b * r;
                    ru[i] = u;
                    rm1[i] = (float)((double)gamma[c] * a * inv);
                    rm2[i] = (float)((double)gamma[c] * b * r * inv);
                }
            }
            __syncthreads();
            if (t < ns) {  // sample n0 + t: its coefficients over the round's channels, in order
                float* cf = coef + ((i64)(n0 + t) * G + g) * 2;
                float m1 = cc0 == 0 ? 0.0f : cf[0], m2 = cc0 == 0 ? 0.0f : cf[1];
                for (int k = 0; k < ncr; k++) {
                    int i = k * ns + t;
                    m1 = cc0 + k == 0 ? rm1[i] : m1 + rm1[i];
                    m2 = cc0 + k == 0 ? rm2[i] : m2 + rm2[i];
                }
                cf[0] = m1;
                cf[1] = m2;
            }
            if (t < ncr) {  // channel cc0 + t: dgamma and dbeta over the slice's samples, in order
                double ta = 0.0, tb = 0.0;
                for (int k = 0; k < ns; k++) {
                    ta += ra[t * ns + k];
                    tb += rb[t * ns + k];
                }
                int c = g * cpg + cc0 + t;
                dgamma[c] += (float)tb;
                dbeta[c] += (float)ta;
            }
            __syncthreads();  // the round's sums read (and coef written) before the next round
        }
    }
    if (!dsum) return;
    // dsum: N * cpg <= GNB_MAXNC, so one round: item cc * N + n holds channel cc's A and U
    for (int j = t; j < N * cpg; j += blockDim.x) {
        int n = j / cpg, cc = j % cpg, c = g * cpg + cc, i = cc * N + n;
        const float* cf = coef + ((i64)n * G + g) * 2;
        double r = (double)rstd[n * G + g], m1 = (double)cf[0], m2 = (double)cf[1];
        dsum[n * C + c] = (float)(r * ((double)gamma[c] * ra[i] - (double)S * m1 - m2 * r * ru[i]));
    }
}

// out = GN(x + off) (when out != null) and act = silu(GN(x + off)) (when act != null; from the
// unrounded value). x, out, act: activations of the type `bf` selects; V elements per access
// (RowLaunch, common.cu); off: see above.
template <typename T, int V>
__device__ void gn_apply_t(const void* xv, const float* mean, const float* rstd, const float* gamma,
                           const float* beta, const float* off, void* outv, void* actv, int C, i64 S, int G,
                           int cl) {
    const T* x = (const T*)xv;
    T *out = (T*)outv, *act = (T*)actv;
    Row r = row_geom(C, S, V, cl);
    int cpg = C / G;
    float sc[V], sh[V];
#pragma unroll
    for (int j = 0; j < V; j++) {
        int c = r.c0 + j * r.cstep, ng = r.n * G + c / cpg;
        gn_affine(rstd[ng], gamma[c], beta[c], mean[ng] - (off ? off[r.n * C + c] : 0.0f), sc[j], sh[j]);
    }
    // two vectors per iteration, both loads issued before any store: twice the bytes in flight
    // per thread (one at a time reached ~2.6 TB/s on an H200)
    for (i64 v = r.start; v < r.nvec; v += 2 * r.step) {
        float a[2][V];
        bool two = v + r.step < r.nvec;
#pragma unroll
        for (int u = 0; u < 2; u++)
            if (u == 0 || two) ldv<V>(x, r.base + (v + u * r.step) * V, a[u]);
#pragma unroll
        for (int u = 0; u < 2; u++) {
            if (u == 1 && !two) break;
            i64 i = r.base + (v + u * r.step) * V;
#pragma unroll
            for (int j = 0; j < V; j++) a[u][j] = gn_y(a[u][j], sc[j], sh[j]);
            if (out) stv<V>(out, i, a[u]);
            if (act) {
#pragma unroll
                for (int j = 0; j < V; j++) a[u][j] = a[u][j] * sigmoid_t<T>(a[u][j]);
                stv<V>(act, i, a[u]);
            }
        }
    }
}
extern "C" __global__ void gn_apply(const void* x, const float* mean, const float* rstd, const float* gamma,
                                    const float* beta, const float* off, void* out, void* act, int C, i64 S, int G,
                                    int cl, int bf, int V) {
    DISPATCH_V(bf, V, gn_apply_t, x, mean, rstd, gamma, beta, off, out, act, C, S, G, cl);
}

// dx = r·(γ·g − m1 − x̂·m2) = A·g + B·x + K with A = r·γ, B = −r²·m2, K = r·(μ·r·m2 − m1), per channel;
// g = dout, times silu'(y) with y = GN(x + off) recomputed from the statistics when `silu` (beta
// given); μ is the channel's mean less its offset.
// dout, x, dx: activations of the type `bf` selects; dx may be dout itself (each element is read
// before it is written, by the same thread). `act` (may be null; only with `silu`): also writes
// silu(y), the forward's output, as gn_apply computes it (the recomputation the convolution's
// weight gradient needs, riding in this pass); act may be x itself (same thread, read first).
// SPLIT (gn_bwd_apply_split): dx is a concatenation's gradient delivered to its two parts, dx
// holding channels [0, ca) and dx2 channels [ca, C) (each in the layout, (N, ca, ...) and
// (N, C − ca, ...)); `accum` bit 0 adds into dx, bit 1 into dx2. In NDHWC a vector never straddles
// the two (ca % V == 0, checked by the host) and the launch keeps each thread on one channel.
// With `xh` (SPLIT only) x is not read either: it is the concatenation cat([xh + xbias, xs]) (xbias
// f32, ca long, may be null), read from its parts where the gradient goes and rounded as stored
// (reduce.cu's cat_load), so no concatenation is built; act is then a separate buffer.
// `res` (may be null; gn_bwd_apply only): dx (per `accum`) += res first, then this pass's value —
// a ResBlock's identity-skip gradient folded in (Backend::groupnorm_silu_backward_act_res), with
// the intermediate sum rounded as stored: the same values as add_assign (or a copy) then the pass.
template <typename T, int V, bool SPLIT>
__device__ void gn_bwd_apply_body(const void* doutv, const void* xv, const float* mean, const float* rstd,
                                  const float* gamma, const float* beta, const float* off, const float* coef,
                                  void* dxv, void* actv, int C, i64 S, int G, int cl, int accum, void* dx2v,
                                  int ca, const void* xhv, const void* xsv, const float* xbias, const void* resv) {
    const T *dout = (const T*)doutv, *x = (const T*)xv, *res = (const T*)resv;
    T *dx = (T*)dxv, *act = (T*)actv;
    Row r = row_geom(C, S, V, cl);
    int cpg = C / G;
    // (A, B, K, sh) per channel in dynamic shared memory (C entries in NDHWC, the block's one
    // channel in NCDHW), read per vector with lds4: as registers (5·V floats a thread) they held
    // the split variant at 121 registers, 24 % occupancy and 2.2 TB/s on the H200 (ncu). NDHWC
    // entry of channel c: (c % V)·lanes + c / V, so that the lanes of a warp read consecutive
    // entries (a thread's V channels in a row were V entries apart: a V-way bank conflict).
    extern __shared__ float4 gn_bwd_tab[];
    for (int t = threadIdx.x; t < (cl ? C : 1); t += blockDim.x) {
        int c = cl ? t : r.c0, ng = r.n * G + c / cpg;
        float rs = rstd[ng], m1 = coef[2 * ng], m2 = coef[2 * ng + 1];
        float mu = mean[ng] - (off ? off[r.n * C + c] : 0.0f);
        float A, sh = 0.0f;
        gn_affine(rs, gamma[c], beta ? beta[c] : 0.0f, mu, A, sh);
        int e = cl ? (c % V) * r.lanes + c / V : 0;
        gn_bwd_tab[e] = make_float4(A, -rs * rs * m2, rs * (mu * rs * m2 - m1), beta ? sh : 0.0f);
    }
    __syncthreads();
    const float4* tab = gn_bwd_tab + (cl ? r.c0 / V : 0);
    const int tstep = cl ? r.lanes : 0;
    // where this thread's vectors go: dx at the same index, or (SPLIT) its part at
    // obase + (vector's voxel)·ocs (NDHWC: the part's channel count; NCDHW: V per vector)
    T* out = dx;
    int acc = accum & 1;
    i64 obase = 0, ocs = 0;
    // where x comes from: x at i, or (xh given) the part at the gradient's index plus its bias
    const T* xin = x;
    bool xpart = false;
    const float* xb = nullptr;  // the bias of this thread's part, if any (read per vector: registers)
    if (SPLIT) {
        bool lo = r.c0 < ca;
        int cp = lo ? ca : C - ca, cc = lo ? r.c0 : r.c0 - ca;
        if (xhv) {
            xpart = true;
            xin = lo ? (const T*)xhv : (const T*)xsv;
            xb = lo ? xbias : nullptr;
        }
        out = lo ? dx : (T*)dx2v;
        acc = lo ? (accum & 1) : (accum >> 1) & 1;
        if (cl) {
            obase = (i64)r.n * S * cp + cc;
            ocs = cp;
        } else {
            obase = ((i64)r.n * cp + cc) * S;
            ocs = V;
        }
    }
    // element indices stepped, not recomputed from the vector index (64-bit registers)
    const i64 iend = r.base + r.nvec * V, istep = r.step * V;
    const i64 ostep = SPLIT ? (r.step / r.lanes) * ocs : istep;
    i64 i = r.base + r.start * V, oi = SPLIT ? obase + (r.start / r.lanes) * ocs : i;
    for (; i < iend; i += istep, oi += ostep) {
        float g[V], xs[V], o[V], y[V];
        ldv<V>(dout, i, g);
        if (SPLIT && xpart) {
            ldv<V>(xin, oi, xs);
            if (xb) {
#pragma unroll
                for (int j = 0; j < V; j++) xs[j] = as_stored<T>(xs[j] + xb[r.c0 + j * r.cstep]);
            }
        } else {
            ldv<V>(x, i, xs);
        }
        if (acc) ldv<V>(out, oi, o);
        // res (not SPLIT): a ResBlock's identity-skip gradient, added first and rounded as stored,
        // as add_assign (or copy) then this pass would: bit for bit the two calls
        if (!SPLIT && res) {
            float rr[V];
            ldv<V>(res, i, rr);
#pragma unroll
            for (int j = 0; j < V; j++) o[j] = acc ? as_stored<T>(o[j] + rr[j]) : rr[j];
        }
        const int oacc = acc || (!SPLIT && res);
#pragma unroll
        for (int j = 0; j < V; j++) {
            float4 f = lds4(tab + j * tstep);
            if (beta) {
                // y = GN(x); g·silu'(y) and silu(y) share one sigmoid
                float yy = gn_y(xs[j], f.x, f.w), sg = sigmoid_t<T>(yy);
                g[j] *= sg * (1.0f + yy * (1.0f - sg));
                y[j] = yy * sg;
            }
            float d = f.x * g[j] + f.y * xs[j] + f.z;
            o[j] = oacc ? o[j] + d : d;
        }
        if (beta && act) stv<V>(act, i, y);
        stv<V>(out, oi, o);
    }
}
template <typename T, int V>
__device__ void gn_bwd_apply_t(const void* dout, const void* x, const float* mean, const float* rstd,
                               const float* gamma, const float* beta, const float* off, const float* coef, void* dx,
                               void* act, int C, i64 S, int G, int cl, int accum, const void* res) {
    gn_bwd_apply_body<T, V, false>(dout, x, mean, rstd, gamma, beta, off, coef, dx, act, C, S, G, cl, accum, 0, 0, 0,
                                   0, 0, res);
}
template <typename T, int V>
__device__ void gn_bwd_apply_split_t(const void* dout, const void* x, const float* mean, const float* rstd,
                                     const float* gamma, const float* beta, const float* off, const float* coef,
                                     void* dx, void* act, int C, i64 S, int G, int cl, int accum, void* dx2, int ca,
                                     const void* xh, const void* xs, const float* xbias) {
    gn_bwd_apply_body<T, V, true>(dout, x, mean, rstd, gamma, beta, off, coef, dx, act, C, S, G, cl, accum, dx2, ca,
                                  xh, xs, xbias, nullptr);
}
extern "C" __global__ void gn_bwd_apply(const void* dout, const void* x, const float* mean, const float* rstd,
                                        const float* gamma, const float* beta, const float* off, const float* coef,
                                        void* dx, void* act, int C, i64 S, int G, int cl, int accum, int bf,
                                        int V, const void* res) {
    DISPATCH_V(bf, V, gn_bwd_apply_t, dout, x, mean, rstd, gamma, beta, off, coef, dx, act, C, S, G, cl, accum, res);
}
extern "C" __global__ void __launch_bounds__(256, 3) gn_bwd_apply_split(const void* dout, const void* x, const float* mean, const float* rstd,
                                              const float* gamma, const float* beta, const float* off,
                                              const float* coef, void* dx, void* act, int C, i64 S, int G, int cl,
                                              int accum, int bf, int V, void* dx2, int ca, const void* xh,
                                              const void* xs, const float* xbias) {
    DISPATCH_V(bf, V, gn_bwd_apply_split_t, dout, x, mean, rstd, gamma, beta, off, coef, dx, act, C, S, G, cl, accum,
               dx2, ca, xh, xs, xbias);
}
