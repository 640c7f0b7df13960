//! The `meddpm` command: glue between arguments, the engine and the backends.
fn main() {
    println!("{}", meddpm_cuda::probe().unwrap_or_else(|e| e));
}
