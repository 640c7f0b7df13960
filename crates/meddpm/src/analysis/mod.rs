//! Performance analysis (`meddpm profile`, issue 4): where a training or sampling step spends its
//! time, what the hardware counters say about the kernels, and what other GPUs would do.
//!
//! - `kernels`    per-kernel records, demangling, the kernel-name → category classifier
//! - `breakdown`  tables by category, block, phase and kernel; shares; achieved TFLOP/s and GB/s
//! - `ncu`        Nsight Compute CSV exports (raw and details pages): counters and the rule priority list
//! - `gpus`       NVIDIA GPUs across generations (datasheet values) and the roofline model
//! - `matrix`     the optimisation matrix (fp32/TF32 × NCDHW/NDHWC) with ratios to the baseline
//! - `timed`      `Timed<B>`, a Backend wrapper that times and counts every call (the CPU
//!   profile path), and `NullBackend`, which only counts
//! - `report`     Markdown + CSV + JSON + SVG report writer and the terminal summary
//! - `torch`      import of PyTorch profiler kernel tables (the reference, category by category)
//! - `csv`        the small CSV reader/writer the others use
//!
//! GPU collection (CUPTI activity records, NVTX ranges, re-running under ncu) lives with the CUDA
//! backend and feeds [`kernels::KernelRecord`]s and ncu exports into this module.

pub mod breakdown;
pub mod csv;
pub mod gpus;
pub mod kernels;
pub mod matrix;
pub mod ncu;
pub mod report;
pub mod timed;
pub mod torch;
