// conv3d_wgmma.cu: the U-Net's wide 3x3x3, stride-1, pad-1 convolutions (64 -> 64 and 128 -> 64 at
// 128^3 are 7.8 of a 15.2 ms bf16 sampling forward) on Hopper's warpgroup MMA, bf16 NDHWC in and
// out, f32 sums. The twin is the CPU reference conv (src/cpu/conv3d.rs): the same sums.
//   out[n, v, co] (= or +=) b[co] + sum over taps t, ci of W[co, t, ci] * x[n, v + off(t), ci]
// with off(t) = (kd - 1, kh - 1, kw - 1) for t = kd*9 + kh*3 + kw, zero outside the volume.
//
// GEMM view per block: M = 64 output channels (a slice of CO, blockIdx.y), N = 256 voxels (a tile
// of WM_TH x WM_TW = 32 (h) x 8 (w) at one d), K = 27 taps x CI. One warpgroup (128 threads)
// issues wgmma.mma_async.m64n256k16 (a second one, the producer, loads the stages) with
//   - A (the weights) in registers: prepacked by conv3d_wgmma_pack in fragment order, one 16-byte
//     load a thread per MMA, two taps (8 MMAs) ahead; the MMAs of a tap are one commit group and
//     up to two taps are in flight;
//   - B (the input) in shared memory: one halo plane of (WM_TH + 2) x (WM_TW + 2) voxels and 64
//     channels a stage, a 128-byte row a voxel, in wgmma's 128-byte-swizzled K-major layout (the
//     16-byte chunk c of the row at address a is stored at chunk c ^ ((a >> 7) & 7)); the rows of
//     an 8-voxel group of outputs are consecutive and the groups (tile rows) WM_PW rows apart
//     (the descriptor's stride byte offset). A tap (kh, kw) is the same stage read from a start
//     address kh*WM_PW + kw rows further (the swizzle follows the absolute address, so any row
//     start reads back what was written), a k step of 16 channels 32 bytes further; each stage
//     is loaded once and read by its 9 taps. (A first version used the no-swizzle layout, planes
//     of 8 channels: ncu counted 2-way bank conflicts on the MMAs' reads and the tensor pipe
//     51.9 % busy.)
// Voxels on N (not M, as cuDNN's implicit GEMM puts them) is the point: the 64 x 16 weight tile of
// an MMA is in registers and each MMA reads only its 8 KB of B from shared memory, half of what
// the tensor cores can consume, where an M = voxels tiling with N = 64 reads A and B (16 KB a
// 256 x 64 x 16 step) and is bound by shared-memory bandwidth.
// Stages (64 channels of one input plane d + kd - 1, kd = 0..2, channel group cg) stream through a
// ring of WM_NS buffers with cp.async (16-byte copies, zero-filled outside the volume), up to
// three stages ahead; with 64 input channels the ring is a window of input planes, each loaded
// once for the three output planes that read it (see wgmma_conv_body).
// After the 3 * CI/64 stages of an output plane the sums plus the bias (plus, with accum, the old
// output or z, loaded into the staging rows while the plane's MMAs run), rounded to bf16 once,
// go through shared memory (stmatrix .trans: voxel rows of 64 channels) to 16-byte stores (the
// first version staged f32 sums 32 channels at a time, with four barriers a plane).
// Work items: columns of WM_TH x WM_TW voxels cut into chunks of DC planes (col_grid / col_item of
// conv3d.cu, the host's col_items), persistent blocks, one a SM (WM_SMEM bytes of shared memory).
// One body (wgmma_conv_body) serves the forward, the data gradient and the forward with the
// GroupNorm+SiLU prologue.
// conv3d_wgmma_wgrad (at the end of the file) is the weight gradient of the same convs, its own
// GEMM view (voxels on K, both operands transposed in shared memory), and conv3d_wgmma_wgrad_tf32
// its TF32 form (f32 operands: x in registers, dy transposed K-major into shared memory); their
// twin is the CPU reference conv's weight gradient.
// Compiled for sm_90a only (wgmma); elsewhere the kernels are empty and the host never runs them.
// Layout note: x (N, D, H, W, CI), y (N, D, H, W, CO), CI and CO multiples of 64; bf16 but for
// conv3d_wgmma_wgrad_tf32.

#define WM_TH 32
#define WM_TW 8
#define WM_PW (WM_TW + 2)                // 10 halo voxels a row
#define WM_PL ((WM_TH + 2) * WM_PW)      // 340 halo voxels a plane
#define WM_STAGE (((WM_PL * 128) + 1023) / 1024 * 1024)  // one stage: 64 channels of a halo plane
                                                       // (43520 bytes, rounded to the 1 KB swizzle
                                                       // pattern: 44032)
#define WM_NS 4                          // stages in the ring: reading, finishing, landed, loading
#define WM_YR 144                        // staging row: 64 bf16 channels + 16 bytes (bank offset)
#define WM_SMEM (WM_NS * WM_STAGE + WM_TH * WM_TW * WM_YR)
#define WM_NV ((WM_PL + 63) / 64)        // halo voxels a thread copies per stage (6; two threads a voxel)
#define WM_CPT (WM_NV * 4)               // 16-byte copies a thread per stage (24, 3 per tap)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wm_cp16(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void wm_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wm_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void wm_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wm_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wm_wait(float* d) {
    // the sums are operands so the compiler keeps their reads and writes on this side of the wait
#define WM_R8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
    asm volatile("wgmma.wait_group.sync.aligned %128;\n"
                 : WM_R8(0), WM_R8(8), WM_R8(16), WM_R8(24), WM_R8(32), WM_R8(40), WM_R8(48), WM_R8(56),
                   WM_R8(64), WM_R8(72), WM_R8(80), WM_R8(88), WM_R8(96), WM_R8(104), WM_R8(112), WM_R8(120)
                 : "n"(N)
                 : "memory");
}
// shared-memory descriptor of a 128-byte-swizzled operand at byte address a with leading and
// stride byte offsets lbo, sbo (the weight gradient's transposed operands use both)
__device__ __forceinline__ u64 wm_desc_at(u32 a, u32 lbo, u32 sbo) {
    return (u64)((a >> 4) & 0x3FFF) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32) |
           ((u64)1 << 62);
}
// a K-major stage operand: rows of 128 bytes, 8-row groups WM_PW rows apart; the leading byte
// offset is unused (16 bytes, encoded 1)
__device__ __forceinline__ u64 wm_desc(u32 a) { return wm_desc_at(a, 16, WM_PW * 128); }
// d (+)= A * B, m64n256k16, A from registers (a), B from shared memory (desc); acc = 0 overwrites
__device__ __forceinline__ void wm_mma(float* d, const uint4& a, u64 desc, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
        : WM_R8(0), WM_R8(8), WM_R8(16), WM_R8(24), WM_R8(32), WM_R8(40), WM_R8(48), WM_R8(56), WM_R8(64),
          WM_R8(72), WM_R8(80), WM_R8(88), WM_R8(96), WM_R8(104), WM_R8(112), WM_R8(120)
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "l"(desc), "r"(acc));
}

// A cursor over a block's stages: work item it (col_item c), output plane d, stage k of the plane
// (kd = k / CG, channel group cg = k % CG).
struct WmCur {
    i64 it;
    int d, k;
    ColItem c;
    bool live;
};
__device__ __forceinline__ void wm_start(WmCur& u, const ColGrid& g, int D, int DC) {
    u.it = blockIdx.x;
    u.live = u.it < g.items;
    u.k = 0;
    if (u.live) {
        u.c = col_item(g, u.it, D, DC);
        u.d = u.c.d0;
    }
}
__device__ __forceinline__ void wm_next(WmCur& u, const ColGrid& g, int D, int DC, int KS) {
    if (++u.k < KS) return;
    u.k = 0;
    if (++u.d < u.c.d1) return;
    u.it += gridDim.x;
    u.live = u.it < g.items;
    if (u.live) {
        u.c = col_item(g, u.it, D, DC);
        u.d = u.c.d0;
    }
}
#endif

// Weights (CO, 27, CI) in the NDHWC layout (f32 or bf16, wbf) to A fragments: wp[((ms * KS + k) * 36
// + j) * 128 + thread] for cout slice ms, stage k = kd * CG + cg, MMA j = (kh * 3 + kw) * 4 + ks of
// the stage (channels cg * 64 + ks * 16 ..), thread = 32 * warp + lane: rows ms * 64 + 16 * warp +
// lane / 4 (+ 8), columns 2 * (lane % 4) (+ 1, + 8, + 9), as mma.m16n8k16's A fragment.
//   tw == 1: the data gradient of the conv with weights w (CI, 27, CO) (CO of this conv's inputs):
//   W'[co, t, ci] = w[ci, 26 - t, co].
extern "C" __global__ void conv3d_wgmma_pack(const void* w, int wbf, int CI, int CO, int tw, uint4* wp) {
    const int CG = CI / 64, KS = 3 * CG;
    const i64 total = (i64)(CO / 64) * KS * 36 * 128;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const int th = (int)(i % 128), j = (int)((i / 128) % 36), k = (int)((i / (128 * 36)) % KS);
        const int ms = (int)(i / ((i64)128 * 36 * KS));
        const int kd = k / CG, cg = k % CG, t = kd * 9 + j / 4, ks = j % 4;
        const int warp = th / 32, lane = th % 32;
        const int co = ms * 64 + 16 * warp + lane / 4, ci = cg * 64 + ks * 16 + 2 * (lane % 4);
        auto at = [&](int o, int c) -> float {
            const i64 off = tw ? ((i64)c * 27 + (26 - t)) * CO + o : ((i64)o * 27 + t) * CI + c;
            return wbf ? ld((const bf16*)w, off) : ld((const float*)w, off);
        };
        wp[i] = make_uint4(pack_bf2(at(co, ci), at(co, ci + 1)), pack_bf2(at(co + 8, ci), at(co + 8, ci + 1)),
                           pack_bf2(at(co, ci + 8), at(co, ci + 9)), pack_bf2(at(co + 8, ci + 8), at(co + 8, ci + 9)));
    }
}

// -- The body of conv3d_wgmma_fwd, _dgrad and _fwd_gn. Two warpgroups a block (warp
// specialisation): the producer (threads 128-255) copies the stages with cp.async and, for
// conv3d_wgmma_fwd_gn (the forward over silu(GN(x + off)): the ResBlocks' convs, silu(GN(x)) never
// stored), transforms its own copies in place (gn_y over a halved affine map, silu_h, rounded to
// nearest even: bit for bit gn_apply's silu_t<bf16> values; the halo outside the volume stays
// zero, the conv's padding), then hands each stage over; the consumer (threads 0-127) runs the
// MMA loop and the epilogue.
// Hand-over by named barriers, per ring buffer b: FULL 1 + b (the producer arrives, the consumer
// waits), EMPTY 1 + WM_NS + b (the consumer arrives once the stage's last MMAs are done, the
// producer waits before reusing b); 2 * WM_NS + 1 orders the consumer's epilogue. (Until the
// twenty-third session the plain convs had their own one-warpgroup body whose MMA warpgroup
// issued the copies between its taps; the warp-specialised body with the window below replaced
// it: docs/perf/h200-2026-12-02h.)
// Without the window each staged value is transformed once per output plane that reads it (three
// times): ~2700 instructions a stage and scheduler, most of them the producer's (ncu). With the
// sigmoid as exp2 + reciprocal (two MUFU a value) it set the pace: 1.25x (64 -> 64) and 1.35x
// (128 -> 64) the plain kernel's time at 128^3, more than the gn_apply pass saved (ncu: tensor
// pipe 47 % busy against 68 %, an instruction every 3.7 cycles a scheduler); with sigmoid_t's tanh
// (one MUFU) the fused forward wins (14.1 -> 13.8 ms a sampling forward). The transform inside
// the MMA warpgroup's loop (the first version: ~280 instructions, 48 MUFU a tap between the MMAs)
// was slower still: 18.2 against 14.3 ms (docs/perf/h200-2026-12-02c). MEDDPM_WGMMA_GN=0
// switches the fusion off (A/B).
// With 64 input channels (one stage a plane, KS = 3) and `reuse`, the producer loads and
// transforms each input plane once and the consumer reads it for the three output planes that
// need it: the ring holds planes d - 1, d, d + 1 of output plane d while d + 2 loads (load number
// = the item's first plane's + plane - d0 + 1; the consumer waits for a plane at its first use,
// output max(d0, plane - 1), and hands it back after its last, min(d1 - 1, plane + 1)). Each
// item loads its d1 - d0 + 2 planes instead of 3 (d1 - d0) stages; MEDDPM_WGMMA_REUSE=0 for A/B.
// With WmGn::ys the epilogue also takes the GroupNorm statistics of the output as stored (the
// next GroupNorm's, so that no pass reads the output for them): per tile and channel shifted sums
// over the 256 voxels, merged over a column item's planes (MEDDPM_CONV_STATS=0 for A/B).
#define WS_FULL(b) (1 + (b))
#define WS_EMPTY(b) (1 + WM_NS + (b))
#define WS_EPI (1 + 2 * WM_NS)
#define WS_EPI2 (5 + 2 * WM_NS)  // the second MMA warpgroup's (conv3d_wgmma_dgrad2)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
struct WmGn {
    const float *mean, *rstd, *gamma, *beta, *off;
    int G;
    // x2: the input is the concatenation cat(x (CA channels), x2 (CI - CA)) along channels, read
    // from its parts (CA a multiple of 64: a stage's 64 channels lie in one part); 0: x alone
    const bf16* x2;
    int CA;
    // ys: the GroupNorm statistics of the output as stored, stage 1 (0: none): per column item
    // `it` of col_grid (its planes d0 .. d1 of a 32 x 8 tile) and output channel, (mean, M2,
    // count) at ys[(it * CO + co) * 3]: the chunk partials gn_stats_finalize combines with
    // counts (items / N chunks a sample)
    float* ys;
};
// bytes of shared memory past the (sc, sh) table: the four MMA warps' channel sums of a tile
#define WM_YSUMS (4 * 8 * 16 * 4)
// The data gradient taking the GroupNorm+SiLU backward's channel sums of its output
// (conv3d_wgmma_dgrad_gnb): the output g = dL/dsilu(GN(x + off)) as stored (rounded) and x, the
// GroupNorm's input (same shape as the output), give per channel c and column item `it` (its
// planes d0 .. d1 of a 32 x 8 tile) the partials chan_gnbwd(3)_ndhwc* would have taken over the
// same voxels: with t = g * silu'(GN(x)) and mu the group mean less the channel's offset,
// part[(it * CO + c) * stride] = (sum t, sum t * (x - mu)[, sum (x - mu)]), stride 3 with x3, the
// chunk partials gn_bwd_finalize reads (items / N chunks a sample). Saves the pass that read g and
// x again for them (chan_gnbwd*). The producer warpgroup takes them (it only copies stages in a
// data gradient, and waits for free buffers most of the time): once the MMA warpgroup's epilogue
// of plane p has put g into the staging rows (WB_FULL), the producer reads it there and x's tile
// from global memory, and hands the rows back (WB_EMPTY, before the epilogue of plane p + 1
// writes them), all while the MMAs of plane p + 1 run; it sums plane p after it has handed over
// the stage that completes plane p + 1 (so neither side waits for the other in a circle). A first
// version summed in the MMA warpgroup's epilogue (x loaded into the staging rows as z is, read
// back in fragment order): 0.3-0.5 ms slower a whole-head training step than the separate pass,
// the MMAs idle meanwhile (docs/perf/h200-2026-12-03k).
// With dys (64 input channels and the window of planes only; the blocks of output slice 0): also
// the channel sums of the input dy (the conv's output gradient: its bias gradient), from the
// stages as loaded, each thread over the rows it copied (its own copies, landed: no barrier);
// (sum, 0) per column item and channel at dys[(it * 64 + c) * 2], chan_sum_finalize's chunks.
// Saves the channel_sum pass over dy.
struct WmGb {
    const bf16* x;  // null: no sums
    const float *mean, *rstd, *gamma, *beta, *off;
    int G;
    float* part;
    int x3;
    float* dys;
};
// shared memory past the table of N * CO float4 (mu, sc, sh): the producer's four warps' sums of
// a plane, 8 lanes x 8 channels x 3 a warp; then the warps' running dy sums, 2 x 32 channels a warp
#define WM_GBSUMS (4 * 8 * 24 * 4 + 4 * 64 * 4)
#define WB_FULL (2 + 2 * WM_NS)
#define WB_EMPTY (3 + 2 * WM_NS)
#define WB_RED (4 + 2 * WM_NS)
__device__ __forceinline__ void nb_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void nb_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ uint4 wm_lds16(u32 a) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ void wm_sts16(u32 a, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
// The trilinear doubling's sources along one axis (upsample.cu's src_index as upsample_fwd_quad
// evaluates it): output o of a doubled axis over n inputs reads (s0, s1) with weights (w0, w1).
__device__ __forceinline__ void up_src(int o, int n, int& s0, int& s1, float& w0, float& w1) {
    const int i = o >> 1;
    if (o & 1) {
        s0 = i;
        s1 = min(i + 1, n - 1);
        w0 = 0.75f;
        w1 = 0.25f;
    } else {
        s0 = max(i - 1, 0);
        s1 = i;
        w0 = i == 0 ? 1.0f : 0.25f;
        w1 = i == 0 ? 0.0f : 0.75f;
    }
}
// One row of the trilinear doubling of x, as upsample_fwd_quad computes it: the row's d and h
// sources (rows r00 = (da, ha), r01 = (da, hb), r10 = (db, ha), r11 = (db, hb) of x, at the
// thread's 16-byte chunk) blended at the 6 source columns cb .. cb + 5 (clamped to W2) that 8 or 10
// voxels from column 2 (cb + 1) - 1 or 2 (cb + 1) read: h first, then d, in f32. The 24 loads are
// issued before the arithmetic (one round trip a row: the first version loaded a column at a
// time, six dependent round trips, and its producer set the conv's pace).
__device__ __forceinline__ void up_cols(float (&tc)[6][8], const bf16* r00, const bf16* r01, const bf16* r10,
                                        const bf16* r11, int cb, int W2, int CI, float wd0, float wd1, float wh0,
                                        float wh1) {
    uint4 q[6][4];
#pragma unroll
    for (int j = 0; j < 6; j++) {
        const int o = min(max(cb + j, 0), W2 - 1) * CI;
        q[j][0] = *reinterpret_cast<const uint4*>(r00 + o);
        q[j][1] = *reinterpret_cast<const uint4*>(r01 + o);
        q[j][2] = *reinterpret_cast<const uint4*>(r10 + o);
        q[j][3] = *reinterpret_cast<const uint4*>(r11 + o);
    }
#pragma unroll
    for (int j = 0; j < 6; j++) {
        const u32 a0[4] = {q[j][0].x, q[j][0].y, q[j][0].z, q[j][0].w}, a1[4] = {q[j][1].x, q[j][1].y, q[j][1].z, q[j][1].w};
        const u32 b0[4] = {q[j][2].x, q[j][2].y, q[j][2].z, q[j][2].w}, b1[4] = {q[j][3].x, q[j][3].y, q[j][3].z, q[j][3].w};
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int e = k >> 1;
            auto f = [&](u32 v) { return __uint_as_float(k & 1 ? v & 0xffff0000u : v << 16); };
            // upsample_fwd_quad: h first (cur), then d (prev, cur)
            const float pv = wh0 * f(a0[e]) + wh1 * f(a1[e]);
            const float cv = wh0 * f(b0[e]) + wh1 * f(b1[e]);
            tc[j][k] = wd0 * pv + wd1 * cv;
        }
    }
}
// Voxel q of such a row, at column 2 (cb + 1) + q (q = -1 .. 8; even columns read (i - 1, i), odd
// ones (i, i + 1), i = column / 2): the w blend of its two t columns, rounded to bf16 once.
__device__ __forceinline__ uint4 up_vox(const float (&tc)[6][8], int q, int cb) {
    const int j = (q >> 1) + (q & 1);
    float o[8];
    if (q & 1) {
#pragma unroll
        for (int k = 0; k < 8; k++) o[k] = 0.75f * tc[j][k] + 0.25f * tc[j + 1][k];
    } else {
        const int i = cb + 1 + (q >> 1);
        const float l0 = i == 0 ? 1.0f : 0.25f, l1 = i == 0 ? 0.0f : 0.75f;
#pragma unroll
        for (int k = 0; k < 8; k++) o[k] = l0 * tc[j][k] + l1 * tc[j + 1][k];
    }
    return make_uint4(pack_bf2(o[0], o[1]), pack_bf2(o[2], o[3]), pack_bf2(o[4], o[5]), pack_bf2(o[6], o[7]));
}
// The row's sources along d and h (x of (D/2, H/2, W/2, CI) from xs, sample n's voxel 0 at the
// thread's channels) for the doubled volume's plane dd and row gh (both inside it).
struct UpRows {
    const bf16 *r00, *r01, *r10, *r11;
    float wd0, wd1, wh0, wh1;
};
__device__ __forceinline__ UpRows up_rows(const bf16* xs, int dd, int gh, int CI, int D, int H, int W) {
    const int H2 = H >> 1, W2 = W >> 1;
    int da, db, ha, hb;
    UpRows r;
    up_src(dd, D >> 1, da, db, r.wd0, r.wd1);
    up_src(gh, H2, ha, hb, r.wh0, r.wh1);
    r.r00 = xs + ((i64)da * H2 + ha) * W2 * CI;
    r.r01 = xs + ((i64)da * H2 + hb) * W2 * CI;
    r.r10 = xs + ((i64)db * H2 + ha) * W2 * CI;
    r.r11 = xs + ((i64)db * H2 + hb) * W2 * CI;
    return r;
}
// conv3d_wgmma_fwd_up's stage: halo plane dd of the trilinear doubling of x (xs: sample n's voxel
// 0 of x, the stage's 64 channels) around the tile at corner (h0, w0) (hw0 = h0 << 16 | w0),
// written into the stage at sb as the copies would have put it there (zero outside the volume:
// the conv's padding). The producer's thread t takes (halo row hh, 16-byte chunk c) pairs t + 128
// k: the row's 10 voxels from 6 t columns (up_cols, up_vox), so the stage holds what
// upsample_fwd_quad stores.
__device__ __forceinline__ void up_stage(const bf16* xs, int dd, int hw0, u32 sb, int t, int CI, int D, int H,
                                         int W) {
    const int h0 = hw0 >> 16, w0 = hw0 & 0xffff, cb = (w0 >> 1) - 1;
    const bool pin = dd >= 0 && dd < D;
#pragma unroll 1
    for (int p = t; p < (WM_TH + 2) * 8; p += 128) {
        const int hh = p >> 3, c = p & 7, gh = h0 - 1 + hh;
        const bool rin = pin && gh >= 0 && gh < H;
        float tc[6][8];
        if (rin) {
            const UpRows r = up_rows(xs + c * 8, dd, gh, CI, D, H, W);
            up_cols(tc, r.r00, r.r01, r.r10, r.r11, cb, W >> 1, CI, r.wd0, r.wd1, r.wh0, r.wh1);
        }
        const u32 rb = sb + hh * WM_PW * 128;
#pragma unroll
        for (int ww = 0; ww < WM_PW; ww++) {
            const int gw = w0 - 1 + ww;
            const uint4 v = rin && gw >= 0 && gw < W ? up_vox(tc, ww - 1, cb) : make_uint4(0u, 0u, 0u, 0u);
            const u32 row = rb + ww * 128;
            wm_sts16(row + ((c ^ ((row >> 7) & 7)) << 4), v);
        }
    }
}
// conv3d_wgmma_dgrad_up's side job: the tile (plane dd, rows h0 .. h0 + 31, columns w0 .. w0 + 7,
// clipped to the volume; 64 channels) of the doubling of x written to u (us: sample n's voxel 0
// of u, (D, H, W, C) at the slice's channels; xs: x's, as up_stage), the producer's thread t
// taking (row, chunk) pairs t and t + 128.
__device__ __forceinline__ void up_tile(const bf16* xs, bf16* us, int dd, int h0, int w0, int t, int C, int D, int H,
                                        int W) {
    const int cb = (w0 >> 1) - 1;
#pragma unroll 1
    for (int p = t; p < WM_TH * 8; p += 128) {
        const int hh = p >> 3, c = p & 7, gh = h0 + hh;
        if (gh >= H) continue;
        float tc[6][8];
        const UpRows r = up_rows(xs + c * 8, dd, gh, C, D, H, W);
        up_cols(tc, r.r00, r.r01, r.r10, r.r11, cb, W >> 1, C, r.wd0, r.wd1, r.wh0, r.wh1);
        bf16* o = us + (((i64)dd * H + gh) * W + w0) * C + c * 8;
#pragma unroll
        for (int ww = 0; ww < WM_TW; ww++)
            if (w0 + ww < W) *reinterpret_cast<uint4*>(o + ww * C) = up_vox(tc, ww, cb);
    }
}
// conv3d_wgmma_dgrad_up's pointers: x (N, D/2, H/2, W/2, CO) and u (N, D, H, W, CO), the
// doubling of x the producer writes beside the data gradient (see the entry)
struct WmUp {
    const bf16* x;
    bf16* u;
};
template <int NC = 1, int NS = WM_NS, int UP = 0>
__device__ __forceinline__ void wgmma_conv_body(const bf16* x, const uint4* wp, const float* b, bf16* y,
                                                const bf16* z, int N, int CI, int CO, int D, int H, int W, int DC,
                                                int accum, WmGn gn, int reuse, WmGb gb = WmGb{}, WmUp wu = WmUp{}) {
    extern __shared__ __align__(1024) unsigned char wm_smem[];
    const int CG = CI / 64, KS = 3 * CG, period = KS * 36;
    reuse = reuse && CG == 1;
    const ColGrid g = col_grid(N, D, H, W, DC, WM_TH, WM_TW);
    // NC MMA warpgroups (consumers), each its own 64-output-channel slice of the same stages, and
    // the producer; NT threads; XOFF bytes of stages and staging rows before the tables
    constexpr int NT = 128 * (NC + 1);
    constexpr u32 STG = WM_TH * WM_TW * WM_YR, XOFF = NS * WM_STAGE + NC * STG;
    const int t = threadIdx.x & 127, warp = t >> 5, lane = t & 31;
    const int wg = NC == 1 ? 0 : (int)(threadIdx.x >> 7) < NC ? (int)(threadIdx.x >> 7) : 0;
    const int ms = NC == 1 ? blockIdx.y : blockIdx.y * NC + wg, epi = NC == 1 || !wg ? WS_EPI : WS_EPI2;
    const u32 sbase = (u32)__cvta_generic_to_shared(wm_smem);
    const u32 stg = sbase + NS * WM_STAGE + wg * STG;
    // the per-(n, ci) affine map (sc, sh) of the GroupNorm as gn_apply computes it, past the
    // staging rows (float4 = two channels)
    const bool xf = gn.mean != nullptr;
    if (xf) {
        float2* t2 = reinterpret_cast<float2*>(wm_smem + XOFF);
        const int cpg = CI / gn.G;
        for (int i = threadIdx.x; i < N * CI; i += NT) {
            const int n = i / CI, c = i - n * CI, ng = n * gn.G + c / cpg;
            float sc, sh;
            gn_affine(gn.rstd[ng], gn.gamma[c], gn.beta[c], gn.mean[ng] - (gn.off ? gn.off[i] : 0.0f), sc, sh);
            // halved: the transform's gn_y gives h = y / 2, and silu_h(h) is silu_t<bf16>(y)
            t2[i] = make_float2(0.5f * sc, 0.5f * sh);
        }
    }
    // with gb: the per-(n, co) (mu, sc, sh) of the GroupNorm whose backward sums are taken
    float4* const gtab = reinterpret_cast<float4*>(wm_smem + XOFF);
    if (gb.x) {
        const int cpg = CO / gb.G;
        for (int i = threadIdx.x; i < N * CO; i += NT) {
            const int n = i / CO, c = i - n * CO, ng = n * gb.G + c / cpg;
            const float mu = gb.mean[ng] - (gb.off ? gb.off[i] : 0.0f);
            float sc, sh;
            gn_affine(gb.rstd[ng], gb.gamma[c], gb.beta[c], mu, sc, sh);
            gtab[i] = make_float4(mu, sc, sh, 0.0f);
        }
    }
    __syncthreads();
    WmCur cu;
    wm_start(cu, g, D, DC);
    if (!cu.live) return;
    if (threadIdx.x >= 128 * NC) {
        // with two MMA warpgroups the registers go to them (168 a thread at launch)
        if constexpr (NC == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        // ---- producer: copies (channels 32 * (t % 2) .. + 31 of halo voxels t / 2 + 64 m), then
        // the transform of the same 16-byte chunks once they landed
        const float4* tab = reinterpret_cast<const float4*>(wm_smem + XOFF);
        const int c4 = (t & 1) * 4, r0 = t >> 1;
        struct St {
            const bf16* p;  // the stage's corner voxel (h0 - 1, w0 - 1), this thread's channels
            int cs;         // channels a voxel of the part p points into
            int t0;         // the table's float4 index of this thread's first channel pair; with
                            // UP (no table) the item's tile corner h0 << 16 | w0
            u32 in;         // bit m: halo voxel r0 + 64 m is inside the volume
            int dd;         // with UP: the plane (of the doubled volume)
        };
        // plane dd, channel group cg of item c
        auto plan = [&](const ColItem& c, int dd, int cg) -> St {
            const int gh0 = c.h0 - 1, gw0 = c.w0 - 1;
            const bool ok = dd >= 0 && dd < D;
            // the part holding the stage's 64 channels, and their offset in it
            const bool p2 = gn.x2 && cg * 64 >= gn.CA;
            const int cs = gn.x2 ? (p2 ? CI - gn.CA : gn.CA) : CI, cc = p2 ? cg * 64 - gn.CA : cg * 64;
            St S;
            S.cs = cs;
            if constexpr (UP == 1) {
                // sample n's voxel 0 of x and the group's channels; the plane and corner apart
                S.p = x + (i64)c.n * (D >> 1) * (H >> 1) * (W >> 1) * CI + cg * 64;
                S.t0 = (c.h0 << 16) | c.w0;
                S.dd = dd;
            } else {
                S.p = (p2 ? gn.x2 : x) + ((((i64)c.n * D + dd) * H + gh0) * W + gw0) * cs + cc + c4 * 8;
                S.t0 = (c.n * CI + cg * 64 + c4 * 8) >> 1;
            }
            S.in = 0u;
#pragma unroll
            for (int m = 0; m < WM_NV; m++) {
                const int r = r0 + 64 * m, hh = r / WM_PW, ww = r - hh * WM_PW;
                if (ok && r < WM_PL && (unsigned)(gh0 + hh) < (unsigned)H && (unsigned)(gw0 + ww) < (unsigned)W)
                    S.in |= 1u << m;
            }
            return S;
        };
        auto load = [&](const St& S, int buf) {
            if constexpr (UP != 1) {  // UP == 1: computed in xform
#pragma unroll
                for (int jc = 0; jc < WM_CPT; jc++) {
                    const int m = jc >> 2, c = jc & 3, r = r0 + 64 * m;
                    if (m == WM_NV - 1 && r >= WM_PL) continue;
                    const int hh = r / WM_PW, ww = r - hh * WM_PW;
                    const bool ok = (S.in >> m) & 1u;
                    const u32 row = sbase + buf * WM_STAGE + r * 128;
                    wm_cp16(row + (((c4 + c) ^ ((row >> 7) & 7)) << 4), ok ? S.p + (hh * W + ww) * S.cs + c * 8 : x, ok);
                }
                wm_cp_commit();
            }
        };
        auto xform = [&](const St& S, int buf) {
            if constexpr (UP == 1) up_stage(S.p, S.dd, S.t0, sbase + buf * WM_STAGE, t, CI, D, H, W);
            if (xf) {
                // this thread's 32 channels are the same in every halo voxel it copied: their (sc, sh)
                // in registers for the stage; a voxel's four chunks at once (independent chains)
                float4 tv[16];
#pragma unroll
                for (int i = 0; i < 16; i++) tv[i] = lds4(tab + S.t0 + i);
#pragma unroll 1
                for (int m = 0; m < WM_NV; m++) {
                    if (!((S.in >> m) & 1u)) continue;
                    const u32 row = sbase + buf * WM_STAGE + (r0 + 64 * m) * 128;
                    u32 a[4];
                    uint4 v[4];
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        a[c] = row + (((c4 + c) ^ ((row >> 7) & 7)) << 4);
                        v[c] = wm_lds16(a[c]);
                    }
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        const u32 xw[4] = {v[c].x, v[c].y, v[c].z, v[c].w};
                        u32 o[4];
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const float4 t4 = tv[c * 4 + e];
                            const float h0 = gn_y(__uint_as_float(xw[e] << 16), t4.x, t4.y);
                            const float h1 = gn_y(__uint_as_float(xw[e] & 0xffff0000u), t4.z, t4.w);
                            o[e] = pack_bf2(silu_h(h0), silu_h(h1));
                        }
                        v[c] = make_uint4(o[0], o[1], o[2], o[3]);
                    }
#pragma unroll
                    for (int c = 0; c < 4; c++) wm_sts16(a[c], v[c]);
                }
            }
            // the writes (and the copies, landed) before the MMAs' async-proxy reads
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        };
        // Stage s's copies are issued after stage s - 1 is handed over and waited for at the next
        // stage, after the wait for a free buffer (the producer runs up to NS - 1 stages ahead,
        // so the copies land while it waits) and no copy is in flight at the proxy fence (a
        // MEMBAR.ALL.CTA). Issued before stage s - 1's transform instead, the times were the same.
        // The loads in order: with reuse, planes d0 - 1 .. d1 of each item (lp), once each; else
        // the consumer's stages (plane d + kd - 1, channel group cg), one load each.
        WmCur lc = cu;
        int lp = lc.c.d0 - 1;
        auto cur = [&]() -> St {
            return reuse ? plan(lc.c, lp, 0) : plan(lc.c, lc.d + lc.k / CG - 1, lc.k % CG);
        };
        // with gb: the output plane the current load completes (its last stage in the consumer's
        // order), if any
        struct Pl {
            ColItem c;
            i64 it;
            int d;
            bool last;  // the item's last plane
        };
        auto info = [&](bool& comp) -> Pl {
            Pl p;
            p.c = lc.c;
            p.it = lc.it;
            comp = reuse ? lp >= lc.c.d0 + 1 : lc.k == KS - 1;
            p.d = reuse ? lp - 1 : lc.d;
            p.last = p.d == lc.c.d1 - 1;
            return p;
        };
        // the GroupNorm backward's sums of output plane p (see WmGb): thread t, channels
        // ms * 64 + 8 (t & 7) .. + 7 of voxels t / 8 + 16 i of the tile; the item's running sums
        // in threads t < 64 (channel ms * 64 + t), written once its last plane is summed
        float rs[3] = {0.0f, 0.0f, 0.0f};
        float* const red = reinterpret_cast<float*>(wm_smem + XOFF + N * CO * 16);
        auto sums = [&](const Pl& p, bool fin) {
            nb_sync(WB_FULL, 256);  // plane p's g in the staging rows
            const int c8 = t & 7, vr = t >> 3;
            const i64 vb = (((i64)p.c.n * D + p.d) * H) * W;
            const bf16* xb = gb.x + ms * 64 + c8 * 8;
            float4 tb[8];
            const float4* tp = gtab + p.c.n * CO + ms * 64 + c8 * 8;
#pragma unroll
            for (int j = 0; j < 8; j++) tb[j] = lds4(tp + j);
            float sa[8], sq[8], su[8];
#pragma unroll
            for (int j = 0; j < 8; j++) sa[j] = sq[j] = su[j] = 0.0f;
            // x's rows in two batches of eight loads (all sixteen at once spilled beside the
            // bias gradient's sums)
            uint4 xr[8];
#pragma unroll
            for (int i = 0; i < 16; i++) {
                if (i % 8 == 0) {
#pragma unroll
                    for (int k = 0; k < 8; k++) {
                        const int v = vr + 16 * (i + k), gh = p.c.h0 + (v >> 3), gw = p.c.w0 + (v & 7);
                        xr[k] = gh < H && gw < W
                                    ? *reinterpret_cast<const uint4*>(xb + (vb + (i64)gh * W + gw) * CO)
                                    : make_uint4(0u, 0u, 0u, 0u);
                    }
                }
                const int v = vr + 16 * i, gh = p.c.h0 + (v >> 3), gw = p.c.w0 + (v & 7);
                if (gh >= H || gw >= W) continue;
                const uint4 gv = wm_lds16(stg + v * WM_YR + c8 * 16);
                const u32 gw4[4] = {gv.x, gv.y, gv.z, gv.w}, xw4[4] = {xr[i % 8].x, xr[i % 8].y, xr[i % 8].z, xr[i % 8].w};
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const u32 gu = gw4[j >> 1], xu = xw4[j >> 1];
                    const float g1 = __uint_as_float(j & 1 ? gu & 0xffff0000u : gu << 16);
                    const float x1 = __uint_as_float(j & 1 ? xu & 0xffff0000u : xu << 16);
                    // chan_acc1's arithmetic
                    const float tv = g1 * silu_grad_t<bf16>(gn_y(x1, tb[j].y, tb[j].z)), xm = x1 - tb[j].x;
                    sa[j] += tv;
                    sq[j] += tv * xm;
                    su[j] += xm;
                }
            }
            if (!fin) nb_arrive(WB_EMPTY, 256);  // the rows are read: the next epilogue may write them
            // lanes l, l ^ 8, l ^ 16, l ^ 24 hold the same channels; the four warps' sums are added
            // in order by the 64 channel threads
#pragma unroll
            for (int j = 0; j < 8; j++) {
                sa[j] += __shfl_xor_sync(0xffffffffu, sa[j], 8);
                sq[j] += __shfl_xor_sync(0xffffffffu, sq[j], 8);
                su[j] += __shfl_xor_sync(0xffffffffu, su[j], 8);
                sa[j] += __shfl_xor_sync(0xffffffffu, sa[j], 16);
                sq[j] += __shfl_xor_sync(0xffffffffu, sq[j], 16);
                su[j] += __shfl_xor_sync(0xffffffffu, su[j], 16);
            }
            if (lane < 8) {
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float* r = red + ((warp * 8 + lane) * 8 + j) * 3;
                    r[0] = sa[j];
                    r[1] = sq[j];
                    r[2] = su[j];
                }
            }
            nb_sync(WB_RED, 128);
            if (t < 64) {
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    const float* r = red + ((w * 8 + (t >> 3)) * 8 + (t & 7)) * 3;
                    rs[0] += r[0];
                    rs[1] += r[1];
                    rs[2] += r[2];
                }
                if (p.last) {
                    const int st = gb.x3 ? 3 : 2;
                    float* o = gb.part + (p.it * CO + ms * 64 + t) * st;
                    for (int k = 0; k < st; k++) o[k] = rs[k];
                    rs[0] = rs[1] = rs[2] = 0.0f;
                }
            }
            nb_sync(WB_RED, 128);  // red read before the next plane's sums write it
        };
        // with gb.dys: the load's plane is one of the item's own (not its halo), the item's last
        const bool dyon = gb.x && gb.dys && reuse && ms == 0;
        struct Dy {
            bool own, last;
            i64 it;
        };
        auto dyinfo = [&]() -> Dy { return Dy{lp >= lc.c.d0 && lp < lc.c.d1, lp == lc.c.d1 - 1, lc.it}; };
        // the warps' running sums of the item (lanes 0, 1: channels 32 lane ..), in shared memory
        // (in registers, 32 a thread, the kernel spilled)
        float* const wys = red + 4 * 8 * 24 + warp * 64;
        if (dyon && lane < 2)
            for (int j = 0; j < 32; j++) wys[lane * 32 + j] = 0.0f;
        // this thread's copies of the stage in buffer buf (landed), added up over the warp; at the
        // item's last plane the item's sums, combined over the warps, written
        auto dysum = [&](const St& S, const Dy& q, int buf) {
            if (!dyon || !q.own) return;
            float ys[32];
#pragma unroll
            for (int j = 0; j < 32; j++) ys[j] = 0.0f;
#pragma unroll
            for (int m = 0; m < WM_NV; m++) {
                const int r = r0 + 64 * m, hh = r / WM_PW, ww = r - hh * WM_PW;
                if (!((S.in >> m) & 1u) || hh < 1 || hh > WM_TH || ww < 1 || ww > WM_TW) continue;
                const u32 row = sbase + buf * WM_STAGE + r * 128;
#pragma unroll
                for (int c = 0; c < 4; c++) {
                    const uint4 v = wm_lds16(row + (((c4 + c) ^ ((row >> 7) & 7)) << 4));
                    const u32 w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int e = 0; e < 8; e++)
                        ys[c * 8 + e] += __uint_as_float(e & 1 ? w4[e >> 1] & 0xffff0000u : w4[e >> 1] << 16);
                }
            }
            // lanes of one parity hold the same 32 channels (32 (t & 1) ..): lanes 0, 1 add the
            // warp's to its running sums
#pragma unroll
            for (int j = 0; j < 32; j++) {
                ys[j] += __shfl_xor_sync(0xffffffffu, ys[j], 2);
                ys[j] += __shfl_xor_sync(0xffffffffu, ys[j], 4);
                ys[j] += __shfl_xor_sync(0xffffffffu, ys[j], 8);
                ys[j] += __shfl_xor_sync(0xffffffffu, ys[j], 16);
            }
            if (lane < 2) {
#pragma unroll
                for (int j = 0; j < 32; j++) wys[lane * 32 + j] += ys[j];
            }
            if (!q.last) return;
            // the item's: the four warps' added in order by the 64 channel threads
            nb_sync(WB_RED, 128);
            if (t < 64) {
                float a = 0.0f;
#pragma unroll
                for (int w = 0; w < 4; w++) a += red[4 * 8 * 24 + w * 64 + t];
                gb.dys[(q.it * 64 + t) * 2] = a;
                gb.dys[(q.it * 64 + t) * 2 + 1] = 0.0f;
            }
            nb_sync(WB_RED, 128);  // read before the next item's sums
            if (lane < 2)
                for (int j = 0; j < 32; j++) wys[lane * 32 + j] = 0.0f;
        };
        // the plane whose sums wait for the stage that completes the next plane
        Pl pend;
        bool havep = false;
        auto delivered = [&](bool comp, const Pl& p) {
            if (!gb.x || !comp) return;
            if (havep) sums(pend, false);
            pend = p;
            havep = true;
        };
        if (gb.x) nb_arrive(WB_EMPTY, 256);  // the staging rows are free for the first epilogue
        auto adv = [&]() {
            if (!reuse) {
                wm_next(lc, g, D, DC, KS);
            } else if (++lp > lc.c.d1) {
                lc.it += gridDim.x;
                lc.live = lc.it < g.items;
                if (lc.live) {
                    lc.c = col_item(g, lc.it, D, DC);
                    lp = lc.c.d0 - 1;
                }
            }
        };
        // with UP == 2 (the window of planes): the u tile of each of the item's own planes, after
        // its stage's copies are issued
        auto upw = [&]() {
            if constexpr (UP == 2) {
                if (reuse && lp >= lc.c.d0 && lp < lc.c.d1) {
                    const i64 sv = (i64)lc.c.n * D * H * W;
                    up_tile(wu.x + (sv >> 3) * CO + ms * 64, wu.u + sv * CO + ms * 64, lp, lc.c.h0, lc.c.w0, t, CO, D,
                            H, W);
                }
            }
        };
        St prev = cur();
        bool pcomp = false;
        Pl pinf = info(pcomp);
        Dy pdy = dyinfo();
        load(prev, 0);
        upw();
        adv();
        int s = 1;
        for (; lc.live; s++) {
            const int buf = s % NS;
            if (s >= NS) nb_sync(WS_EMPTY(buf), NT);  // load s - NS's last MMAs are done
            wm_cp_wait<0>();
            xform(prev, (s - 1) % NS);
            dysum(prev, pdy, (s - 1) % NS);
            nb_arrive(WS_FULL((s - 1) % NS), NT);
            delivered(pcomp, pinf);
            prev = cur();
            pinf = info(pcomp);
            pdy = dyinfo();
            load(prev, buf);
            upw();
            adv();
        }
        wm_cp_wait<0>();
        xform(prev, (s - 1) % NS);
        dysum(prev, pdy, (s - 1) % NS);
        nb_arrive(WS_FULL((s - 1) % NS), NT);
        delivered(pcomp, pinf);
        // the consumer releases stages 0 .. s - 2: take the releases not waited for above
        for (int r = max(0, s - NS); r <= s - 2; r++) nb_sync(WS_EMPTY(r % NS), NT);
        if (gb.x && havep) sums(pend, true);
        return;
    }
    // ---- consumer: the MMA loop and the epilogue
    if constexpr (NC == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    wp += (i64)ms * period * 128 + t;
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; i++) d[i] = 0.0f;
    uint4 fr[3][4];
#pragma unroll
    for (int tp = 0; tp < 2; tp++)
#pragma unroll
        for (int ks = 0; ks < 4; ks++) fr[tp][ks] = wp[(tp * 4 + ks) * 128];
    const int gq = lane >> 2;
    const float bv0 = b ? b[ms * 64 + 16 * warp + gq] : 0.0f, bv1 = b ? b[ms * 64 + 16 * warp + gq + 8] : 0.0f;
    int wb = 0;
    // with gn.ys (threads t < 64: channel ms * 64 + t): the item's statistics so far
    float rm = 0.0f, rM2 = 0.0f, rc = 0.0f;
    // reuse: the load number of the current item's first plane; the previous stage's buffer and
    // whether that stage was its plane's last use
    int base = 0, pbuf = 0;
    bool plast = false;
    for (int q = 0; cu.live;) {
        const ColItem pc = cu.c;
        const int pd = cu.d;
        const i64 pit = cu.it;
        if (accum) {
            const bf16* zb = z ? z : y;
#pragma unroll 4
            for (int i = 0; i < 16; i++) {
                const int idx = t + 128 * i, v = idx >> 3, c = idx & 7;
                const int gh = pc.h0 + (v >> 3), gw = pc.w0 + (v & 7);
                const bool ok = gh < H && gw < W;
                const bf16* src = zb + ((((i64)pc.n * D + pd) * H + gh) * W + gw) * CO + ms * 64 + c * 8;
                wm_cp16(stg + v * WM_YR + c * 16, ok ? src : zb, ok);
            }
            wm_cp_commit();
        }
        for (int k = 0; k < KS; k++, q++) {
            // reuse (KS = 3, k = kd): plane pd + k - 1 is load base + pd - d0 + k, first used by
            // output plane max(d0, plane - 1) and last by min(d1 - 1, plane + 1)
            const int buf = reuse ? (base + pd - pc.d0 + k) % NS : q % NS;
            const bool first = !reuse || k == 2 || pd == pc.d0, last = !reuse || k == 0 || pd == pc.d1 - 1;
            if (first) nb_sync(WS_FULL(buf), NT);
            const u32 sb = sbase + buf * WM_STAGE;
#pragma unroll
            for (int tap = 0; tap < 9; tap++) {
                const int kh = tap / 3, kw = tap % 3;
                wm_fence();
#pragma unroll
                for (int ks = 0; ks < 4; ks++)
                    wm_mma(d, fr[tap % 3][ks], wm_desc(sb + (kh * WM_PW + kw) * 128 + ks * 32),
                           !(k == 0 && tap == 0 && ks == 0));
                wm_commit();
                wm_wait<1>(d);
                // the previous stage's last MMAs are done: its buffer goes back to the producer
                // after its plane's last use
                if (tap == 0 && q > 0 && plast) nb_arrive(WS_EMPTY(pbuf), NT);
                int nx = wb + (tap + 2) * 4;
                nx = nx >= period ? nx - period : nx;
#pragma unroll
                for (int ks = 0; ks < 4; ks++) fr[(tap + 2) % 3][ks] = wp[(nx + ks) * 128];
            }
            pbuf = buf;
            plast = last;
            wm_next(cu, g, D, DC, KS);
            wb += 36;
            wb = wb >= period ? wb - period : wb;
        }
        if (reuse && (!cu.live || cu.it != pit)) base += pc.d1 - pc.d0 + 2;
        wm_wait<0>(d);
        if (accum) wm_cp_wait<0>();
        nb_sync(epi, 128);  // the old output landed (every consumer thread's copies)
        // with gb: the producer has read the previous plane's rows (its sums)
        if (gb.x) nb_sync(WB_EMPTY, 256);
#pragma unroll
        for (int jn = 0; jn < 32; jn += 2) {
            const int m = lane >> 3, v = 8 * (jn + (m >> 1)) + (lane & 7);
            const u32 a = stg + v * WM_YR + (16 * warp + 8 * (m & 1)) * 2;
            u32 o[4] = {0u, 0u, 0u, 0u};
            if (accum)
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                             : "=r"(o[0]), "=r"(o[1]), "=r"(o[2]), "=r"(o[3])
                             : "r"(a)
                             : "memory");
            u32 r[4];
#pragma unroll
            for (int mm = 0; mm < 4; mm++) {
                const int j = jn + (mm >> 1), i = mm & 1;
                const float bv = i ? bv1 : bv0;
                r[mm] = pack_bf2(d[4 * j + 2 * i] + bv + __uint_as_float(o[mm] << 16),
                                 d[4 * j + 2 * i + 1] + bv + __uint_as_float(o[mm] & 0xffff0000u));
            }
            asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(a),
                         "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                         : "memory");
        }
        nb_sync(epi, 128);
        if (gb.x) nb_arrive(WB_FULL, 256);  // the plane's rows for the producer's sums
        const i64 vb = (((i64)pc.n * D + pd) * H) * W;
        // with gn.ys, the statistics of the stored outputs: this thread's 8 channels ((t & 7) * 8
        // ..) over its 16 voxels, shifted by the plane's first voxel (always inside the volume)
        const unsigned char* srow = wm_smem + (stg - sbase);
        uint4 sh4 = make_uint4(0u, 0u, 0u, 0u);
        float su[8], sq[8];
        if (gn.ys) {
            sh4 = *reinterpret_cast<const uint4*>(srow + (t & 7) * 16);
#pragma unroll
            for (int j = 0; j < 8; j++) su[j] = sq[j] = 0.0f;
        }
#pragma unroll
        for (int it = 0; it < 16; it++) {
            const int idx = t + 128 * it, v = idx >> 3, c = idx & 7;
            const int gh = pc.h0 + (v >> 3), gw = pc.w0 + (v & 7);
            if (gh < H && gw < W) {
                const uint4 val = *reinterpret_cast<const uint4*>(srow + v * WM_YR + c * 16);
                *reinterpret_cast<uint4*>(y + (vb + (i64)gh * W + gw) * CO + ms * 64 + c * 8) = val;
                if (gn.ys) {
                    const u32 xv[4] = {val.x, val.y, val.z, val.w}, hv[4] = {sh4.x, sh4.y, sh4.z, sh4.w};
#pragma unroll
                    for (int e = 0; e < 8; e++) {
                        const u32 xw = xv[e >> 1], hw = hv[e >> 1];
                        const float x = __uint_as_float(e & 1 ? xw & 0xffff0000u : xw << 16);
                        const float h = __uint_as_float(e & 1 ? hw & 0xffff0000u : hw << 16);
                        const float dd = x - h;
                        su[e] += dd;
                        sq[e] = __fmaf_rn(dd, dd, sq[e]);
                    }
                }
            }
        }
        if (gn.ys) {
            // lanes l, l ^ 8, l ^ 16, l ^ 24 hold the same channels: lanes 0 .. 7 get the warp's
            // sums, the four warps' are added in order by the tile's 64 channel threads
#pragma unroll
            for (int e = 0; e < 8; e++) {
                su[e] += __shfl_xor_sync(0xffffffffu, su[e], 8);
                sq[e] += __shfl_xor_sync(0xffffffffu, sq[e], 8);
                su[e] += __shfl_xor_sync(0xffffffffu, su[e], 16);
                sq[e] += __shfl_xor_sync(0xffffffffu, sq[e], 16);
            }
            float* red = reinterpret_cast<float*>(wm_smem + XOFF + N * CI * 8);
            if (lane < 8) {
#pragma unroll
                for (int e = 0; e < 8; e++) {
                    red[(warp * 8 + lane) * 16 + e] = su[e];
                    red[(warp * 8 + lane) * 16 + 8 + e] = sq[e];
                }
            }
            nb_sync(epi, 128);
            if (t < 64) {
                const int c = t >> 3, e = t & 7;
                float ss = 0.0f, qq = 0.0f;
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    ss += red[(w * 8 + c) * 16 + e];
                    qq += red[(w * 8 + c) * 16 + 8 + e];
                }
                const bf16 hb = *reinterpret_cast<const bf16*>(srow + t * 2);
                const float cnt = (float)(min(WM_TH, H - pc.h0) * min(WM_TW, W - pc.w0));
                const float m = ss / cnt, mp = bf2f(hb) + m, m2p = fmaxf(qq - ss * m, 0.0f);
                // the plane merged into the item's statistics (Chan et al.), written once the
                // item's last plane is done
                if (rc == 0.0f) {
                    rm = mp;
                    rM2 = m2p;
                    rc = cnt;
                } else {
                    const float nc = rc + cnt, dl = mp - rm;
                    rm += dl * (cnt / nc);
                    rM2 += m2p + dl * dl * (rc * cnt / nc);
                    rc = nc;
                }
                if (!cu.live || cu.it != pit) {
                    float* o = gn.ys + (pit * CO + ms * 64 + t) * 3;
                    o[0] = rm;
                    o[1] = rM2;
                    o[2] = rc;
                    rc = 0.0f;
                }
            }
        }
        nb_sync(epi, 128);  // the staging rows read before the next plane writes them
    }
}
#endif

// the entry points (one profiler category each): grid (persistent items, CO / 64), block 256,
// dynamic shared memory WM_SMEM; b may be null; with accum the sums are added to z (a tensor of
// y's shape: conv + b + z) or, z null, to y itself; reuse: the window of input planes (64 input
// channels). UP (conv3d_wgmma_fwd_up): x is (N, D/2, H/2, W/2, CI) and the conv's input its
// trilinear doubling (the U-Net's Upsample), computed by the producer into each stage (up_stage)
// instead of copied, so the doubled volume is never stored; D, H, W even
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WM_BODY wgmma_conv_body(x, wp, b, y, z, N, CI, CO, D, H, W, DC, accum, WmGn{}, reuse)
#else
#define WM_BODY
#endif
#define WGMMA_ENTRY(NAME)                                                                            \
    extern "C" __global__ void __launch_bounds__(256, 1)                                             \
        NAME(const bf16* x, const uint4* wp, const float* b, bf16* y, const bf16* z, int N, int CI, \
             int CO, int D, int H, int W, int DC, int accum, int reuse) {                           \
        WM_BODY;                                                                                     \
    }
WGMMA_ENTRY(conv3d_wgmma_fwd)
WGMMA_ENTRY(conv3d_wgmma_dgrad)
// the forward over the doubling of x (x: (N, D/2, H/2, W/2, CI)): the Upsample's conv; grid, block
// and shared memory as conv3d_wgmma_fwd
extern "C" __global__ void __launch_bounds__(256, 1)
    conv3d_wgmma_fwd_up(const bf16* x, const uint4* wp, const float* b, bf16* y, const bf16* z, int N, int CI,
                        int CO, int D, int H, int W, int DC, int accum, int reuse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wgmma_conv_body<1, WM_NS, 1>(x, wp, b, y, z, N, CI, CO, D, H, W, DC, accum, WmGn{}, reuse);
#endif
}
// The Upsample conv's data gradient (as conv3d_wgmma_dgrad: x = dy with CI = 64 channels, the window
// of planes, y = dx overwritten; grid, block and shared memory the same) whose producer also
// writes u, the trilinear doubling of xs (N, D/2, H/2, W/2, CO), at the tiles of its output
// (up_tile, after each own plane's copies): the conv's input, which its weight gradient reads
// next, without a separate upsampling pass (the producer waits for free stages most of the time)
extern "C" __global__ void __launch_bounds__(256, 1)
    conv3d_wgmma_dgrad_up(const bf16* x, const uint4* wp, const float* b, bf16* y, const bf16* z, int N, int CI,
                          int CO, int D, int H, int W, int DC, int accum, int reuse, const bf16* xs, bf16* u) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wgmma_conv_body<1, WM_NS, 2>(x, wp, b, y, z, N, CI, CO, D, H, W, DC, accum, WmGn{}, reuse, WmGb{}, WmUp{xs, u});
#endif
}
// The data gradient with a result of 128k channels: two MMA warpgroups a block, each one of the two
// 64-channel slices of blockIdx.y (grid (items, CO / 128)), on the same staged dy planes (loaded
// once for both, against once per slice), a ring of three stages (the two warpgroups' staging rows
// take the fourth's room), registers moved from the producer to them (setmaxnreg: 40 and 232 a
// thread). Both wait for the same stages and share the tensor pipe, so they finish a plane and
// store it together: the epilogues are not hidden behind the other's MMAs (work in an epilogue
// costs as in the one-slice kernel, docs/perf/h200-2026-12-03n). Block 384, dynamic shared memory
// WM_DUAL_SMEM.
#define WM_DUAL_SMEM (3 * WM_STAGE + 2 * WM_TH * WM_TW * WM_YR)
extern "C" __global__ void __launch_bounds__(384, 1)
    conv3d_wgmma_dgrad2(const bf16* x, const uint4* wp, const float* b, bf16* y, const bf16* z, int N, int CI,
                        int CO, int D, int H, int W, int DC, int accum, int reuse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wgmma_conv_body<2, 3>(x, wp, b, y, z, N, CI, CO, D, H, W, DC, accum, WmGn{}, reuse);
#endif
}
// the data gradient with the GroupNorm+SiLU backward's channel sums of its output (WmGb): grid as
// the others, block 256, dynamic shared memory WM_SMEM + 16 * N * CO + WM_GBSUMS; no accumulation
extern "C" __global__ void __launch_bounds__(256, 1)
    conv3d_wgmma_dgrad_gnb(const bf16* x, const uint4* wp, bf16* y, int N, int CI, int CO, int D, int H, int W,
                           int DC, int reuse, const bf16* gx, const float* mean, const float* rstd,
                           const float* gamma, const float* beta, const float* off, int G, float* part, int x3,
                           float* dys) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wgmma_conv_body(x, wp, nullptr, y, nullptr, N, CI, CO, D, H, W, DC, 0, WmGn{}, reuse,
                    WmGb{gx, mean, rstd, gamma, beta, off, G, part, x3, dys});
#endif
}
// grid as the others, block 256, dynamic shared memory WM_SMEM + 8 * N * CI (the table) + WM_YSUMS; x2 /
// CA: x is cat(x, x2) at channel CA (see WmGn), x2 = 0 for one input; ys: see WmGn
extern "C" __global__ void __launch_bounds__(256, 1)
    conv3d_wgmma_fwd_gn(const bf16* x, const uint4* wp, const float* b, bf16* y, const bf16* z, int N, int CI,
                        int CO, int D, int H, int W, int DC, int accum, const float* mean, const float* rstd,
                        const float* gamma, const float* beta, const float* off, int G, const bf16* x2, int CA,
                        float* ys, int reuse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wgmma_conv_body(x, wp, b, y, z, N, CI, CO, D, H, W, DC, accum, WmGn{mean, rstd, gamma, beta, off, G, x2, CA, ys},
                  reuse);
#endif
}

// -- conv3d_wgmma_wgrad: the weight gradient of the same convs (cuDNN's wgrad of 64 -> 64 at 128^3
// ran at ~48 % of the bf16 peak, 0.96-0.99 ms, five of them a whole-head training step):
//   dW[co, t, ci] = sum over n and voxels v of dy[n, v, co] * x[n, v + off(t), ci]
// GEMM view: M = 64 output channels (slice blockIdx.z), N = the three taps kw x 64 input channels
// (group cg), K = voxels; blockIdx.y = kd * CG + cg. Three warpgroups a block, warpgroup g the
// taps kh = g, each wgmma.m64n192k16 with both operands in shared memory, both M/N-major:
//   A = dy^T: a tile's 256 voxel rows (the forward's 32 x 8 tile) of 64 channels, 128 bytes each,
//     128-byte swizzled as the forward's stages; a k step of 16 voxels is two tile rows of 8, the
//     second 1024 bytes on (the stride byte offset);
//   B = halo plane d + kd - 1 of x, the forward's stage; the k step's 16 voxels shifted by (kh, kw)
//     start at halo row (2s + kh) * WM_PW + kw, the second 8 one halo row (WM_PW * 128 bytes, the
//     stride byte offset) on, and N's three kw blocks of 64 channels are one row (128 bytes, the
//     leading byte offset) apart: one MMA reads all three taps.
// The sums stay in registers over the block's whole run of tiles (no per-plane epilogue: the MMAs
// stream); ring of WW_NS stages (dy tile + x halo plane) loaded with cp.async two tiles ahead by
// all 384 threads. At the end each block writes its partial dW in f32 (dW's (CO, 27, CI) layout, one
// chunk per blockIdx.x); conv3d_wgmma_wgrad_sum adds the chunks onto dW in a fixed order.
// grid (P chunks, 3 * CI / 64, CO / 64), block 384, dynamic shared memory WW_NS * WW_STAGE.
#define WW_DY (WM_TH * WM_TW * 128)     // a tile of dy: 256 voxel rows of 64 channels (32768 bytes)
#define WW_STAGE (WW_DY + WM_STAGE)     // + the halo plane of x (76800 bytes, a multiple of 1 KB)
#define WW_NS 3
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WW_R96 WM_R8(0), WM_R8(8), WM_R8(16), WM_R8(24), WM_R8(32), WM_R8(40), WM_R8(48), WM_R8(56), WM_R8(64), \
               WM_R8(72), WM_R8(80), WM_R8(88)
// d (+)= A * B, m64n192k16, A and B from shared memory, both transposed (M-major, N-major); acc = 0
// overwrites
__device__ __forceinline__ void ww_mma(float* d, u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %98, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95}, %96, %97, p, 1, 1, 1, 1;\n}\n"
        : WW_R96
        : "l"(da), "l"(db), "r"(acc));
}
template <int N>
__device__ __forceinline__ void ww_wait(float* d) {
    asm volatile("wgmma.wait_group.sync.aligned %96;\n" : WW_R96 : "n"(N) : "memory");
}
#undef WW_R96
#undef WM_R8
// The weight-gradient kernels' run of tiles (n, d, h tile, w tile), w fastest, for chunk blockIdx.x
// of gridDim.x: the same run for every (kd, cg, ms) block, so the blocks reading one tile of dy run
// at the same time (L2); cnt tiles (>= 1: the host gives no block an empty run). (lw, lh, ld, ln)
// is the load cursor: the tile the next load copies, stepped one tile a load (ww_next).
struct WwRun {
    int cnt, wb, hb, D;
    int lw, lh, ld, ln;
};
__device__ __forceinline__ WwRun ww_run(int N, int D, int H, int W, int th, int tw) {
    WwRun r;
    r.hb = (H + th - 1) / th;
    r.wb = (W + tw - 1) / tw;
    r.D = D;
    const i64 T = (i64)N * D * r.hb * r.wb;
    const i64 i0 = T * blockIdx.x / gridDim.x;
    r.cnt = (int)(T * (blockIdx.x + 1) / gridDim.x - i0);
    r.lw = (int)(i0 % r.wb);
    r.lh = (int)((i0 / r.wb) % r.hb);
    const i64 nd = i0 / ((i64)r.wb * r.hb);
    r.ld = (int)(nd % D);
    r.ln = (int)(nd / D);
    return r;
}
__device__ __forceinline__ void ww_next(WwRun& r) {
    if (++r.lw == r.wb) {
        r.lw = 0;
        if (++r.lh == r.hb) {
            r.lh = 0;
            if (++r.ld == r.D) {
                r.ld = 0;
                r.ln++;
            }
        }
    }
}
// A thread's halo-plane rows r0 + step * j (j < 8; clamped to the plane's last, pl - 1) as
// (row / pw, row % pw) packed h * 16 + w: per tile only the bases and the bounds change.
__device__ __forceinline__ void ww_halo_rows(u32* xhw, int r0, int step, int pl, int pw) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int r = min(r0 + step * j, pl - 1);
        xhw[j] = (u32)((r / pw) * 16 + r % pw);
    }
}
#endif
extern "C" __global__ void __launch_bounds__(384, 1)
    conv3d_wgmma_wgrad(const bf16* x, const bf16* dy, float* part, int N, int CI, int CO, int D, int H, int W) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char wm_smem[];
    const int CG = CI / 64, kd = blockIdx.y / CG, cg = blockIdx.y - kd * CG, ms = blockIdx.z;
    const int tid = threadIdx.x, kh = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    WwRun run = ww_run(N, D, H, W, WM_TH, WM_TW);
    const int cnt = run.cnt;
    const u32 sbase = (u32)__cvta_generic_to_shared(wm_smem);
    // Copies: this thread's 16-byte chunk c of rows r0 + 48 j: dy rows v (tile row (r0 >> 3) + 6 j,
    // column r0 & 7; j < 6), x halo rows (j < 8). 48 rows are 0 mod 8, so every row's swizzle
    // phase is r0 & 7: the destinations are one offset + 6144 j. Per tile only the bases and the
    // bounds change (the first version did 64-bit index arithmetic per copy and tile: ~900
    // instructions a warp per tile, ncu).
    const int c = tid & 7, r0 = tid >> 3;
    const u32 dst0 = r0 * 128 + ((c ^ (r0 & 7)) << 4);
    const int yh = r0 >> 3, yw = r0 & 7;
    // x halo rows of this thread, (row / WM_PW, row % WM_PW) packed as h * 16 + w: rows r0 + 48 j
    // for j < 7 are inside the plane (r0 + 288 < WM_PL), j = 7 for r0 < 4 only (warp 0); dy's j = 5
    // for r0 < 16 only (warps 0 and 1): warp-uniform branches
    u32 xhw[8];
    ww_halo_rows(xhw, r0, 48, WM_PL, WM_PW);
    auto load = [&](int i, int buf) {
        if (i < cnt) {
            const int ln = run.ln, ld = run.ld, w0 = run.lw * WM_TW, h0 = run.lh * WM_TH, dd = ld + kd - 1;
            const bool pin = dd >= 0 && dd < D;
            const u32 sa = sbase + buf * WW_STAGE + dst0, sx = sa + WW_DY;
            const bf16* yb = dy + ((((i64)ln * D + ld) * H + h0 + yh) * W + w0 + yw) * CO + ms * 64 + c * 8;
            const bool wok = w0 + yw < W;
            auto ycopy = [&](int j) {
                const bool ok = wok && h0 + yh + 6 * j < H;
                wm_cp16(sa + 6144 * j, ok ? yb + 6 * j * W * CO : dy, ok);
            };
#pragma unroll
            for (int j = 0; j < 5; j++) ycopy(j);
            if (r0 < 16) ycopy(5);
            const bf16* xb = x + ((((i64)ln * D + dd) * H + h0 - 1) * W + w0 - 1) * CI + cg * 64 + c * 8;
            auto xcopy = [&](int j) {
                const int hh = (int)(xhw[j] >> 4), ww = (int)(xhw[j] & 15);
                const bool ok = pin && (unsigned)(h0 - 1 + hh) < (unsigned)H && (unsigned)(w0 - 1 + ww) < (unsigned)W;
                wm_cp16(sx + 6144 * j, ok ? xb + (hh * W + ww) * CI : x, ok);
            };
#pragma unroll
            for (int j = 0; j < 7; j++) xcopy(j);
            if (r0 < 4) xcopy(7);
            ww_next(run);
        }
        wm_cp_commit();
    };
    // descriptors of stage 0's first k step; a stage and a k step are offsets added to the start
    // address field (addresses stay below 256 KB: no carry out of its 14 bits)
    const u64 da0 = wm_desc_at(sbase, 8192, 1024), db0 = wm_desc_at(sbase + WW_DY + kh * WM_PW * 128, 128, WM_PW * 128);
    float d[96];  // set by the first MMA (scale-d 0); cnt >= 1 (the host gives no block an empty run)
    load(0, 0);
    load(1, 1);
    int buf = 0, lbuf = 2;
    for (int i = 0; i < cnt; i++) {
        wm_cp_wait<1>();  // tile i landed (tile i + 1's copies may still fly)
        __syncthreads();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        const u64 so = (u64)((buf * WW_STAGE) >> 4);
        wm_fence();
#pragma unroll
        for (int s = 0; s < 16; s++)
            ww_mma(d, da0 + so + (s * 2048 >> 4), db0 + so + (2 * s * WM_PW * 128 >> 4), i > 0 || s > 0);
        wm_commit();
        ww_wait<1>(d);    // this warpgroup's MMAs of tile i - 1 are done
        __syncthreads();  // everyone's: tile i - 1's buffer is free
        load(i + 2, lbuf);
        buf = buf == WW_NS - 1 ? 0 : buf + 1;
        lbuf = lbuf == WW_NS - 1 ? 0 : lbuf + 1;
    }
    ww_wait<0>(d);
    wm_cp_wait<0>();
    // the partial sums: D[co][kw * 64 + ci] of m64n192 at d[4 j + 2 i + e] = (row 16 warp + lane / 4
    // + 8 i, column 8 j + 2 (lane % 4) + e)
    const int gq = lane >> 2;
    float* pb = part + (i64)blockIdx.x * CO * 27 * CI;
#pragma unroll
    for (int j = 0; j < 24; j++) {
        const int kw = j >> 3, ci = cg * 64 + (j & 7) * 8 + 2 * (lane & 3), t = kd * 9 + kh * 3 + kw;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int co = ms * 64 + 16 * warp + gq + 8 * i;
            *reinterpret_cast<float2*>(pb + ((i64)co * 27 + t) * CI + ci) = make_float2(d[4 * j + 2 * i], d[4 * j + 2 * i + 1]);
        }
    }
#endif
}
// -- conv3d_wgmma_wgrad_tf32: the same weight gradient for TF32 (f32 NDHWC x and dy, each operand
// rounded to TF32 (cvt.rna, as cuDNN's TF32 convs read them), f32 sums). wgmma's tf32 form takes
// no transposed shared-memory operand: K must be contiguous in memory, and K is the voxels here
// while NDHWC keeps a voxel's channels contiguous. So the roles change:
//   A = x (M = the 64 input channels of group cg, K = 8 voxels of a halo row, shifted by kw) in
//     registers, loaded from the halo plane as it was copied (two 8-byte loads a thread: a pair of
//     channels at two voxels; a tap's shift is only an address);
//   B = dy^T (N = the 64 output channels of slice ms, K = a tile row's 8 voxels) in shared memory,
//     K-major and 128-byte swizzled (rows of 32 voxels, 8 KB a 32-voxel block): each stage's dy
//     tile, copied as stored, is transposed into it by all threads, rounded to TF32 on the way.
// Warpgroup g takes the taps kw = g; the A fragment of halo row r serves its three taps kh (output
// tile row s = r - kh): up to three m64n64k8 MMAs into three sets of sums (96 f32 a thread), each
// halo row read once. Output tile 16 x 8 (halo plane 18 x 10 voxels of 256 bytes); two stages of
// (dy tile, halo plane) as stored, loaded with cp.async one tile ahead, and two transposed dy
// tiles: 218 KB. A's rows are the channels permuted: logical row 16 w + q (+ 8) of warp w is
// channel 16 w + 2 q (+ 1), so a thread's two rows are one 8-byte load (the epilogue maps back).
// Swizzles (16-byte chunk c of a 256-byte voxel row v): the dy copy at c ^ (v & 7) (the
// transposition's 16-byte loads, eight voxels apart, hit distinct banks), the halo plane at
// c ^ ((v & 3) << 1) (the A loads of four consecutive voxels spread over all 32 banks).
// Same partial-dW output and grid as conv3d_wgmma_wgrad: (P chunks, 3 * CI / 64, CO / 64), 384
// threads, WT_SMEM bytes of dynamic shared memory.
#define WT_TH 16
#define WT_TW 8
#define WT_PW (WT_TW + 2)                 // 10 halo voxels a row
#define WT_PL ((WT_TH + 2) * WT_PW)       // 180 halo voxels a plane
#define WT_DY (WT_TH * WT_TW * 256)       // a dy tile of 64 f32 channels (32768 bytes), either form
#define WT_STAGE (WT_DY + WT_PL * 256)    // + the halo plane (46080 bytes): 78848, a multiple of 1 KB
#define WT_SMEM (2 * WT_DY + 2 * WT_STAGE)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WT_R8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
// d (+)= A * B, m64n64k8, A (tf32) from registers, B from shared memory (K-major); acc = 0
// overwrites
__device__ __forceinline__ void wt_mma(float* d, const u32* a, u64 desc, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : WT_R8(0), WT_R8(8), WT_R8(16), WT_R8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}
#undef WT_R8
__device__ __forceinline__ u32 wt_rna(float v) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
    return r;
}
#endif
extern "C" __global__ void __launch_bounds__(384, 1)
    conv3d_wgmma_wgrad_tf32(const float* x, const float* dy, float* part, int N, int CI, int CO, int D, int H, int W) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char wm_smem[];
    const int CG = CI / 64, kd = blockIdx.y / CG, cg = blockIdx.y - kd * CG, ms = blockIdx.z;
    const int tid = threadIdx.x, kw = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    WwRun run = ww_run(N, D, H, W, WT_TH, WT_TW);
    const int cnt = run.cnt;
    const u32 sbase = (u32)__cvta_generic_to_shared(wm_smem);
    // shared memory: the transposed dy tiles at 0 and WT_DY, stage s at 2 WT_DY + s WT_STAGE (dy as
    // stored, then the halo plane)
    // Copies: this thread's 16-byte chunk c of voxel rows v0 + 24 j (24 is 0 mod 8: every row's
    // swizzle is v0's, the destinations one offset + 6144 j): dy rows j < 5, j = 5 for v0 < 8
    // (warps 0-3); halo rows j < 7, j = 7 for v0 < 12 (warps 0-5): warp-uniform branches
    const int c = tid & 15, v0 = tid >> 4;
    const u32 ydst = v0 * 256 + ((c ^ (v0 & 7)) << 4), xdst = WT_DY + v0 * 256 + ((c ^ ((v0 & 3) << 1)) << 4);
    const int yh = v0 >> 3, yw = v0 & 7;
    u32 xhw[8];
    ww_halo_rows(xhw, v0, 24, WT_PL, WT_PW);
    auto load = [&](int i, int buf) {
        if (i < cnt) {
            const int ln = run.ln, ld = run.ld, w0 = run.lw * WT_TW, h0 = run.lh * WT_TH, dd = ld + kd - 1;
            const bool pin = dd >= 0 && dd < D;
            const u32 sa = sbase + 2 * WT_DY + buf * WT_STAGE;
            const float* yb = dy + ((((i64)ln * D + ld) * H + h0 + yh) * W + w0 + yw) * CO + ms * 64 + c * 4;
            const bool wok = w0 + yw < W;
            auto ycopy = [&](int j) {
                const bool ok = wok && h0 + yh + 3 * j < H;
                wm_cp16(sa + ydst + 6144 * j, ok ? yb + 3 * j * W * CO : dy, ok);
            };
#pragma unroll
            for (int j = 0; j < 5; j++) ycopy(j);
            if (v0 < 8) ycopy(5);
            const float* xb = x + ((((i64)ln * D + dd) * H + h0 - 1) * W + w0 - 1) * CI + cg * 64 + c * 4;
            auto xcopy = [&](int j) {
                const int hh = (int)(xhw[j] >> 4), ww = (int)(xhw[j] & 15);
                const bool ok = pin && (unsigned)(h0 - 1 + hh) < (unsigned)H && (unsigned)(w0 - 1 + ww) < (unsigned)W;
                wm_cp16(sa + xdst + 6144 * j, ok ? xb + (hh * W + ww) * CI : x, ok);
            };
#pragma unroll
            for (int j = 0; j < 7; j++) xcopy(j);
            if (v0 < 12) xcopy(7);
            ww_next(run);
        }
        wm_cp_commit();
    };
    // A loads: channels cc, cc + 1 of halo voxels 10 r + kw + t4 (+ 4); the swizzle phase of
    // voxel v is v & 3, (2 r + kw + t4) & 3: offsets for even and odd r (the + 4 voxel has the same
    // phase, 1024 bytes on)
    const int q = lane >> 2, t4 = lane & 3, cc = 16 * warp + 2 * q, u = kw + t4;
    u32 aoff[2];
#pragma unroll
    for (int p = 0; p < 2; p++) aoff[p] = u * 256 + ((((cc >> 2) ^ (((u + 2 * p) & 3) << 1)) << 4) | ((cc & 3) * 4));
    // transposition task k (of 64): 32-voxel block k >> 4, channels 4 (k & 15) .. + 3, voxel = lane
    const int tw = tid >> 5;
    float d[96];  // set by each set's first MMA (tile 0, s = 0: scale-d 0); cnt >= 1
    load(0, 0);
    for (int i = 0; i < cnt; i++) {
        const int buf = i & 1;
        wm_cp_wait<0>();  // tile i landed
        // for everyone; and everyone's A loads of tile i - 1 are done (its stage buffer is free)
        // and their MMAs of tile i - 2 (this dyT buffer); one barrier less a tile than loading at
        // the tile's end (ncu: 21 % of the warps' stall samples at barriers)
        __syncthreads();
        load(i + 1, buf ^ 1);  // lands while tile i's MMAs run
        const unsigned char* st = wm_smem + 2 * WT_DY + buf * WT_STAGE;
        unsigned char* yt = wm_smem + buf * WT_DY;
        for (int k = tw; k < 64; k += 12) {
            const int a = k >> 4, cq = k & 15, v = a * 32 + lane;
            const float4 f = *reinterpret_cast<const float4*>(st + v * 256 + ((cq ^ (v & 7)) << 4));
            const float fv[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int co = 4 * cq + e;
                *reinterpret_cast<u32*>(yt + a * 8192 + co * 128 + ((((lane >> 2) ^ (co & 7))) << 4) + (lane & 3) * 4) =
                    wt_rna(fv[e]);
            }
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        const unsigned char* xs = st + WT_DY;
        const u64 db = wm_desc_at(sbase + buf * WT_DY, 16, 1024);
        u32 a[3][4];
        ww_wait<2>(d);  // the previous tile's row 15 (A set 0) is done
        auto aload = [&](int r, u32* s) {
            const unsigned char* p = xs + r * (WT_PW * 256) + aoff[r & 1];
            const float2 lo = *reinterpret_cast<const float2*>(p), hi = *reinterpret_cast<const float2*>(p + 1024);
            s[0] = wt_rna(lo.x);
            s[1] = wt_rna(lo.y);
            s[2] = wt_rna(hi.x);
            s[3] = wt_rna(hi.y);
        };
        aload(0, a[0]);
#pragma unroll
        for (int r = 0; r < WT_TH + 2; r++) {
            if (r + 1 < WT_TH + 2) {
                ww_wait<1>(d);  // row r - 2's MMAs (A set (r + 1) % 3) are done
                aload(r + 1, a[(r + 1) % 3]);
            }
            wm_fence();
#pragma unroll
            for (int kh = 0; kh < 3; kh++) {
                const int s = r - kh;
                if (s >= 0 && s < WT_TH) wt_mma(d + 32 * kh, a[r % 3], db + (u64)(((s >> 2) * 8192 + (s & 3) * 32) >> 4), i > 0 || s > 0);
            }
            wm_commit();
        }
    }
    ww_wait<0>(d);
    wm_cp_wait<0>();
    // the partial sums: set kh's m64n64 at d[32 kh + 4 j + 2 i + e] = (logical row 16 warp + q + 8 i:
    // channel cc + i, column 8 j + 2 t4 + e: output channel)
    float* pb = part + (i64)blockIdx.x * CO * 27 * CI;
#pragma unroll
    for (int kh = 0; kh < 3; kh++) {
        const int t = kd * 9 + kh * 3 + kw, ci = cg * 64 + cc;
#pragma unroll
        for (int j = 0; j < 8; j++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int co = ms * 64 + 8 * j + 2 * t4 + e;
                *reinterpret_cast<float2*>(pb + ((i64)co * 27 + t) * CI + ci) =
                    make_float2(d[32 * kh + 4 * j + e], d[32 * kh + 4 * j + 2 + e]);
            }
        }
    }
#endif
}
// dw[i] += sum over chunks k < P of part[k * L + i] (k in order), float4 at a time; L a multiple of 4
extern "C" __global__ void conv3d_wgmma_wgrad_sum(const float* part, float* dw, i64 L, int P) {
    const i64 L4 = L / 4;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < L4; i += (i64)gridDim.x * blockDim.x) {
        float4 s = reinterpret_cast<const float4*>(part)[i];
        for (int k = 1; k < P; k++) {
            const float4 v = reinterpret_cast<const float4*>(part + (i64)k * L)[i];
            s.x += v.x;
            s.y += v.y;
            s.z += v.z;
            s.w += v.w;
        }
        float4 o = reinterpret_cast<float4*>(dw)[i];
        o.x += s.x;
        o.y += s.y;
        o.z += s.z;
        o.w += s.w;
        reinterpret_cast<float4*>(dw)[i] = o;
    }
}
