//! Performance analysis (`meddpm profile`, issue 4): where a training or sampling step spends its
//! time, what the hardware counters say about the kernels, and what other GPUs would do.
//!
//! - `kernels`    per-kernel records, demangling, the kernel-name → category classifier
//! - `breakdown`  tables by category, block, phase and kernel; shares; achieved TFLOP/s and GB/s
//! - `ncu`        Nsight Compute CSV exports (raw and details pages): counters and the rule priority
//!   list; the argument lists and kernel selection of a `meddpm profile` ncu run
//! - `gpus`       NVIDIA GPUs across generations (datasheet values) and the roofline model
//! - `power`      a measurement window's SM clock, board power, energy and power-cap share (the
//!   samples come from the CUDA backend's NVML monitor)
//! - `occupancy`  theoretical occupancy of a launch (registers, shared memory, block size) and
//!   what limits it, per SM generation; the report's table for the top kernels
//! - `matrix`     the optimisation matrix (fp32/TF32 × NCDHW/NDHWC) with ratios to the baseline;
//!   `--matrix` values and the CUDA configurations' inputs
//! - `timed`      `Timed<B>`, a Backend wrapper that times and counts every call (the CPU
//!   profile path), and `NullBackend`, which only counts
//! - `profile`    one training step and one sampling step of the U-Net through `Timed`
//! - `report`     Markdown + CSV + JSON + SVG report writer and the terminal summary
//! - `torch`      import of PyTorch profiler kernel tables (the reference, category by category)
//! - `csv`        the small CSV reader/writer the others use
//! - `collect`    the report inputs that need no GPU backend: a program under Nsight Compute (the
//!   process, its limit and exports), PyTorch tables, counted presets, ncu and matrix exports
//!
//! GPU collection (CUPTI activity records, NVTX ranges, the steps under CUPTI) lives with the CUDA
//! backend; the CLI (`crates/meddpm-cli/src/profile.rs`) wires the sources together; both feed
//! [`kernels::KernelRecord`]s and ncu exports into this module.

pub mod breakdown;
pub mod collect;
pub mod csv;
pub mod gpus;
pub mod kernels;
pub mod matrix;
pub mod ncu;
pub mod occupancy;
pub mod power;
pub mod profile;
pub mod report;
pub mod timed;
pub mod torch;
