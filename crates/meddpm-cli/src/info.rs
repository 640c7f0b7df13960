//! `meddpm info`: a preset's configuration, parameters, FLOPs and planned memory.

use crate::args::Preset;
use anyhow::Result;
use meddpm::model::{cost, UNet};
use meddpm::Precision;

#[derive(clap::Args, Debug)]
pub struct InfoArgs {
    /// The model preset to describe.
    #[arg(long, value_enum, default_value = "whole-head")]
    pub preset: Preset,
}

pub fn run(a: &InfoArgs) -> Result<()> {
    let cfg = a.preset.unet();
    let f = cost::forward_flops(&cfg);
    println!("{}", toml::to_string(&cfg)?);
    let params = meddpm::model::param_count(&cfg);
    println!("parameters:          {params}");
    println!(
        "forward GFLOP (B=1): {:.1} (conv {:.1}, attention {:.1}, linear {:.3})",
        f.total() / 1e9,
        f.conv / 1e9,
        f.attention / 1e9,
        f.linear / 1e9
    );
    println!("train micro-step GFLOP: {:.1}", f.train_step(&cfg) / 1e9);
    // The buffer plan, counted without allocating (NullBackend buffers are lengths), per storage
    // precision (fp32 and tf32 store the same).
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let plans = [Precision::Fp32, Precision::Bf16]
        .map(|p| UNet::new(&meddpm::analysis::timed::NullBackend { precision: p, ..Default::default() }, &cfg, 1));
    let [p32, p16] = plans;
    let (p32, p16) = (p32?, p16?);
    println!("\n  {:<50} {:>9}  {:>8}", "planned memory, batch 1 (GiB)", "fp32/tf32", "bf16");
    for ((name, a), (_, b)) in p32.mem.rows().iter().zip(p16.mem.rows().iter()) {
        println!("  {name:<50} {:>9.3}  {:>8.3}", gib(*a), gib(*b));
    }
    let opt = 3 * 4 * params;
    println!("  {:<50} {:>9.3}  {:>8.3}", "EMA weights, Adam m and v (f32)", gib(opt), gib(opt));
    println!("  {:<50} {:>9.3}  {:>8.3}", "total", gib(p32.mem.total() + opt), gib(p16.mem.total() + opt));
    Ok(())
}
