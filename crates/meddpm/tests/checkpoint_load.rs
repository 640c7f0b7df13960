//! `load_weights` (checkpoint/load.rs) on every kind of file, against data written by PyTorch:
//! - the `.pt` fixtures of `tools/reference/make_torch_fixtures.py` (a Med-DDPM training
//!   checkpoint {'step', 'model', 'ema'} with CUDA-tagged storages, a bare state dict) must give
//!   exactly the values PyTorch stored (`testdata/torch/expected.safetensors`), in param order;
//! - the golden U-Net of `make_golden.py` (weights, input, t and PyTorch's float64 output),
//!   written here as a meddpm checkpoint, a GaussianDiffusion-keyed state dict with config, and a
//!   bare state dict without config, must load to a network whose forward equals PyTorch's output;
//! - `init_trainer_from` must do what `train.py --resume_weight` does (EMA → online weights,
//!   step 0, zero Adam, EMA copied);
//! - wrong models, corrupt, truncated and foreign files give errors naming the problem.

use meddpm::checkpoint::torch::{export_safetensors, SCHEDULE_BUFFERS};
use meddpm::checkpoint::{
    init_trainer_from, load_weights, load_weights_with, save_trainer, Checkpoint, LoadHints, WeightGroup,
};
use meddpm::cpu::CpuBackend;
use meddpm::diffusion::{TrainConfig, Trainer};
use meddpm::model::{param_specs, UNet, UNetConfig};
use meddpm::testing::{compare, Tolerance};
use meddpm::Backend;
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

fn td(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata").join(p)
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-load-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `expected.safetensors`: tensors by name, and its JSON metadata.
fn expected() -> (HashMap<String, Vec<f32>>, HashMap<String, String>) {
    let bytes = std::fs::read(td("torch/expected.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let t = st
        .tensors()
        .into_iter()
        .map(|(k, v)| (k, v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
        .collect();
    let (_, m) = SafeTensors::read_metadata(&bytes).unwrap();
    (t, m.metadata().clone().unwrap())
}

fn bits_equal(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: tensor count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: tensor {i} length");
        assert!(g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: tensor {i} values differ");
    }
}

#[test]
fn pytorch_training_checkpoint_ema_and_model_weights_equal_pytorch() {
    let (exp, meta) = expected();
    let micro: UNetConfig = serde_json::from_str(&meta["micro_config"]).unwrap();
    let hints = LoadHints { size: Some((micro.depth, micro.size)), num_heads: None, groups: Some(micro.groups) };
    for (group, name) in [(WeightGroup::Ema, "ema"), (WeightGroup::Model, "model")] {
        let w = load_weights_with(&td("torch/micro_ckpt.pt"), group, &hints).unwrap();
        assert_eq!(w.cfg, micro, "inferred config");
        assert_eq!(w.step, Some(123));
        assert!(w.warnings.is_empty(), "{:?}", w.warnings);
        assert!(w.source.contains(&format!("dict '{name}'")) && w.source.contains("step 123"), "{}", w.source);
        let want: Vec<Vec<f32>> = param_specs(&micro)
            .iter()
            .map(|s| exp[&format!("micro_ckpt/{name}/denoise_fn.{}", s.key)].clone())
            .collect();
        bits_equal(&w.params, &want, name);
    }
    // bare U-Net state dict (no 'ema'/'model'): the group choice does not apply
    let nano: UNetConfig = serde_json::from_str(&meta["nano_config"]).unwrap();
    let hints = LoadHints { size: Some((nano.depth, nano.size)), num_heads: None, groups: Some(nano.groups) };
    let w = load_weights_with(&td("torch/micro_bare.pt"), WeightGroup::Model, &hints).unwrap();
    assert_eq!(w.cfg, nano);
    assert!(w.source.contains("bare state dict"), "{}", w.source);
    let want: Vec<Vec<f32>> =
        param_specs(&nano).iter().map(|s| exp[&format!("micro_bare//{}", s.key)].clone()).collect();
    bits_equal(&w.params, &want, "bare");
}

/// The golden file: config, batch, weights in param order, x, t and PyTorch's output.
struct Golden {
    cfg: UNetConfig,
    batch: usize,
    params: Vec<Vec<f32>>,
    x: Vec<f32>,
    t: Vec<f32>,
    out: Vec<f32>,
}

fn golden(name: &str) -> Golden {
    let path = td("golden").join(name);
    let ck = Checkpoint::read(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let (_, md) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = md.metadata().clone().unwrap();
    let cfg: UNetConfig = serde_json::from_str(&meta["config"]).unwrap();
    let get = |k: &str| ck.tensors[k].1.clone();
    Golden {
        params: ck.group("param", &param_specs(&cfg)).unwrap(),
        batch: meta["batch"].parse().unwrap(),
        x: get("x"),
        t: get("t"),
        out: get("out"),
        cfg,
    }
}

/// Forward of `params` under `cfg` on the golden input, compared with PyTorch's output.
fn forward_matches(g: &Golden, cfg: &UNetConfig, params: &[Vec<f32>], what: &str) {
    let be = CpuBackend::new();
    let mut net = UNet::new(&be, cfg, g.batch).unwrap();
    net.set_params(&be, params).unwrap();
    be.upload(&g.x, net.input_mut());
    net.forward(&be, &g.t);
    let mut out = vec![0f32; net.output_dims().numel()];
    be.download(net.output(), &mut out);
    // float32 engine vs float64 PyTorch (same tolerance as tests/golden.rs)
    compare(what, &out, &g.out, Tolerance { abs: 1e-4, rel: 1e-3 }).unwrap_or_else(|e| panic!("{what}: {e}"));
}

#[test]
fn every_safetensors_flavour_loads_to_pytorchs_forward() {
    let dir = tmp_dir("flavours");
    for name in ["tiny.safetensors", "tiny_heads2.safetensors"] {
        let g = golden(name);
        let hints = LoadHints {
            size: Some((g.cfg.depth, g.cfg.size)),
            num_heads: Some(g.cfg.num_heads),
            groups: Some(g.cfg.groups),
        };
        // 1. a meddpm training checkpoint: 'ema' holds the golden weights, 'model' other ones
        let be = CpuBackend::new();
        let tc = TrainConfig { batch: 1, ..TrainConfig::default() };
        let mut tr = Trainer::new(&be, &g.cfg, &tc).unwrap();
        for (e, (s, h)) in tr.ema.iter_mut().zip(tr.net.specs.iter().zip(&g.params)) {
            be.upload_param(h, &s.shape, e);
        }
        tr.step = 77;
        let ckpt = dir.join(format!("ckpt-{name}"));
        save_trainer(&ckpt, &be, &tr).unwrap();
        let w = load_weights(&ckpt, WeightGroup::Ema, None).unwrap();
        assert_eq!((w.cfg.clone(), w.step), (g.cfg.clone(), Some(77)));
        assert!(w.source.contains("meddpm checkpoint, group 'ema'"), "{}", w.source);
        forward_matches(&g, &w.cfg, &w.params, &format!("{name}: meddpm checkpoint ema"));
        let m = load_weights(&ckpt, WeightGroup::Model, None).unwrap();
        bits_equal(&m.params, &tr.net.host_tensors(&be, false), "model group");

        // 2. GaussianDiffusion keys (denoise_fn. + 13 buffers) with the config in the metadata
        let diff = dir.join(format!("diffusion-{name}"));
        export_safetensors(&diff, &g.cfg, &g.params, true, BTreeMap::new()).unwrap();
        let w = load_weights(&diff, WeightGroup::Ema, None).unwrap();
        assert_eq!(w.cfg, g.cfg);
        assert!(w.warnings.is_empty(), "{:?}", w.warnings);
        assert!(w.source.contains("from the file's metadata"), "{}", w.source);
        forward_matches(&g, &w.cfg, &w.params, &format!("{name}: diffusion-keyed state dict"));

        // 3. bare U-Net keys, no metadata at all: config inferred, size/groups/heads from hints
        let bare = dir.join(format!("bare-{name}"));
        let tensors: Vec<_> = param_specs(&g.cfg)
            .iter()
            .zip(&g.params)
            .map(|(s, p)| (s.key.clone(), s.shape.clone(), p.clone()))
            .collect();
        meddpm::checkpoint::write_atomic(
            &bare,
            &meddpm::checkpoint::native::serialize(&tensors, HashMap::new()).unwrap(),
        )
        .unwrap();
        let w = load_weights_with(&bare, WeightGroup::Ema, &hints).unwrap();
        assert_eq!(w.cfg, g.cfg);
        assert!(w.source.contains("inferred"), "{}", w.source);
        forward_matches(&g, &w.cfg, &w.params, &format!("{name}: bare state dict"));
        // without hints the non-reference topology asks for the size
        let e = load_weights(&bare, WeightGroup::Ema, None).unwrap_err().to_string();
        assert!(e.contains("neither the whole-head nor the BraTS topology") && e.contains("size"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn reference_topologies_get_the_reference_volume_by_default() {
    // shapes only (from the PyTorch key lists): a zero-filled dict of the real key set
    for (file, want) in [("keys_whole_head.txt", UNetConfig::whole_head()), ("keys_brats.txt", UNetConfig::brats())] {
        let dir = tmp_dir("refsize");
        let text = std::fs::read_to_string(td("golden").join(file)).unwrap();
        let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let (k, s) = l.split_once(' ').unwrap();
                let shape: Vec<usize> = s.split(',').map(|d| d.trim().parse().unwrap()).collect();
                let n = shape.iter().product();
                let data = if SCHEDULE_BUFFERS.contains(&k) {
                    meddpm::checkpoint::torch::schedule_buffers(250).into_iter().find(|(b, _)| *b == k).unwrap().1
                } else {
                    vec![0.0; n]
                };
                (k.to_string(), shape, data)
            })
            .collect();
        let p = dir.join("w.safetensors");
        meddpm::checkpoint::write_atomic(&p, &meddpm::checkpoint::native::serialize(&tensors, HashMap::new()).unwrap())
            .unwrap();
        let w = load_weights(&p, WeightGroup::Ema, None).unwrap();
        assert_eq!(w.cfg, want, "{file}");
        assert!(w.warnings.is_empty(), "{:?}", w.warnings);
        let w = load_weights(&p, WeightGroup::Ema, Some((32, 48))).unwrap();
        assert_eq!((w.cfg.depth, w.cfg.size), (32, 48));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn init_from_a_reference_checkpoint_puts_ema_into_the_online_weights() {
    let (exp, meta) = expected();
    let micro: UNetConfig = serde_json::from_str(&meta["micro_config"]).unwrap();
    let be = CpuBackend::new();
    let tc = TrainConfig { batch: 1, lr: 1e-3, ..TrainConfig::default() };
    let mut tr = Trainer::new(&be, &micro, &tc).unwrap();
    // a trainer that has run: step, RNG position and Adam state are not zero
    let n = micro.depth * micro.size * micro.size;
    let img = vec![0.3f32; n];
    let cond: Vec<f32> = (0..2 * n).map(|i| if i % 3 == 0 { 1.0 } else { -1.0 }).collect();
    for _ in 0..2 {
        tr.train_step(&be, || Ok((img.clone(), cond.clone()))).unwrap();
    }
    assert_eq!((tr.step, tr.draws), (2, 4));
    let w = init_trainer_from(&be, &mut tr, &td("torch/micro_ckpt.pt")).unwrap();
    assert!(w.source.contains("dict 'ema'"), "{}", w.source);
    let want: Vec<Vec<f32>> =
        param_specs(&micro).iter().map(|s| exp[&format!("micro_ckpt/ema/denoise_fn.{}", s.key)].clone()).collect();
    bits_equal(&tr.net.host_tensors(&be, false), &want, "online = file's ema");
    let specs = tr.net.specs.clone();
    let host = |bufs: &[<CpuBackend as Backend>::Buf]| -> Vec<Vec<f32>> {
        specs
            .iter()
            .zip(bufs)
            .map(|(s, b)| {
                let mut h = vec![0f32; s.numel()];
                be.download_param(b, &s.shape, &mut h);
                h
            })
            .collect()
    };
    bits_equal(&host(&tr.ema), &want, "ema = copy");
    assert!(host(&tr.adam_m).iter().chain(host(&tr.adam_v).iter()).flatten().all(|&v| v == 0.0), "adam zeroed");
    assert!(tr.net.host_tensors(&be, true).iter().flatten().all(|&v| v == 0.0), "grads zeroed");
    assert_eq!((tr.step, tr.draws), (0, 0));
    // the first step after it trains from the loaded weights and the EMA copies (step < ema_start)
    tr.train_step(&be, || Ok((img.clone(), cond.clone()))).unwrap();
    let online = tr.net.host_tensors(&be, false);
    assert!(online.iter().zip(&want).any(|(a, b)| a != b), "weights moved");
    bits_equal(&host(&tr.ema), &online, "ema re-copied at step 0");

    // a trainer of another model is refused, naming both configs
    let other = UNetConfig { groups: 1, ..micro.clone() };
    let mut tr2 = Trainer::new(&be, &UNetConfig { model_channels: 4, ..other }, &tc).unwrap();
    let e = init_trainer_from(&be, &mut tr2, &td("torch/micro_ckpt.pt")).unwrap_err().to_string();
    assert!(e.contains("micro_ckpt.pt") && e.contains("model_channels: 4") && e.contains("model_channels: 2"), "{e}");
}

#[test]
fn wrong_model_corrupt_and_foreign_files_give_clear_errors() {
    let dir = tmp_dir("errors");
    let hints = LoadHints { size: Some((4, 4)), num_heads: None, groups: Some(2) };
    let err = |p: &Path| load_weights_with(p, WeightGroup::Ema, &hints).unwrap_err().to_string();

    // a state dict that is not a Med-DDPM U-Net
    let e = err(&td("torch/misc.pt"));
    assert!(e.contains("misc.pt") && e.contains("time_embed.0.weight is missing"), "{e}");
    // legacy torch.save, text, empty, truncated zip, truncated safetensors
    let e = err(&td("torch/legacy.pt"));
    assert!(e.contains("legacy"), "{e}");
    let text = dir.join("notes.txt");
    std::fs::write(&text, "hello, this is not a checkpoint").unwrap();
    let e = err(&text);
    assert!(e.contains("notes.txt") && e.contains("expected a meddpm checkpoint"), "{e}");
    let empty = dir.join("empty.pt");
    std::fs::write(&empty, b"").unwrap();
    assert!(err(&empty).contains("empty.pt"));
    let pt = std::fs::read(td("torch/micro_ckpt.pt")).unwrap();
    let cut = dir.join("cut.pt");
    std::fs::write(&cut, &pt[..pt.len() / 2]).unwrap();
    let e = err(&cut);
    assert!(e.contains("cut.pt") && e.contains("truncated"), "{e}");
    let g = golden("tiny.safetensors");
    let st = dir.join("tiny.safetensors");
    export_safetensors(&st, &g.cfg, &g.params, false, BTreeMap::new()).unwrap();
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() - 100]).unwrap();
    let e = err(&st);
    assert!(e.contains("tiny.safetensors") && e.contains("safetensors"), "{e}");
    // a meddpm file whose stored config does not fit its tensors: every problem listed
    let g2 = golden("tiny_heads2.safetensors");
    let mism = dir.join("mismatch.safetensors");
    let tensors: Vec<_> =
        param_specs(&g2.cfg).iter().zip(&g2.params).map(|(s, p)| (s.key.clone(), s.shape.clone(), p.clone())).collect();
    let m = HashMap::from([("unet".to_string(), serde_json::to_string(&g.cfg).unwrap())]);
    meddpm::checkpoint::write_atomic(&mism, &meddpm::checkpoint::native::serialize(&tensors, m).unwrap()).unwrap();
    let e = load_weights(&mism, WeightGroup::Ema, None).unwrap_err().to_string();
    assert!(e.contains("mismatch.safetensors") && e.contains("missing") && e.contains("unexpected"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
