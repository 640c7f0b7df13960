//! Diffusion: the cosine schedule and its buffers, the training step (Adam, EMA, gradient
//! accumulation), and the ancestral DDPM sampler. Nothing here knows how the network is computed.

pub mod ddpm;
pub mod schedule;
pub mod train;

pub use ddpm::Sampler;
pub use schedule::Schedule;
pub use train::{TrainConfig, Trainer};
