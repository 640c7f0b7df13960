//! Synthesis-quality metrics (being written).
