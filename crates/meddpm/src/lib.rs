//! meddpm: the Med-DDPM engine — model, diffusion, training, sampling, data and checkpoints —
//! over a [`backend::Backend`] trait. This crate knows nothing about CUDA and builds anywhere;
//! [`cpu::CpuBackend`] is the executable specification every GPU op is tested against.
//!
//! Modules:
//! - `shape`      Dims (N,C,D,H,W) and conv geometry
//! - `backend`    the Backend trait: every primitive the U-Net needs, forward and backward
//! - `cpu`        CpuBackend: plain loops + im2col/GEMM, rayon over the outer loop
//! - `fp8`        the FP8 spec: E4M3/E5M2 conversion, power-of-two scales, delayed scaling, which convs
//! - `rng`        Philox4x32-10 counter RNG (bit-identical CUDA twin)
//! - `model`      UNetConfig, parameter specs (PyTorch state-dict keys), UNet forward/backward
//! - `diffusion`  cosine schedule and buffers, training step, ancestral DDPM sampler
//! - `checkpoint` safetensors checkpoints (atomic writes)
//! - `dist`       data-parallel runs: launch environment, rendezvous, gradient buckets, sync trait
//! - `data`       NIfTI I/O, Med-DDPM data conventions, demo data
//! - `precision`  the default precision of a device, and the phrase that says why
//! - `run`        a training run as a folder: record, data prints, loss log and plot, safe stop
//! - `phantom`    a synthetic head phantom pair for tests
//! - `testing`    tolerance comparisons and finite-difference helpers shared by tests

pub mod analysis;
pub mod backend;
pub mod checkpoint;
pub mod cpu;
pub mod data;
pub mod diffusion;
pub mod dist;
pub mod error;
pub mod eval;
pub mod fp8;
pub mod model;
pub mod phantom;
pub mod precision;
pub mod rng;
pub mod run;
pub mod shape;
pub mod testing;

pub use backend::{Accum, Backend, DType, DeviceSel, Layout, LossKind, Precision};
pub use error::{Error, Result};
pub use precision::{PrecisionChoice, Target};
pub use shape::{ConvShape, Dims};
