//! `meddpm doctor`: the compute devices and the libraries meddpm can use.

use anyhow::Result;

pub fn run() -> Result<()> {
    println!("meddpm {}", env!("CARGO_PKG_VERSION"));
    println!("cpu: {} threads (rayon)", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    match meddpm_cuda::probe() {
        Ok(s) => println!("{s}\n{}", meddpm_cuda::doctor()),
        Err(e) => println!("{e}"),
    }
    Ok(())
}
