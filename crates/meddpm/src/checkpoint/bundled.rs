//! The bundled demo model: EMA weights of a demo-preset model (32³) trained with meddpm on the
//! GPU, compiled into the binary so that `meddpm sample` without `--checkpoint` gives a brain and
//! the demo's preview can show what a trained model makes of the same mask.
//!
//! The file is `testdata/demo/model.safetensors` (any safetensors file [`load_weights`] reads: a
//! `meddpm convert` state dict with its config, or a full meddpm checkpoint, whose EMA group is
//! used). `build.rs` embeds it only when it exists at build time; without it [`bytes`] is `None`
//! and every caller says so instead of failing to build.
//!
//! [`load_weights`]: crate::checkpoint::load_weights

use super::load::{load_weights_from_bytes, LoadHints, LoadedWeights, WeightGroup};
use crate::error::Result;
use std::path::Path;

mod generated {
    include!(concat!(env!("OUT_DIR"), "/bundled_model.rs"));
}

/// Where the bundled model lives in the repository (and how messages name it).
pub const PATH: &str = "testdata/demo/model.safetensors";

/// The embedded file's bytes, if this binary was built with one.
pub fn bytes() -> Option<&'static [u8]> {
    generated::BUNDLED
}

/// The bundled model's weights (`group`, as [`crate::checkpoint::load_weights`]), or `None` when
/// this binary has none. `hints` as for any file (e.g. another volume size).
pub fn load(group: WeightGroup, hints: &LoadHints) -> Result<Option<LoadedWeights>> {
    let Some(b) = bytes() else { return Ok(None) };
    let mut w = load_weights_from_bytes(b, Path::new(PATH), group, hints)?;
    w.source = format!("bundled demo model: {}", w.source);
    // a plain state dict, trained by `meddpm train` on the default schedule
    w.timesteps = w.timesteps.or(Some(crate::diffusion::TrainConfig::default().timesteps));
    Ok(Some(w))
}

/// One sentence for users when there is no bundled model.
pub fn absent_message() -> String {
    format!(
        "this meddpm was built without a bundled demo model ({PATH} did not exist at build time); give \
         --checkpoint FILE (a meddpm checkpoint, a safetensors state dict or a reference .pt file)"
    )
}
