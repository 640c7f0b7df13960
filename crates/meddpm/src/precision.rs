//! The precision a run uses when nobody asked for one, and the words that say why.
//!
//! The default follows the hardware: bf16 on GPUs with bf16 tensor cores (compute capability
//! 8.0 and later: A100, H100, H200, …), TF32 on older GPUs (whose tensor cores take no bf16),
//! fp32 on the CPU (the reference; its bf16 mode only emulates the GPU's rounding and is slower).
//! An explicit choice (`--precision`, Python's `precision=`) wins, and a resumed run keeps the
//! precision its record holds. Checkpoints store fp32 weights in every precision.

use crate::Precision;
use std::fmt;

/// What the default precision depends on: the CPU, or a GPU with its name and compute capability
/// (as the driver reports them; see `meddpm_cuda::gpu_identity`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Cpu,
    Gpu { name: String, cc: (u32, u32) },
}

/// The first compute capability whose tensor cores multiply bf16 (Ampere).
pub const BF16_TENSOR_CORES: (u32, u32) = (8, 0);

impl Precision {
    /// The default precision on `t`: bf16 from sm_80, TF32 before it, fp32 on the CPU.
    pub fn default_for(t: &Target) -> Precision {
        match t {
            Target::Cpu => Precision::Fp32,
            Target::Gpu { cc, .. } if *cc >= BF16_TENSOR_CORES => Precision::Bf16,
            Target::Gpu { .. } => Precision::Tf32,
        }
    }
}

/// Why a run uses its precision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    /// Asked for (a flag or an argument, named here: `--precision`, `precision=`).
    Asked(&'static str),
    /// A resumed run keeps its recorded precision.
    Recorded,
    /// Nobody asked: the default of this target.
    Default(Target),
}

/// A precision with the reason it was chosen; `Display` is the phrase first lines and `doctor`
/// print, e.g. "precision bf16 (default on NVIDIA H100 (sm_90): bf16 tensor cores)".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrecisionChoice {
    pub precision: Precision,
    pub why: Why,
}

impl PrecisionChoice {
    /// The choice for a run on `target`: what was `asked` (through the flag or argument `by`),
    /// else what a resumed run `recorded`, else the target's default.
    pub fn settle(
        asked: Option<Precision>,
        by: &'static str,
        recorded: Option<Precision>,
        target: &Target,
    ) -> PrecisionChoice {
        match (asked, recorded) {
            (Some(p), _) => PrecisionChoice { precision: p, why: Why::Asked(by) },
            (None, Some(p)) => PrecisionChoice { precision: p, why: Why::Recorded },
            (None, None) => {
                PrecisionChoice { precision: Precision::default_for(target), why: Why::Default(target.clone()) }
            }
        }
    }
}

impl fmt::Display for PrecisionChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = self.precision.name();
        match &self.why {
            Why::Asked(by) => write!(f, "precision {p} (asked: {by})"),
            Why::Recorded => write!(f, "precision {p} (the resumed run's own)"),
            Why::Default(Target::Cpu) => {
                write!(f, "precision {p} (default on the CPU: the fp32 reference; bf16 there only emulates a GPU)")
            }
            Why::Default(Target::Gpu { name, cc }) => {
                let why = if *cc >= BF16_TENSOR_CORES {
                    "bf16 tensor cores"
                } else {
                    "no bf16 tensor cores before sm_80, TF32 ones"
                };
                write!(f, "precision {p} (default on {name} (sm_{}{}): {why})", cc.0, cc.1)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(cc: (u32, u32)) -> Target {
        Target::Gpu { name: "GPU".into(), cc }
    }

    #[test]
    fn default_follows_the_device() {
        assert_eq!(Precision::default_for(&Target::Cpu), Precision::Fp32);
        assert_eq!(Precision::default_for(&gpu((7, 0))), Precision::Tf32);
        assert_eq!(Precision::default_for(&gpu((7, 5))), Precision::Tf32);
        assert_eq!(Precision::default_for(&gpu((8, 0))), Precision::Bf16);
        assert_eq!(Precision::default_for(&gpu((8, 6))), Precision::Bf16);
        assert_eq!(Precision::default_for(&gpu((9, 0))), Precision::Bf16);
        assert_eq!(Precision::default_for(&gpu((10, 0))), Precision::Bf16);
    }

    #[test]
    fn asked_beats_recorded_beats_default() {
        let t = gpu((9, 0));
        let c = PrecisionChoice::settle(Some(Precision::Fp32), "--precision", Some(Precision::Tf32), &t);
        assert_eq!((c.precision, c.why), (Precision::Fp32, Why::Asked("--precision")));
        let c = PrecisionChoice::settle(None, "--precision", Some(Precision::Tf32), &t);
        assert_eq!((c.precision, c.why), (Precision::Tf32, Why::Recorded));
        let c = PrecisionChoice::settle(None, "--precision", None, &t);
        assert_eq!(c.precision, Precision::Bf16);
    }

    #[test]
    fn the_phrase_says_which_and_why() {
        let s = |a, r, t: &Target| PrecisionChoice::settle(a, "--precision", r, t).to_string();
        assert_eq!(
            s(None, None, &Target::Cpu),
            "precision fp32 (default on the CPU: the fp32 reference; bf16 there only emulates a GPU)"
        );
        let h100 = Target::Gpu { name: "NVIDIA H100".into(), cc: (9, 0) };
        assert_eq!(s(None, None, &h100), "precision bf16 (default on NVIDIA H100 (sm_90): bf16 tensor cores)");
        let v100 = Target::Gpu { name: "Tesla V100".into(), cc: (7, 0) };
        assert_eq!(
            s(None, None, &v100),
            "precision tf32 (default on Tesla V100 (sm_70): no bf16 tensor cores before sm_80, TF32 ones)"
        );
        assert_eq!(s(Some(Precision::Bf16), None, &Target::Cpu), "precision bf16 (asked: --precision)");
        assert_eq!(s(None, Some(Precision::Tf32), &h100), "precision tf32 (the resumed run's own)");
    }
}
