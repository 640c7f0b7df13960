//! The running side of `meddpm eval-configs`, backend-generic so it builds and tests anywhere:
//! which configurations run and in what order ([`plan`]: the first that runs is the baseline;
//! without a CUDA device the GPU ones are reported as skipped), sampling every (pair, seed) of one
//! configuration ([`sample_all`]), the report assembled from what ran and what was skipped
//! ([`assemble`], over [`super::configs::compare_runs`]), and the PNG panels ([`write_panels`]).
//! The CLI (`crates/meddpm-cli/src/evalcfg.rs`) parses the arguments, starts each backend (only
//! it knows CUDA), shows the progress and writes the files.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use super::configs::{compare_runs, ConfigReport, Metrics, PairData, Report, Run, Samples, Settings};
use crate::data::preview::{label_position, write_png_at, Kind};
use crate::data::{Convention, Volume};
use crate::diffusion::{Sampler, Schedule};
use crate::model::{UNet, UNetConfig};
use crate::{Backend, DeviceSel, Error, Layout, Precision, Result};

/// One way of running the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Config {
    /// The CPU reference backend (fp32, NCDHW).
    Cpu,
    /// The CPU backend emulating a GPU precision's rounding (`Bf16` or `Fp8`): `cpu-bf16`,
    /// `cpu-fp8`. The only place fp8 runs until a GPU kernel has passed its parity test.
    CpuEmu(Precision),
    /// The CUDA backend with this math precision and activation layout.
    Cuda(Precision, Layout),
}

impl Config {
    /// `cpu`, or `PRECISION/LAYOUT` (as parsed).
    pub fn name(&self) -> String {
        match self {
            Config::Cpu => "cpu".into(),
            Config::CpuEmu(p) => format!("cpu-{}", p.name()),
            Config::Cuda(p, l) => format!(
                "{}/{}",
                p.name(),
                match l {
                    Layout::Ncdhw => "ncdhw",
                    Layout::Ndhwc => "ndhwc",
                }
            ),
        }
    }
    /// Whether it runs on the CPU (`cpu`, `cpu-bf16`, `cpu-fp8`).
    pub fn is_cpu(&self) -> bool {
        !matches!(self, Config::Cuda(..))
    }
    /// The CPU backend of a CPU configuration; `None` for a CUDA one.
    pub fn cpu_backend(&self) -> Option<crate::cpu::CpuBackend> {
        use crate::cpu::CpuBackend;
        match self {
            Config::Cpu => Some(CpuBackend::new()),
            Config::CpuEmu(Precision::Fp8) => Some(CpuBackend::fp8()),
            Config::CpuEmu(_) => Some(CpuBackend::bf16()),
            Config::Cuda(..) => None,
        }
    }
}

impl FromStr for Config {
    type Err = String;
    /// `cpu` (or `cpu-fp32`), `cpu-bf16`, `cpu-fp8`, or `PRECISION/LAYOUT` for CUDA
    /// (`fp32|tf32|bf16|fp8` / `ncdhw|ndhwc`), any case.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "cpu" | "cpu-fp32" => return Ok(Config::Cpu),
            "cpu-bf16" => return Ok(Config::CpuEmu(Precision::Bf16)),
            "cpu-fp8" => return Ok(Config::CpuEmu(Precision::Fp8)),
            _ => {}
        }
        let bad = || {
            format!(
                "'{s}' is not a configuration: use cpu, cpu-bf16, cpu-fp8 or PRECISION/LAYOUT with fp32|tf32|bf16|fp8 \
                 and ncdhw|ndhwc"
            )
        };
        let (p, l) = t.split_once('/').ok_or_else(bad)?;
        let p: Precision = p.parse().map_err(|_| bad())?;
        let l = match l {
            "ncdhw" => Layout::Ncdhw,
            "ndhwc" => Layout::Ndhwc,
            _ => return Err(bad()),
        };
        Ok(Config::Cuda(p, l))
    }
}

/// What [`plan`] decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The configurations to run, in order (the first that runs is the baseline).
    pub run: Vec<Config>,
    /// The CUDA device they run on.
    pub ordinal: usize,
    /// Configurations not run, with why.
    pub skipped: Vec<(Config, String)>,
    /// Notes for the report.
    pub notes: Vec<String>,
}

/// The configurations to run: `wanted` in order without repeats (plus the CPU reference with
/// `cpu_too`). `--device cuda[:N]` runs them all there (the CPU ones on the CPU); `auto` does when
/// `cuda_probe` answers Ok; otherwise (no device, or `--device cpu`) only the CPU configurations
/// run (the CPU reference when none was wanted) and every CUDA configuration is listed as skipped
/// with the reason (the probe's first line) and a note.
pub fn plan(
    wanted: &[Config],
    cpu_too: bool,
    device: &DeviceSel,
    cuda_probe: impl FnOnce() -> std::result::Result<(), String>,
) -> Result<Plan> {
    if wanted.is_empty() {
        return Err(Error::Config("--configs: give at least one configuration".into()));
    }
    let mut all = wanted.to_vec();
    if cpu_too {
        all.push(Config::Cpu);
    }
    let mut dedup: Vec<Config> = Vec::new();
    for c in all {
        if !dedup.contains(&c) {
            dedup.push(c);
        }
    }
    let why = match device {
        DeviceSel::Cuda(i) => return Ok(Plan { run: dedup, ordinal: *i, skipped: Vec::new(), notes: Vec::new() }),
        DeviceSel::Auto => match cuda_probe() {
            Ok(()) => return Ok(Plan { run: dedup, ordinal: 0, skipped: Vec::new(), notes: Vec::new() }),
            Err(e) => {
                let first = e.lines().next().unwrap_or("").trim().to_string();
                if first.is_empty() {
                    "no CUDA device".to_string()
                } else {
                    first
                }
            }
        },
        DeviceSel::Cpu => "--device cpu: collapsed into the CPU reference (fp32, NCDHW)".to_string(),
    };
    let gpu: Vec<Config> = dedup.iter().copied().filter(|c| !c.is_cpu()).collect();
    let mut cpu: Vec<Config> = dedup.iter().copied().filter(Config::is_cpu).collect();
    if cpu.is_empty() {
        cpu.push(Config::Cpu);
    }
    let skipped = gpu.iter().map(|c| (*c, why.clone())).collect();
    let mut notes = Vec::new();
    if !gpu.is_empty() {
        let names = gpu.iter().map(Config::name).collect::<Vec<_>>().join(", ");
        let ran = cpu.iter().map(Config::name).collect::<Vec<_>>().join(", ");
        notes.push(format!("{why}: the CUDA configurations ({names}) were not run; only the CPU ({ran}) ran"));
    }
    Ok(Plan { run: cpu, ordinal: 0, skipped, notes })
}

/// Sample every (pair, seed) with one backend, batch 1: `samples[pair][seed]` and the seconds
/// spent sampling. `step(pair, seed)` is called after every denoising step (progress).
#[allow(clippy::too_many_arguments)]
pub fn sample_all<B: Backend>(
    be: &B,
    cfg: &UNetConfig,
    weights: &[Vec<f32>],
    sched: &Schedule,
    pairs: &[PairData],
    seeds: &[u64],
    step: &mut dyn FnMut(usize, u64),
) -> Result<(Samples, f64)> {
    let mut net = UNet::new(be, cfg, 1)?;
    net.set_params(be, weights)?;
    let mut s = Sampler::new(be, &net)?;
    let t0 = Instant::now();
    let mut out = Vec::new();
    for p in pairs {
        let mut per_seed = Vec::new();
        for &seed in seeds {
            per_seed.push(s.sample(be, &mut net, sched, &p.cond, seed, |_| step(p.info.index, seed))?);
        }
        out.push(per_seed);
    }
    Ok((out, t0.elapsed().as_secs_f64()))
}

/// What the report says about its inputs besides the runs.
pub struct ReportHead {
    /// `meddpm VERSION eval-configs`.
    pub tool: String,
    pub checkpoint: String,
    pub checkpoint_step: u64,
    /// The weights group sampled (`ema`, `model`), "" for a plain state dict.
    pub weights: String,
    pub model: UNetConfig,
    pub timesteps: usize,
    /// Where the masks came from ([`super::configs::load_pairs`]).
    pub source: String,
}

/// The report: [`compare_runs`] over `runs` (baseline first), the skipped configurations listed
/// after them, and the notes (`notes` first, then one seed / masks without foreground / the
/// masks' source).
#[allow(clippy::too_many_arguments)]
pub fn assemble(
    head: ReportHead,
    runs: &[Run],
    skipped: &[(Config, String)],
    pairs: &[PairData],
    seeds: &[u64],
    metrics: &Metrics,
    ms_note: Option<String>,
    mut notes: Vec<String>,
    range: [f64; 2],
) -> Result<Report> {
    let baseline = runs.first().ok_or_else(|| Error::Config("no configuration ran".into()))?.name.clone();
    let (mut configurations, spread) = compare_runs(runs, pairs, seeds, metrics, range)?;
    if seeds.len() < 2 {
        notes.push("one seed per mask: no seed-to-seed spread, so no verdicts (use --seeds ≥ 2)".into());
    }
    for (c, why) in skipped {
        configurations.push(ConfigReport {
            name: c.name(),
            status: "skipped".into(),
            skip_reason: Some(why.clone()),
            backend: None,
            seconds: None,
            seconds_per_sample: None,
            agreement: Vec::new(),
            quality: Vec::new(),
            verdict: None,
        });
    }
    if pairs.iter().any(|p| !p.labels.iter().any(|&l| l != 0)) {
        notes.push(
            "a mask has no foreground at model size: its masked PSNR/MAE are NaN (left out of the spread)".into(),
        );
    }
    notes.push(format!("masks: {}", head.source));
    Ok(Report {
        tool: head.tool,
        checkpoint: head.checkpoint,
        checkpoint_step: head.checkpoint_step,
        weights: if head.weights.is_empty() { "(plain state dict)".into() } else { head.weights },
        parameters: crate::model::param_count(&head.model),
        model: head.model,
        timesteps: head.timesteps,
        seeds: seeds.to_vec(),
        pairs: pairs.iter().map(|p| p.info.clone()).collect(),
        settings: Settings {
            intensity_range: range,
            ssim: metrics.ssim.clone(),
            ms_ssim_kernel: metrics.ms.as_ref().map(|m| m.ssim.kernel_size),
            ms_ssim_note: ms_note,
            psnr_max_val: 1.0,
        },
        baseline,
        verdict_rule: "within spread ⇔ for every mask and quality metric, max over seeds of |metric(config) − \
                       metric(baseline)| (same mask, same seed) ≤ the baseline's sample std of that metric over the \
                       seeds"
            .into(),
        configurations,
        spread,
        notes,
    })
}

/// Per pair a PNG panel `<out>/panel_pair<i>.png`: mask | real | each configuration that ran
/// (baseline first), first seed, cut through the labels' centre. Returns the files written.
pub fn write_panels(out: &Path, pairs: &[PairData], runs: &[Run], dims: [usize; 3]) -> Result<Vec<PathBuf>> {
    let conv = Convention::whole_head();
    let mut written = Vec::new();
    for (pi, p) in pairs.iter().enumerate() {
        let gens: Vec<Volume> =
            runs.iter().map(|r| conv.output_volumes(&r.samples[pi][0], 1, dims, &p.mask_vol).remove(0)).collect();
        let mut cols: Vec<(&Volume, Kind)> = vec![(&p.mask_vol, Kind::Labels), (&p.real_vol, Kind::Intensity)];
        cols.extend(gens.iter().map(|v| (v, Kind::Intensity)));
        let pos = label_position(&p.mask_vol, 2.0).unwrap_or([0.5; 3]);
        let png = out.join(format!("panel_pair{}.png", p.info.index));
        write_png_at(&png, &cols, pos)?;
        written.push(png);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [&str; 6] = ["fp32/ncdhw", "bf16/ndhwc", "fp8/ndhwc", "cpu", "cpu-bf16", "cpu-fp8"];

    fn cfgs(names: &[&str]) -> Vec<Config> {
        names.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn names_round_trip_and_bad_ones_say_what_is_expected() {
        for n in ALL {
            assert_eq!(n.parse::<Config>().unwrap().name(), n);
        }
        assert_eq!(" TF32/NDHWC ".parse::<Config>().unwrap(), Config::Cuda(Precision::Tf32, Layout::Ndhwc));
        assert_eq!("CPU-FP32".parse::<Config>().unwrap(), Config::Cpu);
        assert_eq!("cpu-fp8".parse::<Config>().unwrap().cpu_backend().unwrap().precision(), Precision::Fp8);
        assert_eq!("cpu-bf16".parse::<Config>().unwrap().cpu_backend().unwrap().precision(), Precision::Bf16);
        assert!("fp8/ndhwc".parse::<Config>().unwrap().cpu_backend().is_none());
        for bad in ["fp16/ncdhw", "fp32", "fp32/nchw", "", "cpu-tf32", "cpu-fp16"] {
            let e = bad.parse::<Config>().unwrap_err();
            assert!(e.contains(&format!("'{bad}'")) && e.contains("ncdhw|ndhwc"), "{e}");
        }
        assert_eq!("cuda:3".parse::<DeviceSel>().unwrap(), DeviceSel::Cuda(3));
        assert_eq!("cuda".parse::<DeviceSel>().unwrap(), DeviceSel::Cuda(0));
        assert!("gpu".parse::<DeviceSel>().unwrap_err().contains("auto, cpu, cuda or cuda:N"));
    }

    #[test]
    fn plan_orders_dedups_and_skips_without_a_device() {
        let wanted = cfgs(&["bf16/ndhwc", "fp32/ncdhw", "bf16/ndhwc"]);
        // a device: everything, in order, once; the CPU appended with cpu_too
        let p = plan(&wanted, true, &DeviceSel::Cuda(1), || panic!("not probed")).unwrap();
        assert_eq!((p.run, p.ordinal), (cfgs(&["bf16/ndhwc", "fp32/ncdhw", "cpu"]), 1));
        assert!(p.skipped.is_empty() && p.notes.is_empty());
        let p = plan(&wanted, false, &DeviceSel::Auto, || Ok(())).unwrap();
        assert_eq!(p.run, cfgs(&["bf16/ndhwc", "fp32/ncdhw"]));
        // auto without a device: the CPU alone, the CUDA ones skipped with the probe's first line
        let p = plan(&wanted, false, &DeviceSel::Auto, || Err("no driver\ndetails".into())).unwrap();
        assert_eq!(p.run, vec![Config::Cpu]);
        assert_eq!(p.skipped, vec![(wanted[0], "no driver".into()), (wanted[1], "no driver".into())]);
        assert_eq!(p.notes.len(), 1);
        assert!(p.notes[0].contains("bf16/ndhwc, fp32/ncdhw") && p.notes[0].starts_with("no driver"), "{:?}", p.notes);
        let p = plan(&wanted, false, &DeviceSel::Auto, || Err(String::new())).unwrap();
        assert_eq!(p.skipped[0].1, "no CUDA device");
        // --device cpu with only the CPU wanted: nothing skipped, no note
        let p = plan(&cfgs(&["cpu"]), false, &DeviceSel::Cpu, || panic!("not probed")).unwrap();
        assert_eq!((p.run, p.skipped.len(), p.notes.len()), (vec![Config::Cpu], 0, 0));
        assert!(plan(&[], true, &DeviceSel::Cpu, || Ok(())).unwrap_err().to_string().contains("--configs"));
        // the CPU emulations run on the CPU wherever the CUDA ones cannot, in the order given
        let emu = cfgs(&["cpu", "bf16/ndhwc", "cpu-bf16", "cpu-fp8"]);
        let p = plan(&emu, false, &DeviceSel::Auto, || Err("no driver".into())).unwrap();
        assert_eq!(p.run, cfgs(&["cpu", "cpu-bf16", "cpu-fp8"]));
        assert_eq!(p.skipped, vec![(emu[1], "no driver".into())]);
        assert!(p.notes[0].contains("only the CPU (cpu, cpu-bf16, cpu-fp8) ran"), "{:?}", p.notes);
        let p = plan(&emu, false, &DeviceSel::Cpu, || panic!("not probed")).unwrap();
        assert_eq!(p.run, cfgs(&["cpu", "cpu-bf16", "cpu-fp8"]));
    }
}
