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

// ---- the finalizers: chunk partials → per-group results ------------------------------------------
// grid (G, Q), block FIN_T. Block (g, q) takes chunks [q·kc, min((q+1)·kc, nchunks)) of group g's
// partials (kc = ceil(nchunks / Q)), thread (r, cc) for a slice of nc channels (the backward pads
// nc to a power of two up to 32): chunk k0 + r, k0 + r + R, ... of channel cc, so that a warp's
// loads cover whole chunk islands (one group's channels are consecutive within a chunk). Its sums
// go through a fixed-order reduction (a block reduction for the statistics; warp shuffles, or a
// shared tree past 32 channels, for the backward) to ws (double), and the last of the group's Q
// blocks to arrive (a counter per group in
// `cnt`, set back to 0 by that block) combines the Q block sums in the order q = 0 .. Q-1 and
// writes the group's results. Every sum has a fixed order: the results do not depend on which
// block ran when. (One block a group reading ~1000 chunks a channel, lane-strided, was bound by
// L1 wavefronts: 32 sectors a load instruction, 10-16 µs a call at 128³.)
#define FIN_T 256

// The last of the Q blocks of group g to call this gets true (its reads of the others' ws writes
// then go through L2: __ldcg). Every thread calls it after writing its share of ws.
__device__ bool fin_last(unsigned* cnt, int g) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned prev = atomicAdd(&cnt[g], 1u);
        last = prev == gridDim.y - 1;
        if (last) cnt[g] = 0;  // every block of this grid has counted: ready for the next launch
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// Tree sum over rows r < R of v[r * nc + cc] (three arrays at once, v1/v2 may be null), result in
// row 0. Called by all threads of the block, after the rows are written.
__device__ void fin_tree(double* v0, double* v1, double* v2, int R, int nc) {
    __syncthreads();
    int t = threadIdx.x;
    for (int rc = R; rc > 1;) {
        int s = 1 << (31 - __clz(rc - 1));  // largest power of two below rc
        if (t < (rc - s) * nc) {
            v0[t] += v0[t + s * nc];
            if (v1) v1[t] += v1[t + s * nc];
            if (v2) v2[t] += v2[t + s * nc];
        }
        rc = s;
        __syncthreads();
    }
}

// mean and rstd of a group from its sums s1 = sum x, s2 = sum x^2 over `total` values.
__device__ __forceinline__ void fin_stats_out(float* mean, float* rstd, int k, double s1, double s2, double total,
                                              float eps) {
    double mu = s1 / total;
    double var = fmax(s2 / total - mu * mu, 0.0);
    mean[k] = (float)mu;
    rstd[k] = (float)(1.0 / sqrt(var + (double)eps));
}

// Writes mean[n*G + g], rstd[n*G + g] of x + off. The chunk partials are (count c_k, mean m_k,
// M2_k): in double, sum c_k*m_k and sum (M2_k + c_k*m_k^2) over the group's chunks and channels;
// var = the second / count - mu^2 (double: the f32 partials' own rounding, ~1e-7 relative,
// dominates the cancellation by far). chunk_len 0: the partials carry their counts, (m_k, M2_k,
// c_k) per (n, chunk, c) (a conv epilogue's tiles, conv3d_wgmma_fwd_gn); else (m_k, M2_k) with
// c_k from chunk_len. ws: N·G·Q double2.
extern "C" __global__ void gn_stats_finalize(const float* part, const float* off, float* mean, float* rstd, int N,
                                             int C, i64 S, int G, int chunk_len, int nchunks, float eps,
                                             double2* ws, unsigned* cnt) {
    __shared__ double2 sh[32];
    const int g = blockIdx.x, q = blockIdx.y, Q = gridDim.y, cpg = C / G, t = threadIdx.x;
    const int kc = (nchunks + Q - 1) / Q, k0 = q * kc, k1 = min(nchunks, k0 + kc);
    const int stride = chunk_len ? 2 : 3;
    for (int n = 0; n < N; n++) {
        double s1 = 0.0, s2 = 0.0;
        for (int cb = 0; cb < cpg; cb += FIN_T) {
            const int nc = min(FIN_T, cpg - cb), R = FIN_T / nc, r = t / nc, c = g * cpg + cb + t % nc;
            if (r >= R) continue;
            const double o = off ? (double)off[n * C + c] : 0.0;
#pragma unroll 8
            for (int k = k0 + r; k < k1; k += R) {
                i64 idx = (((i64)n * nchunks + k) * C + c) * stride;
                double ck = chunk_len ? (double)min((i64)chunk_len, S - (i64)k * chunk_len) : (double)part[idx + 2];
                double m = (double)part[idx] + o;
                s1 += ck * m;
                s2 += (double)part[idx + 1] + ck * m * m;
            }
        }
        block_sum_d2(s1, s2, sh);
        if (Q == 1) {  // the block has the group's sums: no second phase
            if (t == 0) fin_stats_out(mean, rstd, n * G + g, s1, s2, (double)S * cpg, eps);
            continue;
        }
        if (t == 0) ws[((i64)g * N + n) * Q + q] = make_double2(s1, s2);
    }
    if (Q == 1 || !fin_last(cnt, g)) return;
    const double2* w = ws;
    for (int n = 0; n < N; n++) {
        double s1 = 0.0, s2 = 0.0;
        if (t < Q) {
            double2 v = __ldcg(w + ((i64)g * N + n) * Q + t);
            s1 = v.x;
            s2 = v.y;
        }
        block_sum_d2(s1, s2, sh);
        if (t == 0) fin_stats_out(mean, rstd, n * G + g, s1, s2, (double)S * cpg, eps);
    }
}

// dgamma[c] += sum_n r*B, dbeta[c] += sum_n A; coef[(n*G+g)*2] = (m1, m2).
// part holds `stride` floats per (n, chunk, c): (A, B) partials, and with stride 3 also U =
// sum (x - mu) (chan_gnbwd3_*). With dsum (stride 3, N * C/G <= GNB_MAXNC): dsum[n*C + c] = the
// channel sum of dx, r * (gamma_c * A - S * m1 - m2 * r * U) (sum over the channel's voxels of
// dx = r * (gamma_c * g - m1 - xhat * m2), xhat = (x - mu) * r), no pass over dx needed.
// ws: N·C·Q·3 doubles, the blocks' (A, B, U) sums of each (sample, channel). The last block: the
// group's (channel, sample) items go a warp each (the warp sums the item's Q block sums, one
// shuffle reduction), in rounds of whole channels over a slice of at most GNB_MAXNC samples; then
// one thread a sample adds the round's channels to its coefficients and one thread a channel adds
// the slice's samples to dgamma and dbeta, in order.
#define GNB_MAXNC FIN_T
extern "C" __global__ void gn_bwd_finalize(const float* part, const float* rstd, const float* gamma, float* dgamma,
                                           float* dbeta, float* coef, int N, int C, i64 S, int G, int nchunks,
                                           int stride, float* dsum, double* ws, unsigned* cnt) {
    __shared__ double ra[GNB_MAXNC], rb[GNB_MAXNC], ru[GNB_MAXNC];
    __shared__ double fa[GNB_MAXNC], fb[GNB_MAXNC], fu[GNB_MAXNC];  // local: the (n, cc) sums
    __shared__ float rm1[GNB_MAXNC], rm2[GNB_MAXNC], cm[2][GNB_MAXNC];
    __shared__ float sg[FIN_T], sdg[FIN_T], sdb[FIN_T], sr[FIN_T];
    const int g = blockIdx.x, q = blockIdx.y, Q = gridDim.y, cpg = C / G;
    // one block and few (sample, channel) items: the sums stay in shared memory (no ws round trip)
    const bool local = Q == 1 && N * cpg <= GNB_MAXNC;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5, t = threadIdx.x;
    // gamma, dgamma, dbeta and rstd read now, beside the partials, not as dependent round trips in
    // the tail (read before the tail's first barrier; this grid writes dgamma / dbeta only there)
    const bool pre = cpg <= FIN_T && N <= FIN_T;
    if (pre) {
        if (t < cpg) sg[t] = gamma[g * cpg + t], sdg[t] = dgamma[g * cpg + t], sdb[t] = dbeta[g * cpg + t];
        if (t < N) sr[t] = rstd[t * G + g];
    }
    const int kc = (nchunks + Q - 1) / Q, k0 = q * kc, k1 = min(nchunks, k0 + kc);
    // this block's chunks: (A, B, U) per (sample, channel) to ws (or fa/fb/fu). Up to 32 channels
    // a slice, the thread's channel is t % ncp (nc padded to a power of two): the rows of a channel
    // are summed by warp shuffles and then over the 8 warps in order (one barrier; the shared
    // tree's seven barriers made one-block calls ~1 µs slower than the old kernel); wider slices
    // take the tree.
    for (int n = 0; n < N; n++) {
        for (int cb = 0; cb < cpg; cb += FIN_T) {
            const int nc = min(FIN_T, cpg - cb);
            const int ncp = nc <= 32 ? 1 << (32 - __clz(nc - 1)) : nc;
            const int R = FIN_T / ncp, r = t / ncp, cl = t % ncp, cc = cb + cl;
            double a = 0.0, b = 0.0, u = 0.0;
            if (r < R && cl < nc) {
                const float* pc = part + ((i64)n * nchunks * C + g * cpg + cc) * stride;
#pragma unroll 8
                for (int k = k0 + r; k < k1; k += R) {
                    const float* p = pc + (i64)k * C * stride;
                    a += (double)p[0];
                    b += (double)p[1];
                    if (dsum) u += (double)p[2];
                }
            }
            double A, B, U;
            if (ncp <= 32) {
                for (int o = 16; o >= ncp; o >>= 1) {
                    a += __shfl_xor_sync(0xffffffffu, a, o);
                    b += __shfl_xor_sync(0xffffffffu, b, o);
                    u += __shfl_xor_sync(0xffffffffu, u, o);
                }
                if (lane < ncp) {
                    ra[wid * ncp + lane] = a;
                    rb[wid * ncp + lane] = b;
                    ru[wid * ncp + lane] = u;
                }
                __syncthreads();
                if (t < nc) {
                    A = ra[t], B = rb[t], U = ru[t];
                    for (int k = 1; k < nw; k++) A += ra[k * ncp + t], B += rb[k * ncp + t], U += ru[k * ncp + t];
                }
            } else {
                ra[t] = a;
                rb[t] = b;
                ru[t] = u;
                fin_tree(ra, rb, dsum ? ru : nullptr, R, nc);
                if (t < nc) A = ra[t], B = rb[t], U = ru[t];
            }
            if (t < nc && local) {
                fa[n * cpg + cb + t] = A;
                fb[n * cpg + cb + t] = B;
                fu[n * cpg + cb + t] = U;
            } else if (t < nc) {
                double* w = ws + ((((i64)g * N + n) * cpg + cb + t) * Q + q) * 3;
                w[0] = A;
                w[1] = B;
                w[2] = U;
            }
            __syncthreads();  // ra/rb/ru read before the next slice writes them
        }
    }
    if (Q > 1) {
        if (!fin_last(cnt, g)) return;
    } else {
        __syncthreads();  // this block's ws writes visible to its other threads
    }
    double inv = 1.0 / ((double)S * cpg);
    for (int n0 = 0; n0 < N; n0 += GNB_MAXNC) {
        int ns = min(GNB_MAXNC, N - n0), cpr = max(1, GNB_MAXNC / ns);
        for (int cc0 = 0; cc0 < cpg; cc0 += cpr) {
            int ncr = min(cpr, cpg - cc0), count = ncr * ns;
            // item i: channel cc0 + i / ns, sample n0 + i % ns
            for (int i = wid; i < count; i += nw) {
                int n = n0 + i % ns, cc = cc0 + i / ns, c = g * cpg + cc;
                double a = 0.0, b = 0.0, u = 0.0;
                if (local) {
                    a = fa[n * cpg + cc];
                    b = fb[n * cpg + cc];
                    u = fu[n * cpg + cc];
                } else {
                    const double* w = ws + (((i64)g * N + n) * cpg + cc) * Q * 3;
                    for (int k = lane; k < Q; k += 32) {
                        a += __ldcg(w + k * 3);
                        b += __ldcg(w + k * 3 + 1);
                        u += __ldcg(w + k * 3 + 2);
                    }
                    a = warp_sum_d(a);
                    b = warp_sum_d(b);
                    u = warp_sum_d(u);
                }
                if (lane == 0) {
                    double r = (double)(pre ? sr[n] : rstd[n * G + g]), gm = (double)(pre ? sg[cc] : gamma[c]);
                    ra[i] = a;
                    rb[i] = b * r;
                    ru[i] = u;
                    rm1[i] = (float)(gm * a * inv);
                    rm2[i] = (float)(gm * b * r * inv);
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
                if (n0 + t < GNB_MAXNC) {  // for dsum (which has N <= GNB_MAXNC: one round)
                    cm[0][n0 + t] = m1;
                    cm[1][n0 + t] = m2;
                }
            }
            if (t < ncr) {  // channel cc0 + t: dgamma and dbeta over the slice's samples, in order
                double ta = 0.0, tb = 0.0;
                for (int k = 0; k < ns; k++) {
                    ta += ra[t * ns + k];
                    tb += rb[t * ns + k];
                }
                int c = g * cpg + cc0 + t;
                if (pre) {  // N <= FIN_T: one round of samples, so the values read at the start
                    dgamma[c] = sdg[cc0 + t] + (float)tb;
                    dbeta[c] = sdb[cc0 + t] + (float)ta;
                } else {
                    dgamma[c] += (float)tb;
                    dbeta[c] += (float)ta;
                }
            }
            __syncthreads();  // the round's sums read (and coef written) before the next round
        }
    }
    if (!dsum) return;
    // dsum: N * cpg <= GNB_MAXNC, so one round: item cc * N + n holds channel cc's A and U
    for (int j = t; j < N * cpg; j += blockDim.x) {
        int n = j / cpg, cc = j % cpg, c = g * cpg + cc, i = cc * N + n;
        double r = (double)sr[n], m1 = (double)cm[0][n], m2 = (double)cm[1][n];  // dsum: pre holds
        dsum[n * C + c] = (float)(r * ((double)sg[cc] * ra[i] - (double)S * m1 - m2 * r * ru[i]));
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
                for (int j = 0; j < V; j++) a[u][j] = silu_t<T>(a[u][j]);
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
                float yy = gn_y(xs[j], f.x, f.w), sg, sl;
                silu_sig_t<T>(yy, sl, sg);
                g[j] *= sg * (1.0f + yy * (1.0f - sg));
                y[j] = sl;
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
