//! UNet (being written).
