//! NVIDIA GPUs across generations, and a roofline model that predicts each category's time on
//! each of them from the FLOPs and bytes we count.
//!
//! The table holds vendor datasheet values (dense peaks: NVIDIA lists tensor-core peaks "with
//! sparsity", which are twice the dense ones; we store the dense ones) and marks where a value
//! comes from elsewhere (architecture whitepapers, or the device attributes that Nsight Compute
//! read on the project's own H200). A missing value is `None`, never a guess.
//!
//! The roofline: a kernel that does `F` FLOPs and must move `B` bytes takes at least
//! `max(F / peak, B / bandwidth)` on a GPU; the peak is the tensor-core peak of the math mode for
//! convolutions and GEMMs (when the GPU has one) and the FP32 peak for everything else. Summed
//! over a category's kernels this is a lower bound on its time; a measurement below it means the
//! count or the table is wrong, which [`check`] reports.

use super::kernels::{Category, KernelRecord};
use crate::backend::Precision;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One GPU model. Peaks in TFLOP/s (dense), bandwidth in GB/s, L2 in MiB.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// Short key (`h200`, `a100-80`, …) used on the command line.
    pub key: &'static str,
    pub name: &'static str,
    pub arch: &'static str,
    pub sms: Option<u32>,
    pub boost_mhz: Option<u32>,
    pub fp32_tflops: f64,
    /// TF32 tensor-core dense peak; `None` before Ampere.
    pub tf32_tflops: Option<f64>,
    /// BF16 tensor-core dense peak; `None` before Ampere.
    pub bf16_tflops: Option<f64>,
    /// FP16 tensor-core dense peak (V100's only tensor-core mode).
    pub fp16_tflops: Option<f64>,
    pub mem_gbps: f64,
    pub l2_mib: Option<f64>,
    /// Where each value comes from.
    pub source: &'static str,
}

/// The GPUs the report predicts for (issue 4: at least V100, A100 40/80, H100 SXM, H200, L40S, B200).
pub fn gpus() -> Vec<Gpu> {
    vec![
        Gpu {
            key: "v100",
            name: "Tesla V100 SXM2",
            arch: "Volta (sm_70)",
            sms: Some(80),
            boost_mhz: Some(1530),
            fp32_tflops: 15.7,
            tf32_tflops: None,
            bf16_tflops: None,
            fp16_tflops: Some(125.0),
            mem_gbps: 900.0,
            l2_mib: Some(6.0),
            source: "datasheet (V100 SXM2: FP32 15.7, tensor 125 TFLOPS, HBM2 900 GB/s); SMs, boost clock, L2: Volta whitepaper",
        },
        Gpu {
            key: "a100-40",
            name: "A100 40GB SXM",
            arch: "Ampere (sm_80)",
            sms: Some(108),
            boost_mhz: Some(1410),
            fp32_tflops: 19.5,
            tf32_tflops: Some(156.0),
            bf16_tflops: Some(312.0),
            fp16_tflops: Some(312.0),
            mem_gbps: 1555.0,
            l2_mib: Some(40.0),
            source: "datasheet (A100 40GB SXM: FP32 19.5, TF32 156, BF16 312 dense, HBM2 1,555 GB/s); SMs, boost clock, L2: Ampere whitepaper",
        },
        Gpu {
            key: "a100-80",
            name: "A100 80GB SXM",
            arch: "Ampere (sm_80)",
            sms: Some(108),
            boost_mhz: Some(1410),
            fp32_tflops: 19.5,
            tf32_tflops: Some(156.0),
            bf16_tflops: Some(312.0),
            fp16_tflops: Some(312.0),
            mem_gbps: 2039.0,
            l2_mib: Some(40.0),
            source: "datasheet (A100 80GB SXM: FP32 19.5, TF32 156, BF16 312 dense, HBM2e 2,039 GB/s); SMs, boost clock, L2: Ampere whitepaper",
        },
        Gpu {
            key: "h100",
            name: "H100 SXM",
            arch: "Hopper (sm_90)",
            sms: Some(132),
            boost_mhz: Some(1980),
            fp32_tflops: 67.0,
            tf32_tflops: Some(494.5),
            bf16_tflops: Some(989.5),
            fp16_tflops: Some(989.5),
            mem_gbps: 3350.0,
            l2_mib: Some(50.0),
            source: "datasheet (H100 SXM: FP32 67, TF32 989 and BF16 1,979 with sparsity, i.e. 494.5 / 989.5 dense, HBM3 3.35 TB/s); SMs, boost clock, L2: Hopper whitepaper",
        },
        Gpu {
            key: "h200",
            name: "H200 SXM",
            arch: "Hopper (sm_90)",
            sms: Some(132),
            boost_mhz: Some(1980),
            fp32_tflops: 67.0,
            tf32_tflops: Some(494.5),
            bf16_tflops: Some(989.5),
            fp16_tflops: Some(989.5),
            mem_gbps: 4800.0,
            l2_mib: Some(60.0),
            source: "datasheet (H200 SXM: FP32 67, TF32 989 and BF16 1,979 with sparsity, i.e. 494.5 / 989.5 dense, HBM3e 4.8 TB/s); SMs 132, clock 1980 MHz, L2 60 MiB: device attributes read by ncu on the project's H200",
        },
        Gpu {
            key: "l40s",
            name: "L40S",
            arch: "Ada Lovelace (sm_89)",
            sms: Some(142),
            boost_mhz: Some(2520),
            fp32_tflops: 91.6,
            tf32_tflops: Some(183.0),
            bf16_tflops: Some(362.05),
            fp16_tflops: Some(362.05),
            mem_gbps: 864.0,
            l2_mib: None,
            source: "datasheet (L40S: FP32 91.6, TF32 183, BF16 362.05 dense, GDDR6 864 GB/s, 142 RT cores = 142 SMs); boost 2520 MHz: board specification; L2 not in the datasheet",
        },
        Gpu {
            key: "b200",
            name: "B200 (HGX, 1000 W)",
            arch: "Blackwell (sm_100)",
            sms: None,
            boost_mhz: None,
            fp32_tflops: 75.0,
            tf32_tflops: Some(1100.0),
            bf16_tflops: Some(2250.0),
            fp16_tflops: Some(2250.0),
            mem_gbps: 7700.0,
            l2_mib: None,
            source: "datasheet (HGX B200 per GPU: FP32 75, TF32 2.2 and BF16 4.5 PFLOPS with sparsity, i.e. 1,100 / 2,250 dense, HBM3e 7.7 TB/s); SMs, clock and L2 not in the datasheet",
        },
    ]
}

/// Look a GPU up by key (`h200`) or by a device name as a driver reports it ("NVIDIA H200").
pub fn find(name: &str) -> Option<Gpu> {
    let n = name.to_ascii_lowercase();
    let all = gpus();
    if let Some(g) = all.iter().find(|g| g.key == n) {
        return Some(g.clone());
    }
    // device names: "NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "Tesla V100-SXM2-32GB"
    let has = |s: &str| n.contains(s);
    let key = if has("h200") {
        "h200"
    } else if has("h100") {
        "h100"
    } else if has("a100") && (has("80g") || has("80 g")) {
        "a100-80"
    } else if has("a100") {
        "a100-40"
    } else if has("v100") {
        "v100"
    } else if has("l40s") {
        "l40s"
    } else if has("b200") {
        "b200"
    } else {
        return None;
    };
    all.into_iter().find(|g| g.key == key)
}

/// Math mode of convolutions and GEMMs (what picks the compute roof).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Math {
    /// True fp32 FMA math.
    Fp32,
    /// TF32 tensor cores.
    Tf32,
    /// BF16 tensor cores.
    Bf16,
}

impl Math {
    pub fn label(self) -> &'static str {
        match self {
            Math::Fp32 => "fp32",
            Math::Tf32 => "tf32",
            Math::Bf16 => "bf16",
        }
    }
}

/// The math a backend precision runs its convolutions and GEMMs in.
impl From<Precision> for Math {
    fn from(p: Precision) -> Math {
        match p {
            Precision::Fp32 => Math::Fp32,
            Precision::Tf32 => Math::Tf32,
            // fp8 runs on no GPU yet: its convs' roof is bf16's until it does
            Precision::Bf16 | Precision::Fp8 => Math::Bf16,
        }
    }
}

impl Gpu {
    /// The compute roof (TFLOP/s) for a category under a math mode: tensor cores for convs and
    /// GEMMs when the GPU has them in that mode (V100 has no TF32/BF16: FP32 is its roof there).
    pub fn peak_tflops(&self, cat: Category, math: Math) -> f64 {
        if !cat.is_matmul() {
            return self.fp32_tflops;
        }
        match math {
            Math::Fp32 => self.fp32_tflops,
            Math::Tf32 => self.tf32_tflops.unwrap_or(self.fp32_tflops),
            Math::Bf16 => self.bf16_tflops.unwrap_or(self.fp32_tflops),
        }
    }

    /// Roofline time of `flops` FLOPs and `bytes` bytes, ns.
    pub fn roofline_ns(&self, cat: Category, math: Math, flops: f64, bytes: f64) -> f64 {
        let compute = flops / (self.peak_tflops(cat, math) * 1e12);
        let memory = bytes / (self.mem_gbps * 1e9);
        compute.max(memory) * 1e9
    }

    /// Ridge point (FLOP/byte) of a roof: intensities above it are compute-bound.
    pub fn ridge(&self, cat: Category, math: Math) -> f64 {
        self.peak_tflops(cat, math) * 1e12 / (self.mem_gbps * 1e9)
    }
}

/// Whether a number was measured on hardware or predicted by the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Provenance {
    Measured,
    Predicted,
}

/// Predicted time of one category on one GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CategoryPrediction {
    pub category: Category,
    pub flops: f64,
    pub bytes: f64,
    /// Records with a FLOP or byte count / all records of the category.
    pub counted: usize,
    pub records: usize,
    /// GPU key → predicted roofline time, ns.
    pub predicted_ns: BTreeMap<String, f64>,
    /// What the profiled run took for this category (on the device it ran on).
    pub measured_ns: f64,
}

/// Roofline predictions per category for every GPU in `gpus` (each record bounded separately,
/// then summed: a category of many small memory-bound kernels is not treated as one big one).
pub fn predict(records: &[KernelRecord], gpus: &[Gpu], math: Math) -> Vec<CategoryPrediction> {
    let mut out: Vec<CategoryPrediction> = Vec::new();
    for cat in Category::ALL {
        let rs: Vec<&KernelRecord> = records.iter().filter(|r| r.category == cat).collect();
        if rs.is_empty() {
            continue;
        }
        let counted: Vec<&&KernelRecord> = rs.iter().filter(|r| r.flops.is_some() || r.bytes.is_some()).collect();
        let mut p = CategoryPrediction {
            category: cat,
            flops: counted.iter().filter_map(|r| r.flops).sum(),
            bytes: counted.iter().filter_map(|r| r.bytes).sum(),
            counted: counted.len(),
            records: rs.len(),
            predicted_ns: BTreeMap::new(),
            measured_ns: rs.iter().map(|r| r.duration_ns as f64).sum(),
        };
        for g in gpus {
            let t: f64 =
                counted.iter().map(|r| g.roofline_ns(cat, math, r.flops.unwrap_or(0.0), r.bytes.unwrap_or(0.0))).sum();
            p.predicted_ns.insert(g.key.to_string(), t);
        }
        out.push(p);
    }
    out
}

/// The outcome of checking a roofline prediction against a measurement on the same GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Check {
    pub predicted_ns: f64,
    pub measured_ns: f64,
    /// predicted / measured: the fraction of the roofline the run achieved (≤ 1 when consistent).
    pub efficiency: f64,
    pub verdict: Verdict,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Measured time at or above the bound: consistent.
    Consistent,
    /// Measured faster than the bound (beyond `tolerance`): the FLOP/byte count or the GPU table is wrong.
    FasterThanRoofline,
    /// Nothing to compare (no counted work or no measurement).
    NotComparable,
}

/// Check a prediction against a measurement made on the GPU the prediction is for. A roofline is
/// a lower bound, so a measurement may be slower by any factor, but not faster than
/// `predicted × (1 − tolerance)` (tolerance covers clock boost and timer resolution, e.g. 0.05).
pub fn check(predicted_ns: f64, measured_ns: f64, tolerance: f64) -> Check {
    let verdict = if predicted_ns <= 0.0 || measured_ns <= 0.0 {
        Verdict::NotComparable
    } else if measured_ns < predicted_ns * (1.0 - tolerance) {
        Verdict::FasterThanRoofline
    } else {
        Verdict::Consistent
    };
    let efficiency = if measured_ns > 0.0 { predicted_ns / measured_ns } else { 0.0 };
    Check { predicted_ns, measured_ns, efficiency, verdict }
}
