// elementwise.cu: residual adds, scaling, per-channel broadcast adds and channel concat/split, for
// both layouts. Semantics: crates/meddpm/src/backend.rs (add_assign, scale, add_channel_bias,
// concat_channels, split_channels) and the conv/linear bias adds.

extern "C" __global__ void add_assign(float* dst, const float* src, i64 n) {
    GRID_STRIDE(i, n) dst[i] += src[i];
}

extern "C" __global__ void scale_buf(float* buf, float s, i64 n) {
    GRID_STRIDE(i, n) buf[i] *= s;
}

// x[n, c, s] += bias[per_n ? n*C + c : c] over an (N, C, S) activation in layout cl.
extern "C" __global__ void add_channel_bias(float* x, const float* bias, int C, i64 S, i64 total, int cl, int per_n) {
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        int j = per_n ? (int)(i / ((i64)C * S)) * C + c : c;
        x[i] += bias[j];
    }
}

// out (N, ca+cb, S) = cat(a (N, ca, S), b (N, cb, S)) along channels.
extern "C" __global__ void concat_channels(float* out, const float* a, const float* b, int ca, int cb, i64 S,
                                           i64 total, int cl) {
    int C = ca + cb;
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        i64 n = i / ((i64)C * S);
        i64 s = cl ? (i / C) % S : i % S;
        out[i] = c < ca ? (cl ? a[(n * S + s) * ca + c] : a[(n * ca + c) * S + s])
                        : (cl ? b[(n * S + s) * cb + (c - ca)] : b[(n * cb + (c - ca)) * S + s]);
    }
}

// Backward of concat: da, db from dout, each overwritten or accumulated.
extern "C" __global__ void split_channels(float* da, float* db, const float* dout, int ca, int cb, i64 S, i64 total,
                                          int cl, int acc_a, int acc_b) {
    int C = ca + cb;
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        i64 n = i / ((i64)C * S);
        i64 s = cl ? (i / C) % S : i % S;
        float v = dout[i];
        if (c < ca) {
            i64 j = cl ? (n * S + s) * ca + c : (n * ca + c) * S + s;
            da[j] = acc_a ? da[j] + v : v;
        } else {
            i64 j = cl ? (n * S + s) * cb + (c - ca) : (n * cb + (c - ca)) * S + s;
            db[j] = acc_b ? db[j] + v : v;
        }
    }
}

// Zero-padding along N and C for the conv channel padding (conv3d.rs): dst (Np, Cp, S) gets
// src (N, C, S) with zeros where n >= N or c >= C. Conv weights (Cout, Cin, k³) use N = Cout.
extern "C" __global__ void pad_nc(float* dst, const float* src, int N, int C, int Cp, i64 S, i64 total, int cl) {
    GRID_STRIDE(i, total) {
        int c = chan_of(i, Cp, S, cl);
        i64 n = i / ((i64)Cp * S);
        i64 s = cl ? (i / Cp) % S : i % S;
        dst[i] = (c < C && n < N) ? (cl ? src[(n * S + s) * C + c] : src[(n * C + c) * S + s]) : 0.0f;
    }
}

// The inverse for a padded conv output: dst (N, C, S) = src (N, Cp, S)[:, :C] + bias[c].
extern "C" __global__ void unpad_c_bias(float* dst, const float* src, const float* bias, int C, int Cp, i64 S,
                                        i64 total, int cl) {
    GRID_STRIDE(i, total) {
        int c = chan_of(i, C, S, cl);
        i64 n = i / ((i64)C * S);
        i64 s = cl ? (i / C) % S : i % S;
        dst[i] = (cl ? src[(n * S + s) * Cp + c] : src[(n * Cp + c) * S + s]) + bias[c];
    }
}
