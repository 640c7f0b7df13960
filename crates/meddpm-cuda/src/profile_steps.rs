//! The recorded steps of `meddpm profile --device cuda`: one training step (micro-step +
//! Adam/EMA) and one sampling step of the U-Net, each repeated, each recorded step under CUPTI
//! ([`crate::cupti`]: the per-kernel GPU timeline under the backend's ranges) after a plain run
//! with CUPTI off (what `meddpm bench` measures), reduced to the report's [`Pass`] of the
//! median wall time. The analysis itself is `meddpm::analysis`; the CLI only wires this in.

use std::time::Instant;

use meddpm::analysis::profile::{host_data, median, Options, SampleStep};
use meddpm::analysis::report::Pass;
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::model::UNetConfig;
use meddpm::{Backend, Result};

use crate::cupti::{Collection, Collector};
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
    mut steps: Vec<Step>,
    plain: Vec<u64>,
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
    Pass { name: name.to_string(), records, step_ns: Some(s.wall_ns), measured: true, repeats, plain_step_ns }
}

/// `repeats` recorded runs of `step` (under CUPTI when `collect`), each after a plain run (CUPTI
/// off, as `meddpm bench` runs it): the recorded steps and the plain wall times.
fn repeat_steps(be: &CudaBackend, repeats: usize, collect: bool, step: &mut dyn FnMut()) -> (Vec<Step>, Vec<u64>) {
    let (mut steps, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..repeats.max(1) {
        if collect {
            plain.push(record(be, false, &mut *step).wall_ns);
        }
        steps.push(record(be, collect, &mut *step));
    }
    (steps, plain)
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
    let (steps, plain) = repeat_steps(be, o.repeats, collect, &mut train);
    passes.push(cupti_pass("train step", steps, plain, notes, raw));
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
    let (steps, plain) = repeat_steps(be, o.repeats, collect, &mut sample);
    passes.push(cupti_pass("sampling step", steps, plain, notes, raw));
    Ok(passes)
}
