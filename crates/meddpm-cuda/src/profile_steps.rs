//! The recorded steps of `meddpm profile --device cuda`: one training step (micro-step +
//! Adam/EMA) and one sampling step of the U-Net, each repeated, each recorded step under CUPTI
//! ([`crate::cupti`]: the per-kernel GPU timeline under the backend's ranges) after a plain run
//! with CUPTI off (what `meddpm bench` measures), reduced to the report's [`Pass`] of the
//! median wall time ([`unet_steps`]), with the SM clock and power over its steps
//! ([`crate::power`]: whether the power cap held the clock down while they ran).
//! [`cuda_report`] is the whole CUDA side of the report: those passes with and without CUDA
//! graphs, the per-call passes (`Timed<CudaBackend>`), the counters (the CLI's child under ncu,
//! `meddpm::analysis::collect::ncu_run`) and the optimisation matrix.
//! The analysis itself is `meddpm::analysis`; the CLI only wires this in.

use std::path::PathBuf;
use std::time::Instant;

use meddpm::analysis::collect::ncu_run;
use meddpm::analysis::gpus::{self, Math};
use meddpm::analysis::matrix::{config_name, from_cuda_runs, ConfigInput, CUDA_CONFIGS};
use meddpm::analysis::ncu;
use meddpm::analysis::power::{PowerSummary, READ_EVERY};
use meddpm::analysis::profile::{host_data, median, profile_unet, Options, SampleStep};
use meddpm::analysis::report::{Input, Pass};
use meddpm::analysis::timed::Timed;
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::model::UNetConfig;
use meddpm::{Backend, Error, Layout, Precision, Result};

use crate::cupti::{Collection, Collector};
use crate::power::PowerMonitor;
use crate::CudaBackend;

/// One recorded step: wall time between syncs and the CUPTI collection (or why there is none).
struct Step {
    wall_ns: u64,
    collection: Result<Collection, String>,
}

/// Run `f` between two syncs, under CUPTI when `collect`.
fn record(be: &CudaBackend, collect: bool, f: impl FnOnce()) -> Step {
    be.sync();
    let c = if collect { Collector::start().map(Some) } else { Ok(None) };
    let t0 = Instant::now();
    f();
    be.sync();
    let wall_ns = t0.elapsed().as_nanos() as u64;
    let collection = match c {
        Ok(Some(c)) => c.finish(),
        Ok(None) => Err("not collected (run under ncu)".into()),
        Err(e) => Err(e),
    };
    Step { wall_ns, collection }
}

/// The pass of the median wall time among the recorded steps.
fn cupti_pass(
    name: &str,
    (mut steps, plain, power): (Vec<Step>, Vec<u64>, Option<PowerSummary>),
    notes: &mut Vec<String>,
    raw: &mut Vec<(String, u64)>,
) -> Pass {
    let repeats: Vec<u64> = steps.iter().map(|s| s.wall_ns).collect();
    steps.sort_by_key(|s| s.wall_ns);
    let s = steps.swap_remove(steps.len() / 2);
    let records = match s.collection {
        Ok(c) => {
            if c.dropped > 0 {
                notes.push(format!("CUPTI dropped {} activity records in the {name} (buffers full)", c.dropped));
            }
            if c.unattributed > 0 {
                notes.push(format!(
                    "{} of {} GPU activities of the {name} could not be attributed to a backend range",
                    c.unattributed,
                    c.activities.len()
                ));
            }
            for w in c.warnings {
                notes.push(format!("CUPTI ({name}): {w}"));
            }
            raw.extend(c.activities.iter().map(|a| (a.name.clone(), a.duration_ns())));
            c.activities.iter().map(|a| a.to_record()).collect()
        }
        Err(e) => {
            notes.push(format!("CUPTI kernel timeline of the {name}: not collected because {e}"));
            Vec::new()
        }
    };
    let plain_step_ns = median(plain);
    Pass { name: name.to_string(), records, step_ns: Some(s.wall_ns), measured: true, repeats, plain_step_ns, power }
}

/// `repeats` recorded runs of `step` (under CUPTI when `collect`), each after a plain run (CUPTI
/// off, as `meddpm bench` runs it): the recorded steps, the plain wall times, and the clock and
/// power over all of them (NVML, when it can).
fn repeat_steps(
    be: &CudaBackend,
    repeats: usize,
    collect: bool,
    step: &mut dyn FnMut(),
) -> (Vec<Step>, Vec<u64>, Option<PowerSummary>) {
    let (mut steps, mut plain) = (Vec::new(), Vec::new());
    be.sync();
    let meter = be.power_monitor(READ_EVERY);
    for _ in 0..repeats.max(1) {
        if collect {
            plain.push(record(be, false, &mut *step).wall_ns);
        }
        steps.push(record(be, collect, &mut *step));
    }
    (steps, plain, meter.and_then(PowerMonitor::stop))
}

/// One training step (micro-step + Adam/EMA) and (`sampling`) one sampling step at t = T/2, each after
/// `warmup` unrecorded repetitions, exactly as `analysis::profile::profile_unet` runs them but
/// without per-call syncs, each recorded step under CUPTI (when `collect`). Under ncu (`wrap`)
/// the recorded steps sit inside one extra range, `profile`, which the parent's
/// `--nvtx-include profile/` selects.
#[allow(clippy::too_many_arguments)]
pub fn unet_steps(
    be: &CudaBackend,
    cfg: &UNetConfig,
    o: &Options,
    sampling: bool,
    collect: bool,
    wrap: bool,
    notes: &mut Vec<String>,
    raw: &mut Vec<(String, u64)>,
) -> Result<Vec<Pass>> {
    let tc = TrainConfig { batch: 1, grad_accum: 1, seed: o.seed, ..TrainConfig::default() };
    let mut tr = Trainer::new(be, cfg, &tc)?;
    let (img, cond) = host_data(cfg);
    let mut passes = Vec::new();
    for _ in 0..o.warmup {
        tr.micro_step(be, &img, &cond);
        tr.opt_step(be);
    }
    // as in training: each step's batch was staged during the step before (Trainer::micro_step_ahead)
    tr.stage(be, &img, &cond)?;
    let mut train = || {
        if wrap {
            be.push_range("profile");
        }
        be.push_range("train");
        // the host data is the right size, so staging cannot fail
        tr.micro_step_ahead_copy(be, &img, &cond).expect("staged step");
        be.push_range("optimizer");
        tr.opt_step(be);
        be.pop_range();
        be.pop_range();
        if wrap {
            be.pop_range();
        }
    };
    let run = repeat_steps(be, o.repeats, collect, &mut train);
    passes.push(cupti_pass("train step", run, notes, raw));
    if !sampling {
        return Ok(passes);
    }

    let mut step = SampleStep::new(be, &tr, &cond, o.seed)?;
    let net = &mut tr.net;
    for _ in 0..o.warmup {
        step.run(be, net);
    }
    let mut sample = || {
        if wrap {
            be.push_range("profile");
        }
        be.push_range("sample");
        step.run(be, net);
        be.pop_range();
        if wrap {
            be.pop_range();
        }
    };
    let run = repeat_steps(be, o.repeats, collect, &mut sample);
    passes.push(cupti_pass("sampling step", run, notes, raw));
    Ok(passes)
}

/// What `meddpm profile --device cuda` asks of [`cuda_report`] besides the steps.
pub struct CudaRun<'a> {
    pub precision: Precision,
    pub layout: Layout,
    /// `--counters`: the steps again in a child under ncu (`--set full` on the top
    /// `counters_kernels` kernels of the CUPTI timeline, 0: all of them).
    pub counters: bool,
    pub counters_kernels: usize,
    /// The ncu binary, the folder for its reports, its time limit (s).
    pub ncu: &'a str,
    pub ncu_dir: PathBuf,
    pub ncu_timeout: u64,
    /// `--matrix`: every configuration's training step (fp32/TF32 × NCDHW/NDHWC).
    pub matrix: bool,
    /// The command line of a child process that runs the steps of (precision, layout) under the
    /// profiler, the training step alone when the flag is set (the CLI's own binary).
    pub child: &'a dyn Fn(Precision, Layout, bool) -> std::result::Result<Vec<String>, String>,
}

/// `--device cuda`: the CUPTI passes of the requested configuration, the per-call passes, the
/// counters (`--counters`) and the four-configuration matrix (`--matrix`).
pub fn cuda_report(cfg: &UNetConfig, opts: &Options, run: &CudaRun, input: &mut Input) -> Result<()> {
    let (precision, layout, matrix) = (run.precision, run.layout, run.matrix);
    let cuda = match CudaBackend::new(0, precision, layout) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("warning: {e}");
            input.not_collected.push(format!("GPU timeline: no CUDA backend ({e})"));
            if run.counters {
                input.not_collected.push("hardware counters: no CUDA backend".into());
            }
            return Ok(());
        }
    };
    // Profiles attribute each kernel to its U-Net block through ranges pushed by the host, so the
    // steps run without CUDA graphs (meddpm bench measures with them); the "(graph replay)"
    // passes below run them as bench does, for the step's GPU idle time.
    cuda.set_graphs(false);
    input.not_collected.push(
        "CUDA graphs: the per-block passes launch every kernel from the host (graphs off); the \"(graph replay)\" \
         passes replay the steps as CUDA graphs, as `meddpm bench` times them (their kernels keep their names, \
         not their blocks: GPU idle of the step as it runs in training and sampling)"
            .into(),
    );
    input.device_gpu = gpus::find(&cuda.info().name);
    input.math = Some(Math::from(precision));
    input.device = cuda.describe();
    let main_name = config_name(precision, layout);
    input.config.push_str(&format!("; configuration {main_name}"));
    let mut notes = Vec::new();
    let mut raw = Vec::new();
    // 1) the CUPTI timeline (also leaves the cuDNN algorithms in the on-disk cache for the ncu child)
    let passes = unet_steps(&cuda, cfg, opts, true, true, false, &mut notes, &mut raw)
        .map_err(|e| Error::Backend(format!("CUDA steps under CUPTI: {e}")))?;
    let mut matrix_rows = Vec::new();
    if matrix {
        let train = passes.iter().find(|p| p.name.starts_with("train"));
        matrix_rows.push((precision, layout, train.filter(|p| !p.records.is_empty()).map(|p| p.records.clone())));
    }
    input.passes.extend(passes);
    // 1b) the same steps replayed as CUDA graphs (issue 12's "GPU idle" is of this step)
    cuda.set_graphs(true);
    let mut replay_notes = Vec::new();
    match unet_steps(&cuda, cfg, opts, true, true, false, &mut replay_notes, &mut Vec::new()) {
        Ok(ps) => input.passes.extend(ps.into_iter().map(|p| Pass { name: format!("{} (graph replay)", p.name), ..p })),
        Err(e) => input.not_collected.push(format!("steps as CUDA graph replays: {e:#}")),
    }
    // kernels launched by a graph carry no host range: only notes other than that one are kept
    notes.extend(
        replay_notes
            .into_iter()
            .filter(|n| !n.contains("could not be attributed"))
            .map(|n| format!("graph replay: {n}")),
    );
    cuda.set_graphs(false);
    if let Err(e) = crate::cupti::nvtx_status() {
        notes.push(format!("NVTX ranges: not emitted because {e} (ncu then selects kernels by name only)"));
    }
    // 2) the per-call view: every backend call between two syncs
    let timed = Timed::new(cuda);
    let o = Options { label: " (per call, synced)".into(), ..opts.clone() };
    input.passes.extend(
        profile_unet(&timed, cfg, &o)
            .map_err(|e| Error::Backend(format!("per-call profile on the CUDA backend: {e}")))?,
    );
    drop(timed);
    // 3) counters: this binary again, under ncu (`--set full` on the top kernels, or on all of them)
    if run.counters {
        let names = if run.counters_kernels == 0 { Vec::new() } else { ncu::top_raw_names(&raw, run.counters_kernels) };
        let (mut args, how) = ncu::child_filters(crate::cupti::nvtx_status(), run.counters_kernels, &names);
        let mut full = ncu::base_args(true);
        full.append(&mut args);
        match ncu_run(
            run.ncu,
            &full,
            &(run.child)(precision, layout, false).map_err(Error::Backend)?,
            &run.ncu_dir,
            &main_name,
            run.ncu_timeout,
        ) {
            Ok(n) => {
                input.config.push_str(&format!("; counters: {how}"));
                input.ncu = Some(n);
            }
            Err(e) => {
                eprintln!("warning: {e}");
                input.not_collected.push(format!("hardware counters (Nsight Compute): not collected because {e}"));
            }
        }
    }
    // 4) the optimisation matrix: every configuration's training step through CUPTI, and with
    //    --counters every kernel of that step under ncu with the matrix metrics
    if matrix {
        let mut ncu_by_config: Vec<(String, ConfigInput)> = Vec::new();
        for (p, l) in CUDA_CONFIGS {
            let name = config_name(p, l);
            if (p, l) != (precision, layout) {
                eprintln!("profile: matrix configuration {name}");
                match CudaBackend::new(0, p, l) {
                    Ok(be) => {
                        be.set_graphs(false);
                        let mut n = Vec::new();
                        let ps = unet_steps(&be, cfg, opts, false, true, false, &mut n, &mut Vec::new())
                            .map_err(|e| Error::Backend(format!("matrix configuration {name}: {e}")))?;
                        notes.extend(n.into_iter().map(|s| format!("{name}: {s}")));
                        let recs = ps.into_iter().find(|p| p.name.starts_with("train")).map(|p| p.records);
                        matrix_rows.push((p, l, recs.filter(|r| !r.is_empty())));
                    }
                    Err(e) => {
                        input.not_collected.push(format!("matrix configuration {name}: {e}"));
                        continue;
                    }
                }
            }
            if run.counters {
                let mut args = ncu::matrix_args();
                args.append(&mut ncu::child_filters(crate::cupti::nvtx_status(), 0, &[]).0);
                eprintln!("profile: matrix counters of {name} (every kernel of one training step)");
                match ncu_run(
                    run.ncu,
                    &args,
                    &(run.child)(p, l, true).map_err(Error::Backend)?,
                    &run.ncu_dir,
                    &format!("matrix-{name}"),
                    run.ncu_timeout,
                ) {
                    Ok(n) => ncu_by_config.push((name.clone(), ConfigInput::from_ncu(&name, &n.kernels))),
                    Err(e) => input.not_collected.push(format!("matrix counters of {name}: {e}")),
                }
            }
        }
        // baseline first; time and time by category from the CUPTI records (ncu's otherwise)
        input.matrix.extend(from_cuda_runs(matrix_rows, &ncu_by_config));
        input.config.push_str(
            "; matrix = one training step per configuration: time = Σ kernel durations through CUPTI, SM cycles / \
             instructions / tensor pipes / IPC = every kernel of the step under ncu (matrix metrics)",
        );
        if !run.counters {
            input.not_collected.push(
                "matrix SM cycles / instructions / tensor-pipe / IPC: need --counters (every kernel of one training \
                 step of each configuration under ncu)"
                    .into(),
            );
        }
    }
    for n in notes {
        input.not_collected.push(n);
    }
    Ok(())
}
