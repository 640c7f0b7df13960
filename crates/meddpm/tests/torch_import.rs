//! Tests of the PyTorch `.pt` reader, the state-dict → U-Net mapping, config inference and the
//! safetensors export (checkpoint/torch.rs), against files written by PyTorch itself.
//!
//! Reference data (tools/reference/make_torch_fixtures.py, make_golden.py, PyTorch 2.11):
//! `testdata/torch/*.pt` with their expected values in `testdata/torch/expected.safetensors`
//! (values as `tensor.float()`), the golden U-Net files and key lists in `testdata/golden/`.
//! Corrupt inputs are derived here from the real files.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use meddpm::checkpoint::torch::{
    export_safetensors, infer_config, infer_config_from_shapes, map_to_unet, read_state_dicts, schedule_buffers,
    StateDict, SCHEDULE_BUFFERS,
};
use meddpm::model::config::UNetConfig;
use meddpm::model::params::param_specs;
use safetensors::SafeTensors;

fn td(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata").join(p)
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-torch-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

struct Expected {
    bytes: Vec<u8>,
}

impl Expected {
    fn load() -> Self {
        Expected { bytes: std::fs::read(td("torch/expected.safetensors")).unwrap() }
    }
    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).unwrap()
    }
    fn raw_meta(&self, key: &str) -> String {
        let (_, m) = SafeTensors::read_metadata(&self.bytes).unwrap();
        m.metadata().as_ref().unwrap()[key].clone()
    }
    fn meta(&self, key: &str) -> serde_json::Value {
        serde_json::from_str(&self.raw_meta(key)).unwrap()
    }
    fn config(&self, key: &str) -> UNetConfig {
        serde_json::from_value(self.meta(key)).unwrap()
    }
    fn tensor(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let st = self.st();
        let t = st.tensor(name).unwrap_or_else(|e| panic!("expected.safetensors has no {name}: {e}"));
        let v = t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        (t.shape().to_vec(), v)
    }
    fn order(&self, stem: &str, dict: &str) -> Vec<String> {
        self.meta("order")[stem][dict].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect()
    }
}

/// Every entry of `got` equals `expected.safetensors` at `<stem>/<dict>/<key>` bit for bit.
fn assert_dict_equals(exp: &Expected, got: &StateDict, stem: &str, dict: &str, alias: &dyn Fn(&str) -> String) {
    for (k, shape, v) in got {
        let (es, ev) = exp.tensor(&alias(&format!("{stem}/{dict}/{k}")));
        assert_eq!(shape, &es, "{stem}/{dict}/{k} shape");
        assert_eq!(v.len(), ev.len(), "{stem}/{dict}/{k} length");
        for (i, (a, b)) in v.iter().zip(&ev).enumerate() {
            assert!(a.to_bits() == b.to_bits(), "{stem}/{dict}/{k}[{i}]: read {a}, PyTorch {b}");
        }
    }
}

#[test]
fn misc_tensors_dtypes_strides_and_shared_storages() {
    let exp = Expected::load();
    let ck = read_state_dicts(td("torch/misc.pt")).unwrap();
    assert_eq!(ck.step, None);
    assert_eq!(ck.dicts.keys().collect::<Vec<_>>(), vec![""]);
    let d = &ck.dicts[""];
    let keys: Vec<String> = d.iter().map(|e| e.0.clone()).collect();
    assert_eq!(keys, exp.order("misc", ""));
    assert_eq!(keys.len(), 15);
    assert_dict_equals(&exp, d, "misc", "", &|k| k.to_string());
    // spot checks with closed forms, independent of the expected file
    let get = |k: &str| d.iter().find(|e| e.0 == k).unwrap();
    assert_eq!(get("i64").2, vec![-3.0, -2.0, -1.0, 0.0, 1.0, 2.0]);
    assert_eq!(get("u8").2, vec![0.0, 7.0, 255.0]);
    assert_eq!(get("bool").2, vec![1.0, 0.0, 1.0]);
    assert_eq!((get("scalar").1.clone(), get("scalar").2.clone()), (vec![], vec![2.5]));
    assert_eq!((get("empty").1.clone(), get("empty").2.len()), (vec![0, 3], 0));
    let e = get("expanded");
    assert_eq!(e.1, vec![3, 4]);
    for r in 0..3 {
        assert!(e.2[r * 4..r * 4 + 4].iter().all(|&x| x == e.2[r * 4]), "stride-0 rows repeat");
    }
}

#[test]
fn training_checkpoint_model_and_ema() {
    let exp = Expected::load();
    let ck = read_state_dicts(td("torch/micro_ckpt.pt")).unwrap();
    assert_eq!(ck.step, Some(123));
    // written on the GPU machine: CUDA-tagged storages, like the released checkpoints
    assert_eq!(ck.storage_locations, vec![exp.raw_meta("device")]);
    assert_eq!(ck.dicts.keys().collect::<Vec<_>>(), vec!["ema", "model"]);
    let order = exp.order("micro_ckpt", "model");
    for name in ["model", "ema"] {
        let keys: Vec<String> = ck.dicts[name].iter().map(|e| e.0.clone()).collect();
        assert_eq!(keys, order, "{name} key order");
    }
    assert_dict_equals(&exp, &ck.dicts["model"], "micro_ckpt", "model", &|k| k.to_string());
    // ema's schedule buffers are the model's (stored once in the expected file)
    assert_dict_equals(&exp, &ck.dicts["ema"], "micro_ckpt", "ema", &|k| {
        let last = k.rsplit('/').next().unwrap();
        if SCHEDULE_BUFFERS.contains(&last) {
            format!("micro_ckpt/model/{last}")
        } else {
            k.to_string()
        }
    });
    // model and ema really differ
    let (m, e) = (&ck.dicts["model"], &ck.dicts["ema"]);
    assert!(m.iter().zip(e).filter(|(a, _)| a.0.starts_with("denoise_fn.")).all(|(a, b)| a.2 != b.2));
    // order = 13 buffers, then the U-Net in param_specs order
    let cfg = exp.config("micro_config");
    let want: Vec<String> = SCHEDULE_BUFFERS
        .iter()
        .map(|s| s.to_string())
        .chain(param_specs(&cfg).iter().map(|s| format!("denoise_fn.{}", s.key)))
        .collect();
    assert_eq!(order, want);
}

#[test]
fn bare_state_dict_maps_to_the_unet() {
    let exp = Expected::load();
    let ck = read_state_dicts(td("torch/micro_bare.pt")).unwrap();
    assert_eq!((ck.step, ck.dicts.len()), (None, 1));
    assert_eq!(ck.storage_locations, vec!["cpu"]);
    let (name, d) = ck.dict(None).unwrap();
    assert_eq!(name, "");
    assert_dict_equals(&exp, d, "micro_bare", "", &|k| k.to_string());
    let cfg = exp.config("nano_config");
    let keys: Vec<&str> = d.iter().map(|e| e.0.as_str()).collect();
    let specs = param_specs(&cfg);
    assert_eq!(keys, specs.iter().map(|s| s.key.as_str()).collect::<Vec<_>>());
    let m = map_to_unet(d, &cfg).unwrap();
    assert!(m.warnings.is_empty(), "{:?}", m.warnings);
    assert_eq!(m.params.len(), specs.len());
}

#[test]
fn map_ema_to_unet_in_param_order_without_warnings() {
    let exp = Expected::load();
    let cfg = exp.config("micro_config");
    let ck = read_state_dicts(td("torch/micro_ckpt.pt")).unwrap();
    let m = ck.to_unet(None, &cfg).unwrap(); // None picks 'ema'
    assert!(m.warnings.is_empty(), "{:?}", m.warnings);
    for (s, p) in param_specs(&cfg).iter().zip(&m.params) {
        let (shape, v) = exp.tensor(&format!("micro_ckpt/ema/denoise_fn.{}", s.key));
        assert_eq!(shape, s.shape, "{}", s.key);
        assert_eq!(p, &v, "{}", s.key);
    }
    let online = ck.to_unet(Some("model"), &cfg).unwrap();
    assert_ne!(online.params, m.params);
    let e = ck.to_unet(Some("optimizer"), &cfg).unwrap_err().to_string();
    assert!(e.contains("no state dict \"optimizer\"") && e.contains("\"ema\""), "{e}");
}

#[test]
fn wrong_model_lists_every_missing_unexpected_and_wrong_shaped_key() {
    let exp = Expected::load();
    let cfg = exp.config("micro_config");
    let ck = read_state_dicts(td("torch/micro_ckpt.pt")).unwrap();
    // more res blocks, no encoder attention, 4 input channels
    let other = UNetConfig { num_res_blocks: 2, attention_ds: vec![], in_channels: 4, ..cfg.clone() };
    let e = ck.to_unet(Some("ema"), &other).unwrap_err().to_string();
    assert!(e.contains("micro_ckpt.pt") && e.contains("dict \"ema\""), "{e}");
    assert!(e.contains("missing") && e.contains("input_blocks.2.0.in_layers.0.weight"), "{e}");
    assert!(e.contains("unexpected") && e.contains("denoise_fn.input_blocks.3.1.qkv.weight"), "{e}");
    assert!(
        e.contains("wrong shape") && e.contains("input_blocks.0.0.weight: file [2, 3, 3, 3, 3], model [2, 4, 3, 3, 3]"),
        "{e}"
    );
    // the counts in the message equal an independent count of the differences
    let want: std::collections::HashSet<String> = param_specs(&other).into_iter().map(|s| s.key).collect();
    let have: std::collections::HashSet<String> = param_specs(&cfg).into_iter().map(|s| s.key).collect();
    let n_missing = want.difference(&have).count();
    let n_unexpected = have.difference(&want).count();
    assert!(e.contains(&format!("missing ({n_missing})")), "{e}");
    assert!(e.contains(&format!("unexpected ({n_unexpected})")), "{e}");
    // a dict from another network entirely
    let misc = read_state_dicts(td("torch/misc.pt")).unwrap();
    let e = map_to_unet(&misc.dicts[""], &cfg).unwrap_err().to_string();
    assert!(e.contains("unexpected (15)") && e.contains("time_embed.0.weight"), "{e}");
    let e = infer_config(&misc.dicts[""], 4, 4).unwrap_err().to_string();
    assert!(e.contains("time_embed.0.weight is missing"), "{e}");
}

#[test]
fn schedule_buffer_mismatch_is_a_named_warning() {
    let exp = Expected::load();
    let cfg = exp.config("micro_config");
    let ck = read_state_dicts(td("torch/micro_ckpt.pt")).unwrap();
    let mut d = ck.dicts["ema"].clone();
    let e = d.iter_mut().find(|e| e.0 == "posterior_mean_coef2").unwrap();
    e.2[17] *= 1.01;
    d.retain(|e| e.0 != "sqrt_recip_alphas_cumprod");
    let m = map_to_unet(&d, &cfg).unwrap();
    assert_eq!(m.warnings.len(), 2, "{:?}", m.warnings);
    assert!(m.warnings.iter().any(|w| w.contains("posterior_mean_coef2") && w.contains("index 17")));
    assert!(m.warnings.iter().any(|w| w.contains("sqrt_recip_alphas_cumprod is missing")));
    // a T = 1000 schedule (the whole-head trainer's default) is consistent but flagged
    let mut d1000: StateDict =
        ck.dicts["ema"].iter().filter(|e| !SCHEDULE_BUFFERS.contains(&e.0.as_str())).cloned().collect();
    for (name, v) in schedule_buffers(1000) {
        d1000.push((name.to_string(), vec![1000], v));
    }
    let m = map_to_unet(&d1000, &cfg).unwrap();
    assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
    assert!(m.warnings[0].contains("T = 1000"), "{:?}", m.warnings);
}

/// `<key> <d0>,<d1>,...` lines written by make_golden.py from the PyTorch GaussianDiffusion.
fn key_file(name: &str) -> Vec<(String, Vec<usize>)> {
    std::fs::read_to_string(td(name))
        .unwrap()
        .lines()
        .map(|l| {
            let (k, s) = l.split_once(' ').unwrap();
            (k.to_string(), s.split(',').map(|d| d.parse().unwrap()).collect())
        })
        .collect()
}

#[test]
fn pytorch_state_dict_order_equals_param_specs_and_configs_are_inferred() {
    for (file, cfg, n) in [
        ("golden/keys_whole_head.txt", UNetConfig::whole_head(), 259),
        ("golden/keys_brats.txt", UNetConfig::brats(), 351),
    ] {
        let keys = key_file(file);
        assert_eq!(keys.len(), n, "{file}");
        let want: Vec<(String, Vec<usize>)> = SCHEDULE_BUFFERS
            .iter()
            .map(|s| (s.to_string(), vec![250]))
            .chain(param_specs(&cfg).into_iter().map(|s| (format!("denoise_fn.{}", s.key), s.shape)))
            .collect();
        assert_eq!(keys, want, "{file}: PyTorch order/shapes vs param_specs");
        let inferred = infer_config_from_shapes(&keys, cfg.depth, cfg.size).unwrap();
        assert_eq!(inferred, cfg, "{file}");
    }
    let keys = key_file("golden/keys_whole_head.txt");
    let e = infer_config_from_shapes(&keys, 120, 128).unwrap_err().to_string();
    assert!(e.contains("depth 120") && e.contains("16"), "{e}");
    // the micro checkpoint: everything but groups (32 assumed) and heads
    let exp = Expected::load();
    let ck = read_state_dicts(td("torch/micro_ckpt.pt")).unwrap();
    let micro = exp.config("micro_config");
    let inf = infer_config(&ck.dicts["model"], micro.depth, micro.size).unwrap();
    assert_eq!(UNetConfig { groups: micro.groups, ..inf }, micro);
}

#[test]
fn golden_files_match_param_specs_and_schedule() {
    for name in ["golden/tiny.safetensors", "golden/tiny_heads2.safetensors"] {
        let bytes = std::fs::read(td(name)).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let cfg: UNetConfig = serde_json::from_str(&meta.metadata().as_ref().unwrap()["config"]).unwrap();
        cfg.validate().unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let specs = param_specs(&cfg);
        for s in &specs {
            for p in ["param", "grad"] {
                let t = st.tensor(&format!("{p}.{}", s.key)).unwrap_or_else(|_| panic!("{name}: {p}.{}", s.key));
                assert_eq!(t.shape(), s.shape.as_slice(), "{name}: {p}.{}", s.key);
            }
        }
        let n_params = st.names().iter().filter(|n| n.starts_with("param.")).count();
        assert_eq!(n_params, specs.len(), "{name}: no extra parameters");
        let t = 250;
        for (buf, want) in schedule_buffers(t) {
            let v = st.tensor(&format!("sched.{buf}")).unwrap();
            let got: Vec<f32> =
                v.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            for (i, (g, &w32)) in got.iter().zip(&want).enumerate() {
                // numpy and Rust libm may differ by an ulp in f64; after rounding to f32 ≤ 1 ulp
                let ulp = (w32.abs() * f32::EPSILON).max(f32::MIN_POSITIVE);
                assert!((g - w32).abs() <= ulp, "{name}: sched.{buf}[{i}] {g} vs {w32}");
            }
        }
    }
}

fn zip_entries(path: &Path) -> Vec<(String, Vec<u8>)> {
    let f = std::fs::File::open(path).unwrap();
    let mut z = zip::ZipArchive::new(f).unwrap();
    (0..z.len())
        .map(|i| {
            let mut e = z.by_index(i).unwrap();
            let mut b = Vec::new();
            e.read_to_end(&mut b).unwrap();
            (e.name().unwrap().to_string(), b)
        })
        .collect()
}

fn write_zip(path: &Path, entries: &[(String, Vec<u8>)]) {
    let mut w = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let opt = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (n, b) in entries {
        w.start_file(n.as_str(), opt).unwrap();
        w.write_all(b).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn corrupt_truncated_and_foreign_files_give_clear_errors() {
    let dir = tmp_dir("corrupt");
    let src = td("torch/micro_ckpt.pt");
    let bytes = std::fs::read(&src).unwrap();
    let err = |p: &Path| read_state_dicts(p).unwrap_err().to_string();
    let write = |n: &str, b: &[u8]| {
        let p = dir.join(n);
        std::fs::write(&p, b).unwrap();
        p
    };

    let e = err(&write("half.pt", &bytes[..bytes.len() / 2]));
    assert!(e.contains("half.pt") && e.contains("truncated"), "{e}");
    let e = err(&write("text.pt", b"hello, not a checkpoint\n"));
    assert!(e.contains("not a PyTorch checkpoint") && e.contains("not a zip"), "{e}");
    let e = err(&write("empty.pt", b""));
    assert!(e.contains("not a zip") && e.contains("0 bytes"), "{e}");
    let e = err(&td("torch/legacy.pt"));
    assert!(e.contains("legacy") && e.contains("not supported"), "{e}");
    let e = err(&dir.join("does-not-exist.pt"));
    assert!(e.contains("does-not-exist.pt"), "{e}");

    let entries = zip_entries(&src);
    let pkl = entries.iter().find(|e| e.0.ends_with("data.pkl")).unwrap().0.clone();
    assert_eq!(pkl, "micro_ckpt/data.pkl");
    // a zip that is not a torch archive
    let p = dir.join("other.zip");
    write_zip(&p, &[("readme.txt".into(), b"hi".to_vec())]);
    let e = err(&p);
    assert!(e.contains("no data.pkl") && e.contains("readme.txt"), "{e}");
    // a storage entry missing
    let p = dir.join("nostorage.pt");
    write_zip(&p, &entries.iter().filter(|e| e.0 != "micro_ckpt/data/5").cloned().collect::<Vec<_>>());
    let e = err(&p);
    assert!(e.contains("micro_ckpt/data/5 is missing"), "{e}");
    // a storage entry too short
    let p = dir.join("short.pt");
    let short: Vec<_> = entries
        .iter()
        .map(|(n, b)| (n.clone(), if n == "micro_ckpt/data/0" { b[..8].to_vec() } else { b.clone() }))
        .collect();
    write_zip(&p, &short);
    let e = err(&p);
    assert!(e.contains("micro_ckpt/data/0") && e.contains("has 8 bytes") && e.contains("1000 bytes"), "{e}");
    // a truncated pickle, and a pickle with a foreign opcode
    for (name, f) in [
        ("pkl_cut.pt", Box::new(|b: &[u8]| b[..b.len() / 3].to_vec()) as Box<dyn Fn(&[u8]) -> Vec<u8>>),
        ("pkl_bad.pt", Box::new(|b: &[u8]| [&b[..2], &[0xffu8][..], &b[2..]].concat())),
    ] {
        let p = dir.join(name);
        let bad: Vec<_> = entries.iter().map(|(n, b)| (n.clone(), if *n == pkl { f(b) } else { b.clone() })).collect();
        write_zip(&p, &bad);
        let e = err(&p);
        assert!(e.contains(name) && e.contains("data.pkl byte"), "{e}");
    }
    // a pickle of something that is not a dict
    let p = dir.join("list.pt");
    let lst: Vec<_> = entries
        .iter()
        .map(|(n, b)| (n.clone(), if *n == pkl { vec![0x80, 2, b']', b'.'] } else { b.clone() }))
        .collect();
    write_zip(&p, &lst);
    let e = err(&p);
    assert!(e.contains("is a list, expected a dict"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn export_round_trip_and_no_clobber_on_failure() {
    let dir = tmp_dir("export");
    let exp = Expected::load();
    let cfg = exp.config("micro_config");
    let ck = read_state_dicts(td("torch/micro_ckpt.pt")).unwrap();
    let m = ck.to_unet(Some("ema"), &cfg).unwrap();
    let specs = param_specs(&cfg);
    for diffusion_keys in [false, true] {
        let out = dir.join(format!("w{diffusion_keys}.safetensors"));
        let meta = BTreeMap::from([("source".to_string(), "micro_ckpt.pt".to_string())]);
        export_safetensors(&out, &cfg, &m.params, diffusion_keys, meta).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let prefix = if diffusion_keys { "denoise_fn." } else { "" };
        assert_eq!(st.len(), specs.len() + if diffusion_keys { 13 } else { 0 });
        for s in &specs {
            let key = format!("{prefix}{}", s.key);
            let t = st.tensor(&key).unwrap();
            assert_eq!(t.shape(), s.shape.as_slice());
            let (_, want) = exp.tensor(&format!("micro_ckpt/ema/denoise_fn.{}", s.key));
            let got: Vec<f32> =
                t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            assert_eq!(got, want, "{key}");
        }
        let (_, md) = SafeTensors::read_metadata(&bytes).unwrap();
        let md = md.metadata().clone().unwrap();
        assert_eq!(serde_json::from_str::<UNetConfig>(&md["unet"]).unwrap(), cfg);
        assert_eq!(md["format"], "meddpm-state-dict");
        assert_eq!(md["source"], "micro_ckpt.pt");
        if diffusion_keys {
            // the buffers written equal the ones PyTorch saved
            for b in SCHEDULE_BUFFERS {
                let (_, want) = exp.tensor(&format!("micro_ckpt/model/{b}"));
                let got: Vec<f32> = st
                    .tensor(b)
                    .unwrap()
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() <= w.abs() * f32::EPSILON, "{b}: {g} vs {w}");
                }
            }
        }
    }
    // a failing export leaves the existing file as it was, and no temporary file behind
    let out = dir.join("wfalse.safetensors");
    let before = std::fs::read(&out).unwrap();
    let e = export_safetensors(&out, &cfg, &m.params[1..], false, BTreeMap::new()).unwrap_err().to_string();
    assert!(e.contains("parameter tensors"), "{e}");
    assert_eq!(std::fs::read(&out).unwrap(), before);
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 2, "{left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
