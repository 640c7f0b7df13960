//! `meddpm doctor`: the compute devices and the libraries meddpm can use, and the precision a
//! run would use by default on this machine (and why).

use crate::args::{BackendArgs, Device};
use anyhow::Result;

pub fn run() -> Result<()> {
    println!("meddpm {}", env!("CARGO_PKG_VERSION"));
    println!("cpu: {} threads (rayon)", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    match meddpm_cuda::probe() {
        Ok(s) => println!("{s}\n{}", meddpm_cuda::doctor()),
        Err(e) => println!("{e}"),
    }
    let auto = BackendArgs { device: Device::Auto, precision: None, layout: None, recorded: None };
    let on = match auto.resolve() {
        Device::Cuda(i) => format!("CUDA device {i}"),
        _ => "the CPU".to_string(),
    };
    println!("default (--device auto): {on}, {}", auto.precision_choice());
    Ok(())
}
