//! Checkpoints: meddpm's safetensors format (weights, EMA, Adam state, step, RNG position and
//! configs; atomic writes) and the import of the reference PyTorch `.pt` files.

pub mod native;
pub mod torch;

pub use native::{export_state_dict, save_trainer, write_atomic, Checkpoint};
