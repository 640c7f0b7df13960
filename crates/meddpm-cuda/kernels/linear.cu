// linear.cu: the bias parts of nn.Linear (the GEMMs are cuBLAS): out[n, o] += b[o] is
// add_channel_bias with S = 1; this file has the bias gradient db[o] += sum_n dout[n, o].

extern "C" __global__ void rows_sum_accum(float* db, const float* dout, int N, int O) {
    for (int o = blockIdx.x * blockDim.x + threadIdx.x; o < O; o += gridDim.x * blockDim.x) {
        double t = 0.0;
        for (int n = 0; n < N; n++) t += (double)dout[(i64)n * O + o];
        db[o] += (float)t;
    }
}
