// diffusion.cu: the Philox4x32-10 normal sampler (bit-for-bit twin of crates/meddpm/src/rng.rs),
// q_sample and one ancestral DDPM step. Per-sample coefficients arrive by value, 16 samples per
// launch (the host loops over larger batches).

#define PH_M0 0xD2511F53u
#define PH_M1 0xCD9E8D57u
#define PH_W0 0x9E3779B9u
#define PH_W1 0xBB67AE85u

__device__ __forceinline__ void philox4x32_10(u32 c[4], u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < 10; r++) {
        u32 hi0 = __umulhi(PH_M0, c[0]), lo0 = PH_M0 * c[0];
        u32 hi1 = __umulhi(PH_M1, c[2]), lo1 = PH_M1 * c[2];
        u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
        k0 += PH_W0;
        k1 += PH_W1;
    }
}

// Draw i of stream `stream` under key `seed`: Box-Muller cosine branch in double, rounded to float.
// Explicit _rn intrinsics keep the compiler from contracting anything into an FMA.
__device__ __forceinline__ float philox_normal(u64 seed, u64 stream, u64 i) {
    u32 c[4] = {(u32)i, (u32)(i >> 32), (u32)stream, (u32)(stream >> 32)};
    philox4x32_10(c, (u32)seed, (u32)(seed >> 32));
    const double inv32 = 1.0 / 4294967296.0;
    double u1 = __dmul_rn(__dadd_rn((double)c[0], 1.0), inv32);
    double u2 = __dmul_rn((double)c[1], inv32);
    const double tau = 6.283185307179586;
    return (float)__dmul_rn(sqrt(__dmul_rn(-2.0, log(u1))), cos(__dmul_rn(tau, u2)));
}

// out (N, C, S) in layout cl: memory element with logical NCDHW index j gets normal(offset + j).
extern "C" __global__ void randn(float* out, u64 seed, u64 stream, u64 offset, int C, i64 S, i64 total, int cl) {
    GRID_STRIDE(i, total) {
        i64 j = i;
        if (cl) {
            i64 n = i / (S * C), r = i % (S * C);
            j = (n * C + r % C) * S + r / C;
        }
        out[i] = philox_normal(seed, stream, offset + (u64)j);
    }
}

struct QCoef {
    float a[16];
    float b[16];
};

// xt = a[n]*x0 + b[n]*eps for samples n0.. of `per` elements each (pointers already offset).
extern "C" __global__ void q_sample(float* xt, const float* x0, const float* eps, QCoef k, i64 per, i64 total) {
    GRID_STRIDE(i, total) {
        int n = (int)(i / per);
        xt[i] = k.a[n] * x0[i] + k.b[n] * eps[i];
    }
}

// The training step's network input in one pass (Backend::q_sample_input): eps = N(0, 1) drawn
// as randn draws it (the element of logical NCDHW index j gets normal(offset + j)), x_t = a[n]*x0 +
// b[n]*eps as q_sample forms it, input = cat([x_t, cond]) along channels (ci image channels, cc
// condition channels), x_t never stored. Grid-stride over the launch's (sample, voxel) pairs;
// pointers and offset already advanced to its first sample; cl: NDHWC. (randn, q_sample and
// concat_channels were three passes, ~85 µs at 128³; the draws' double-precision Box-Muller
// bounds this one.)
extern "C" __global__ void q_sample_input(float* input, float* eps, const float* x0, const float* cond, QCoef k,
                                          u64 seed, u64 stream, u64 offset, int ci, int cc, i64 S, i64 total,
                                          int cl) {
    const int C = ci + cc;
    GRID_STRIDE(v, total) {
        const i64 n = v / S, s = v % S;
        float a = 0.0f, b = 0.0f;  // k.a[n] by constant indices: no local copy of the parameters
#pragma unroll
        for (int j = 0; j < 16; j++)
            if (j == n) a = k.a[j], b = k.b[j];
        for (int c = 0; c < ci; c++) {
            const i64 j = (n * ci + c) * S + s;
            const i64 m = cl ? (n * S + s) * ci + c : j;
            const float e = philox_normal(seed, stream, offset + (u64)j);
            eps[m] = e;
            input[cl ? (n * S + s) * C + c : (n * C + c) * S + s] = a * x0[m] + b * e;
        }
        for (int c = 0; c < cc; c++)
            input[cl ? (n * S + s) * C + ci + c : (n * C + ci + c) * S + s] =
                cond[cl ? (n * S + s) * cc + c : (n * cc + c) * S + s];
    }
}

struct DdpmCoef {
    float v[16 * 5];  // per sample: recip, recipm1, coef1, coef2, sigma
};

extern "C" __global__ void ddpm_step(float* x, const float* eps, const float* z, DdpmCoef k, i64 per, i64 total) {
    GRID_STRIDE(i, total) {
        const float* c = k.v + 5 * (int)(i / per);
        float xi = x[i];
        float x0 = fminf(fmaxf(c[0] * xi - c[1] * eps[i], -1.0f), 1.0f);
        x[i] = c[2] * x0 + c[3] * xi + c[4] * z[i];
    }
}
