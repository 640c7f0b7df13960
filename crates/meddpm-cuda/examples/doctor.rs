//! Print `meddpm_cuda::doctor()`: GPU, driver and which CUDA library files this process loads.
fn main() {
    print!("{}", meddpm_cuda::doctor());
}
