//! The Med-DDPM U-Net: configuration, parameter specs (PyTorch keys), and the forward/backward
//! call lists over a [`crate::Backend`].

pub mod config;
pub mod cost;
pub mod params;
pub mod unet;

pub use config::UNetConfig;
pub use params::{param_count, param_specs, ParamSpec};
pub use unet::{MemPlan, UNet};
