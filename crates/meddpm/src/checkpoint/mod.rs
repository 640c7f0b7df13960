//! Checkpoints: meddpm's safetensors format (weights, EMA, Adam state, step, RNG position and
//! configs; atomic writes), the import of the reference PyTorch `.pt` files, and [`load_weights`],
//! which reads sampling weights from any of them.

pub mod load;
pub mod native;
pub mod torch;

pub use load::{
    init_trainer_from, init_trainer_with, load_weights, load_weights_with, LoadHints, LoadedWeights, WeightGroup,
};
pub use native::{export_state_dict, save_trainer, write_atomic, Checkpoint};
