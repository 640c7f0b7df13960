// sampler.cu: one step of any sampler (Backend::sampler_step; CPU twin crates/meddpm/src/cpu/sampler.rs):
// x0 from x and eps, optional clip, d (x0 or the eps consistent with it), then
// x = cd*d + cx*x + sum_k ch[k]*h[k] + cz*z with z drawn per sample from Philox (philox_normal of
// diffusion.cu, element j in logical NCDHW order within the sample), and d written into the last
// history buffer. A zero coefficient skips its term (its buffer is not read, no noise is drawn).
// Per-sample coefficients arrive by value, 16 samples per launch (the host loops over larger batches).

struct SamplerCoef {
    float v[16 * 8];  // per sample: recip, recipm1, cx, cd, ch0, ch1, ch2, cz
    u64 seed[16];
    u64 stream[16];
    u64 offset[16];
};

// Samples n0.. of `per` elements each (pointers already offset); h0..h2: the history (nh of them,
// newest first), d is written into h[nh-1] after it is read.
extern "C" __global__ void sampler_step(float* x, const float* eps, float* h0, float* h1, float* h2, int nh,
                                        int noise_pred, int clip, SamplerCoef k, int C, i64 S, int cl, i64 per,
                                        i64 total) {
    GRID_STRIDE(i, total) {
        int n = sample_of(i, per);
        const float* c = k.v + 8 * n;
        i64 r = i - (i64)n * per;
        float* hl = nh == 1 ? h0 : nh == 2 ? h1 : h2;
        bool need_d = c[3] != 0.0f || nh > 0;
        bool need_x = need_d || c[2] != 0.0f;
        float xi = need_x ? x[i] : 0.0f;
        float d = 0.0f;
        if (need_d) {
            float e = eps[i];
            float x0u = c[0] * xi - c[1] * e;
            float x0 = clip ? fminf(fmaxf(x0u, -1.0f), 1.0f) : x0u;
            d = noise_pred ? e + (x0u - x0) / c[1] : x0;
        }
        // the sum in the CPU twin's order; `any` marks that acc holds a first term
        float acc = 0.0f;
        bool any = false;
        if (c[3] != 0.0f) {
            acc = c[3] * d;
            any = true;
        }
        if (c[2] != 0.0f) {
            acc = any ? acc + c[2] * xi : c[2] * xi;
            any = true;
        }
        const float* hs[3] = {h0, h1, h2};
#pragma unroll
        for (int j = 0; j < 3; j++) {
            if (j < nh && c[4 + j] != 0.0f) {
                float t = c[4 + j] * hs[j][i];
                acc = any ? acc + t : t;
                any = true;
            }
        }
        if (nh > 0) hl[i] = d;
        if (c[7] != 0.0f) {
            i64 j = cl ? (r % C) * S + r / C : r;
            float t = c[7] * philox_normal(k.seed[n], k.stream[n], k.offset[n] + (u64)j);
            acc = any ? acc + t : t;
        }
        x[i] = acc;
    }
}
