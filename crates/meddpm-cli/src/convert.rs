//! `meddpm convert in.pt out.safetensors [--weights ema|model]`: turn a reference Med-DDPM PyTorch
//! checkpoint (spec §4.1: `torch.save({'step', 'model', 'ema'})`, or a bare state dict such as the
//! fast-sampling net) into a safetensors state dict with PyTorch's own key names, which both
//! meddpm (`Checkpoint::read`) and PyTorch (`load_state_dict`) accept as it is. Given a meddpm
//! checkpoint instead, it exports its EMA (or online) weights the same way (meddpm → PyTorch).
//!
//! The configuration is inferred from the tensor shapes; what shapes cannot tell (volume size,
//! heads, GroupNorm groups) defaults to the reference (128³ for the whole-head topology,
//! 144×192×192 for BraTS, 1 head, 32 groups) or comes from the flags. The output is written
//! atomically: on any error an existing output file is left as it was.

use crate::args::{whole_usize, Weights};
use anyhow::{bail, Context, Result};
use meddpm::checkpoint::torch;
use meddpm::model::UNetConfig;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct ConvertArgs {
    /// A PyTorch checkpoint (torch.save of {'step', 'model', 'ema'} or of a bare state dict), or a
    /// meddpm checkpoint to export with PyTorch key names.
    pub input: PathBuf,
    /// The safetensors file to write, named *.safetensors (replaced atomically, only once the
    /// conversion succeeded).
    pub output: PathBuf,
    /// Weights to take from a training checkpoint (ignored for a bare state dict).
    #[arg(long, value_enum, default_value = "ema")]
    pub weights: Weights,
    /// Volume depth D for the stored config, 1 to 1024 [default: 128 whole-head, 144 BraTS].
    #[arg(long, allow_negative_numbers = true, value_parser = whole_usize(1, 1024))]
    pub depth: Option<usize>,
    /// Volume height = width for the stored config, 1 to 1024 [default: 128 whole-head, 192 BraTS].
    #[arg(long, allow_negative_numbers = true, value_parser = whole_usize(1, 1024))]
    pub size: Option<usize>,
    /// Attention heads (not visible in the weights), 1 to 64.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = whole_usize(1, 64))]
    pub heads: usize,
    /// GroupNorm groups (not visible in the weights), 1 to 1024.
    #[arg(long, default_value_t = 32, allow_negative_numbers = true, value_parser = whole_usize(1, 1024))]
    pub groups: usize,
    /// Write GaussianDiffusion keys (`denoise_fn.` + the 13 schedule buffers) instead of U-Net keys.
    #[arg(long)]
    pub diffusion_keys: bool,
}

pub fn run(a: &ConvertArgs) -> Result<()> {
    // the format follows the output's extension; safetensors is the one this command writes
    let ext = a.output.extension().and_then(|e| e.to_str()).unwrap_or("");
    if !ext.eq_ignore_ascii_case("safetensors") {
        bail!(
            "{}: convert writes safetensors state dicts, so the output must be named *.safetensors (PyTorch reads it \
             with safetensors.torch.load_file); .{ext} is not written",
            a.output.display()
        );
    }
    if !meddpm::checkpoint::load::is_pytorch_file(&a.input)? {
        return export_meddpm(a);
    }
    let ck = torch::read_state_dicts(&a.input)?;
    let which = if ck.dicts.contains_key("") { "" } else { a.weights.name() };
    let (name, dict) = ck.dict(Some(which))?;

    // Infer the topology with a placeholder volume, then put the real size in.
    let probe = torch::infer_config(dict, 1 << 16, 1 << 16)
        .with_context(|| format!("{}: cannot infer the U-Net configuration", a.input.display()))?;
    let same_topology = |r: &UNetConfig| UNetConfig { depth: r.depth, size: r.size, ..probe.clone() } == *r;
    let (def_depth, def_size) = if same_topology(&UNetConfig::whole_head()) {
        (Some(128), Some(128))
    } else if same_topology(&UNetConfig::brats()) {
        (Some(144), Some(192))
    } else {
        (None, None)
    };
    let (Some(depth), Some(size)) = (a.depth.or(def_depth), a.size.or(def_size)) else {
        bail!(
            "{}: the weights are not the whole-head or BraTS topology (inferred {probe:?}); pass --depth and --size",
            a.input.display()
        );
    };
    let cfg = UNetConfig { depth, size, num_heads: a.heads, groups: a.groups, ..probe };
    cfg.validate()?;

    let mapped = ck.to_unet(Some(name), &cfg)?;
    for w in &mapped.warnings {
        eprintln!("warning: {}: {w}", a.input.display());
    }
    let mut meta = BTreeMap::new();
    meta.insert("source".to_string(), a.input.display().to_string());
    meta.insert("source_dict".to_string(), if name.is_empty() { "(bare)".to_string() } else { name.to_string() });
    if let Some(step) = ck.step {
        meta.insert("step".to_string(), step.to_string());
    }
    torch::export_safetensors(&a.output, &cfg, &mapped.params, a.diffusion_keys, meta)?;
    let n: usize = mapped.params.iter().map(|p| p.len()).sum();
    println!(
        "wrote {} (safetensors state dict): {} tensors, {n} parameters, from {} {}{}; config: in {} out {} model_channels {} channel_mult {:?} num_res_blocks {} attention_ds {:?} volume {}x{}x{}",
        a.output.display(),
        mapped.params.len() + if a.diffusion_keys { 13 } else { 0 },
        a.input.display(),
        if name.is_empty() { "(bare state dict)".to_string() } else { format!("'{name}'") },
        ck.step.map(|s| format!(" at step {s}")).unwrap_or_default(),
        cfg.in_channels,
        cfg.out_channels,
        cfg.model_channels,
        cfg.channel_mult,
        cfg.num_res_blocks,
        cfg.attention_ds,
        cfg.depth,
        cfg.size,
        cfg.size,
    );
    Ok(())
}

/// A meddpm checkpoint (or safetensors state dict) → a plain PyTorch-keyed state dict: the
/// export direction, so meddpm-trained weights load into the reference code.
fn export_meddpm(a: &ConvertArgs) -> Result<()> {
    use meddpm::checkpoint::load::{load_weights_with, LoadHints};
    let w = load_weights_with(
        &a.input,
        a.weights.group(),
        &LoadHints { size: a.depth.zip(a.size), ..LoadHints::default() },
    )?;
    for m in &w.warnings {
        eprintln!("warning: {}: {m}", a.input.display());
    }
    let mut meta = BTreeMap::new();
    meta.insert("source".to_string(), a.input.display().to_string());
    meta.insert("source_dict".to_string(), a.weights.name().to_string());
    torch::export_safetensors(&a.output, &w.cfg, &w.params, a.diffusion_keys, meta)?;
    println!(
        "wrote {} (safetensors state dict): {} tensors from {} ({:?} weights)",
        a.output.display(),
        w.params.len(),
        a.input.display(),
        a.weights
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn fixture(p: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/torch").join(p)
    }

    #[test]
    fn exports_a_meddpm_checkpoint_as_a_plain_state_dict() {
        use meddpm::checkpoint::{save_trainer, Checkpoint};
        use meddpm::cpu::CpuBackend;
        use meddpm::diffusion::{TrainConfig, Trainer};
        let be = CpuBackend::new();
        let cfg = UNetConfig::tiny();
        let mut tr =
            Trainer::new(&be, &cfg, &TrainConfig { lr: 1e-2, ema_start: 0, ema_every: 1, ..TrainConfig::default() })
                .unwrap();
        let (img, cond) = meddpm::phantom::pair(8, 8, 8, 0);
        for _ in 0..2 {
            tr.train_step(&be, || Ok((img.clone(), cond.clone()))).unwrap();
        }
        let dir = std::env::temp_dir().join(format!("meddpm-export-{}", std::process::id()));
        let (ck, out) = (dir.join("ck.safetensors"), dir.join("plain.safetensors"));
        save_trainer(&ck, &be, &tr).unwrap();
        let args = ConvertArgs {
            input: ck.clone(),
            output: out.clone(),
            weights: Weights::Ema,
            depth: None,
            size: None,
            heads: 1,
            groups: 32,
            diffusion_keys: false,
        };
        run(&args).unwrap();
        let plain = Checkpoint::read(&out).unwrap();
        let specs = meddpm::model::param_specs(&cfg);
        let got = plain.group("", &specs).unwrap();
        // the EMA (decay 0.995 after step 0) differs from the online weights: check it is the EMA
        assert_eq!(got, tr.ema.clone());
        assert_ne!(got, tr.net.host_tensors(&be, false));
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn converts_the_micro_checkpoint_and_keeps_output_on_error() {
        let dir = std::env::temp_dir().join(format!("meddpm-convert-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("w.safetensors");
        let args = |input: &str, weights| ConvertArgs {
            input: fixture(input),
            output: out.clone(),
            weights,
            depth: Some(4),
            size: Some(4),
            heads: 1,
            groups: 2,
            diffusion_keys: false,
        };
        run(&args("micro_ckpt.pt", Weights::Model)).unwrap();
        let ck = meddpm::checkpoint::Checkpoint::read(&out).unwrap();
        let cfg = ck.unet.clone().expect("config stored");
        assert_eq!((cfg.channel_mult.clone(), cfg.attention_ds.clone(), cfg.groups), (vec![1, 1], vec![2], 2));
        // the values are the 'model' dict's, under U-Net keys
        let src = torch::read_state_dicts(fixture("micro_ckpt.pt")).unwrap();
        for (k, shape, v) in src.dicts["model"].iter().filter(|e| e.0.starts_with("denoise_fn.")) {
            let (s, w) = &ck.tensors[k.strip_prefix("denoise_fn.").unwrap()];
            assert_eq!((s, w), (shape, v), "{k}");
        }
        // a failing conversion (no topology default, no --depth) leaves the output as it was
        let before = std::fs::read(&out).unwrap();
        let e = run(&ConvertArgs { depth: None, ..args("micro_ckpt.pt", Weights::Ema) }).unwrap_err().to_string();
        assert!(e.contains("--depth"), "{e}");
        let e = run(&args("legacy.pt", Weights::Ema)).unwrap_err().to_string();
        assert!(e.contains("legacy"), "{e}");
        assert_eq!(std::fs::read(&out).unwrap(), before);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
