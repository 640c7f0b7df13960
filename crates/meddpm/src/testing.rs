//! Test helpers (being written).
