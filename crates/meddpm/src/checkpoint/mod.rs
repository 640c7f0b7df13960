//! Checkpoints: meddpm's safetensors format (weights, EMA, Adam state, step, RNG position and
//! configs; atomic writes), the import of the reference PyTorch `.pt` files, and [`load_weights`],
//! which reads sampling weights from any of them; `bundled`: the demo model compiled into the
//! binary when `testdata/demo/model.safetensors` exists at build time.

pub mod bundled;
pub mod load;
pub mod native;
pub mod torch;

pub use load::{
    init_trainer_from, init_trainer_with, load_weights, load_weights_from_bytes, load_weights_with, LoadHints,
    LoadedWeights, WeightGroup,
};
pub use native::{export_state_dict, save_trainer, trainer_bytes, write_atomic, write_atomic_with, Checkpoint};
