//! `meddpm eval-samplers`: the sampler study's table, CSV and chart from the run folders that
//! `scripts/gpu/samplers.sh` fills (`meddpm::eval::samplers` reads and writes; this only wires).

use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct EvalSamplersArgs {
    /// Folder of run folders, each with timing.json, quality/eval.json and optionally
    /// agreement/eval.json.
    #[arg(long)]
    pub runs: PathBuf,
    /// Output folder: samplers.md, samplers.csv, samplers.svg.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(a: &EvalSamplersArgs) -> anyhow::Result<()> {
    let runs = meddpm::eval::samplers::read_runs(&a.runs)?;
    for p in meddpm::eval::samplers::write_study(&runs, &a.out)? {
        println!("wrote {}", p.display());
    }
    print!("{}", meddpm::eval::samplers::markdown(&runs));
    Ok(())
}
