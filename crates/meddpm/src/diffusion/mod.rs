//! Diffusion: the cosine schedule and its buffers, the training step (Adam, EMA, gradient
//! accumulation), and sampling: the samplers as plans of coefficients (`solvers`: ancestral
//! DDPM, DDIM, DPM-Solver++(2M), iPNDM) and the loop that runs a plan on a backend with any
//! ε-model (`sampler`). Nothing here knows how the network is computed.

pub mod sampler;
pub mod schedule;
pub mod solvers;
pub mod train;

pub use sampler::{run_plan, EpsModel, Sampler, UNetEps};
pub use schedule::Schedule;
pub use solvers::{plan, Plan, PlanStep, SamplerKind, SamplerSpec};
pub use train::{TrainConfig, Trainer};
