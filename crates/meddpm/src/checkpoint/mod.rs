//! (being written)

pub mod torch;
