//! CpuBackend: the executable specification (placeholder until the CPU primitives land).
pub struct CpuBackend;
