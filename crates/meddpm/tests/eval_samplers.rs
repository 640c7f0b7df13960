//! The sampler study writer (`meddpm::eval::samplers`) on runs of a tiny 16³ model on the CPU:
//! run folders as `scripts/gpu/samplers.sh` leaves them (timing.json, quality/eval.json,
//! agreement/eval.json) → the table, CSV and chart, checked against the eval reports they came
//! from; the wall-time rule and the verdict rule on values with known answers.

use meddpm::cpu::CpuBackend;
use meddpm::diffusion::{plan, Sampler, SamplerKind, SamplerSpec, Schedule};
use meddpm::eval::report::{evaluate, EvalSettings, NamedLabels, NamedVolume};
use meddpm::eval::samplers::{
    markdown, outside_spread, read_runs, write_study, BatchTiming, SampleTiming, StudyRun, TimedVolume,
};
use meddpm::model::{UNet, UNetConfig};
use meddpm::rng::Philox;
use std::path::{Path, PathBuf};

const T: usize = 20;
const SEEDS: [u64; 3] = [1, 2, 3];

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-evalsamplers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn named(name: String, v: Vec<f32>) -> NamedVolume {
    NamedVolume { name, dims: [16, 16, 16], data: v }
}

fn write(path: &Path, s: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, s).unwrap();
}

#[test]
fn study_table_csv_and_chart_from_tiny_model_runs() {
    let be = CpuBackend::new();
    let cfg = UNetConfig { depth: 16, size: 16, ..UNetConfig::tiny() };
    let mut net = UNet::new(&be, &cfg, 3).unwrap();
    let host: Vec<Vec<f32>> = net
        .specs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let r = Philox::new(9, 100 + i as u64);
            (0..s.numel()).map(|j| 0.2 * r.normal(j as u64)).collect()
        })
        .collect();
    net.set_params(&be, &host).unwrap();
    let (image, cond) = meddpm::phantom::pair(16, 16, 16, 1);
    let s = 16 * 16 * 16;
    let labels: Vec<u8> = (0..s)
        .map(|i| {
            if cond[s + i] > 0.0 {
                2
            } else if cond[i] > 0.0 {
                1
            } else {
                0
            }
        })
        .collect();
    let mask = NamedLabels { name: "mask.nii.gz".into(), dims: [16, 16, 16], labels };
    let real = vec![named("real.nii.gz".into(), image)];
    let settings = EvalSettings::default();
    let sched = Schedule::cosine(T);
    let mut sampler = Sampler::new(&be, &net).unwrap();
    let root = scratch();
    let specs = [
        SamplerSpec { kind: SamplerKind::Ipndm, steps: 5, eta: 0.0 },
        SamplerSpec::ddpm(T),
        SamplerSpec { kind: SamplerKind::Ddim, steps: 5, eta: 0.0 },
    ];
    let mut gens: Vec<Vec<NamedVolume>> = Vec::new();
    let mut ssim_means = Vec::new();
    for (r, spec) in specs.iter().enumerate() {
        let p = plan(spec, &sched).unwrap();
        let jobs: Vec<(&[f32], u64)> = SEEDS.iter().map(|&sd| (cond.as_slice(), sd)).collect();
        let vols = sampler.sample_jobs(&be, &mut net, &p, &jobs, |_| {}).unwrap();
        let gen: Vec<NamedVolume> =
            vols.into_iter().enumerate().map(|(k, v)| named(format!("run{r}/s_{k}.nii.gz"), v)).collect();
        let dir = root.join(format!("{}_{}", spec.kind, spec.steps));
        let quality = evaluate(&real, &gen, Some(&mask), &settings).unwrap();
        ssim_means.push((spec.kind, quality.paired_summary.as_ref().unwrap().ssim.mean));
        write(&dir.join("quality/eval.json"), &quality.to_json());
        // batch times: 10 s (start-up), then 3·(r+1) s for 3 volumes
        let vols: Vec<TimedVolume> = SEEDS
            .iter()
            .map(|&sd| TimedVolume { file: format!("s_{sd}.nii.gz"), mask: "mask".into(), seed: sd })
            .collect();
        let timing = SampleTiming {
            tool: "test".into(),
            device: "cpu".into(),
            sampler: *spec,
            timesteps: T,
            batch: 3,
            batches: vec![
                BatchTiming { seconds: 10.0, volumes: vols.clone() },
                BatchTiming { seconds: 3.0 * (r + 1) as f64, volumes: vols },
            ],
            ranks: 1,
        };
        write(&dir.join("timing.json"), &serde_json::to_string(&timing).unwrap());
        gens.push(gen);
    }
    std::fs::create_dir_all(root.join("not_a_run")).unwrap(); // folders without timing.json are ignored

    let runs = read_runs(&root).unwrap();
    let order: Vec<(SamplerKind, usize)> =
        runs.iter().map(|r| (r.timing.sampler.kind, r.timing.sampler.steps)).collect();
    assert_eq!(
        order,
        [(SamplerKind::Ddpm, T), (SamplerKind::Ddim, 5), (SamplerKind::Ipndm, 5)],
        "sampler order, then steps"
    );
    // seconds per volume: mean over the batches after the first
    let spv: Vec<f64> = runs.iter().map(|r| r.timing.seconds_per_volume()).collect();
    assert_eq!(spv, [2.0, 3.0, 1.0]);

    let out = root.join("out");
    let files = write_study(&runs, &out).unwrap();
    assert_eq!(files.len(), 3);
    let md = std::fs::read_to_string(out.join("samplers.md")).unwrap();
    let row = |md: &str, label: &str| md.lines().find(|l| l.starts_with(&format!("| {label} |"))).unwrap().to_string();
    let label = |k: SamplerKind| if k == SamplerKind::Ddim { "ddim η=0".to_string() } else { k.to_string() };
    for (kind, m) in &ssim_means {
        let r = row(&md, &label(*kind));
        assert!(r.contains(&format!(" {m:.4} ±")), "{kind}: SSIM {m:.4} not in {r}");
    }
    // the reference against itself is within its own spread on every metric
    assert!(md.contains(&format!("| ddpm | {T} | 2.0000 | none: within on every metric |")), "{md}");
    let csv = std::fs::read_to_string(out.join("samplers.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 4);
    assert!(lines[0].starts_with("sampler,steps,eta,seconds_per_volume,volumes,SSIM mean,SSIM std"));
    assert!(lines[2].starts_with("ddim,5,0,3,6,"), "{}", lines[2]);
    assert!(lines[2].ends_with(",,,"), "no agreement yet: {}", lines[2]);
    let svg = std::fs::read_to_string(out.join("samplers.svg")).unwrap();
    assert!(svg.starts_with("<svg") && ["ddim", "ipndm", "ddpm"].iter().all(|k| svg.contains(&format!("\n{k}\n"))));
    assert!(svg.contains("PSNR vs the real volume") && !svg.contains("PSNR vs DDPM-20,"), "one panel");

    // Agreement with the DDPM-20 volumes of the same seeds (paired by file name: s_k ↔ s_k).
    let reference: Vec<NamedVolume> =
        gens[1].iter().enumerate().map(|(k, v)| named(format!("ref/s_{k}.nii.gz"), v.data.clone())).collect();
    let mut ddim_psnr = 0.0;
    for (spec, gen) in specs.iter().zip(&gens) {
        let a = evaluate(&reference, gen, Some(&mask), &settings).unwrap();
        assert_eq!(a.paired.len(), 3);
        if spec.kind == SamplerKind::Ddim {
            ddim_psnr = a.paired_summary.as_ref().unwrap().psnr_db.mean;
        }
        write(&root.join(format!("{}_{}/agreement/eval.json", spec.kind, spec.steps)), &a.to_json());
    }
    let runs = read_runs(&root).unwrap();
    write_study(&runs, &out).unwrap();
    let md = std::fs::read_to_string(out.join("samplers.md")).unwrap();
    assert!(row(&md, "ddim η=0").contains(&format!(" {ddim_psnr:.4} ±")), "{md}");
    assert!(row(&md, "ddpm").contains(" ∞ ± "), "DDPM-20 against itself: {md}");
    assert_eq!(markdown(&runs), md);
    let svg = std::fs::read_to_string(out.join("samplers.svg")).unwrap();
    assert!(svg.contains("PSNR vs DDPM-20, same seed"), "second panel");
    assert!(md.contains("| PSNR dB vs DDPM-20 |") && md.contains("## Within DDPM-20's seed-to-seed spread?"));
    std::fs::remove_dir_all(&root).ok();
}

#[test]
fn verdict_flags_metrics_outside_the_reference_spread() {
    use meddpm::eval::report::Stat;
    let dir = PathBuf::from("v");
    let base = {
        let v = |x: f32| named("g.nii.gz".into(), vec![x; 16 * 16 * 16]);
        let real = vec![named("r.nii.gz".into(), vec![0.0; 16 * 16 * 16])];
        evaluate(&real, &[v(0.1), v(0.2)], None, &EvalSettings::default()).unwrap()
    };
    let timing = |kind, steps| SampleTiming {
        tool: "t".into(),
        device: "d".into(),
        sampler: SamplerSpec { kind, steps, eta: 0.0 },
        timesteps: 250,
        batch: 1,
        batches: vec![],
        ranks: 1,
    };
    let refr =
        StudyRun { dir: dir.clone(), timing: timing(SamplerKind::Ddpm, 250), quality: base.clone(), agreement: None };
    let mut q = base.clone();
    let ps = q.paired_summary.as_mut().unwrap();
    // PSNR moved by more than the reference's std, SSIM by less
    let r_psnr = base.paired_summary.as_ref().unwrap().psnr_db.clone();
    ps.psnr_db = Stat { mean: r_psnr.mean + 1.5 * r_psnr.std, ..r_psnr };
    let r_ssim = base.paired_summary.as_ref().unwrap().ssim.clone();
    ps.ssim = Stat { mean: r_ssim.mean + 0.5 * r_ssim.std, ..r_ssim };
    assert!(r_psnr.std > 0.0 && r_ssim.std > 0.0);
    let other = StudyRun { dir, timing: timing(SamplerKind::Ipndm, 10), quality: q, agreement: None };
    assert_eq!(outside_spread(&other, &refr), ["PSNR dB"]);
    assert!(outside_spread(&refr, &refr).is_empty());
    assert!(timing(SamplerKind::Ddim, 5).seconds_per_volume().is_nan());
}

/// `sample --gpus`: the ranks' timings merge into one file whose per-volume time leaves out every
/// rank's first batch (the cold start), and a one-GPU file is written exactly as before.
#[test]
fn rank_timings_merge_into_one_and_skip_every_first_batch() {
    let vol = |seed| TimedVolume { file: format!("s_{seed}.nii.gz"), mask: "m".into(), seed };
    let part = |device: &str, secs: &[f64], seed0: u64| SampleTiming {
        tool: "t".into(),
        device: device.into(),
        sampler: SamplerSpec { kind: SamplerKind::Ddim, steps: 10, eta: 0.0 },
        timesteps: 250,
        batch: 1,
        batches: secs
            .iter()
            .enumerate()
            .map(|(i, &s)| BatchTiming { seconds: s, volumes: vec![vol(seed0 + 2 * i as u64)] })
            .collect(),
        ranks: 1,
    };
    let one = part("gpu", &[9.0, 2.0], 0);
    let json = serde_json::to_string(&one).unwrap();
    assert!(!json.contains("ranks"), "a one-GPU timing file is unchanged: {json}");
    let back: SampleTiming = serde_json::from_str(&json).unwrap();
    assert_eq!(back.ranks, 1);
    assert_eq!(one.seconds_per_volume(), 2.0);

    // rank 0 drew seeds 0, 2, 4; rank 1 seeds 1, 3 (cold starts 9 s and 8 s)
    let m = SampleTiming::merge(vec![part("gpu", &[9.0, 2.0, 4.0], 0), part("gpu", &[8.0, 3.0], 1)]).unwrap();
    assert_eq!(m.ranks, 2);
    assert_eq!(m.device, "2 × gpu");
    let seeds: Vec<u64> = m.batches.iter().map(|b| b.volumes[0].seed).collect();
    assert_eq!(seeds, [0, 1, 2, 3, 4]);
    assert_eq!(m.volumes(), 5);
    // (2 + 3 + 4) / 3: both first batches left out
    assert!((m.seconds_per_volume() - 3.0).abs() < 1e-12, "{}", m.seconds_per_volume());
    let back: SampleTiming = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
    assert_eq!(back, m);
    let mixed = SampleTiming::merge(vec![part("a", &[1.0], 0), part("b", &[1.0], 1)]).unwrap();
    assert_eq!(mixed.device, "a + b");
    assert!(SampleTiming::merge(Vec::new()).is_none());
}
