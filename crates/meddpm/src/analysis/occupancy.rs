//! Theoretical occupancy of a kernel launch from what CUPTI records of it (registers per thread,
//! shared memory per block, threads per block) and the limits of the GPU's streaming
//! multiprocessor, as CUDA's occupancy calculator computes it: resident blocks per SM are the
//! smallest of the register, shared-memory, thread and block limits, and occupancy is their warps
//! over the SM's maximum. A memory-bound kernel far below full occupancy has too few loads in
//! flight: on the H200, GroupNorm backward passes at 24–33 % occupancy (121 and 80 registers a
//! thread) ran at 2.2–3.1 TB/s, and at 3.2–3.8 TB/s once their registers were cut. `meddpm
//! profile` lists this for its top kernels, so the limit shows without an Nsight Compute run.
//!
//! Limits per compute capability: CUDA C++ Programming Guide, "Technical Specifications per
//! Compute Capability" (registers per SM and their 256-register allocation unit per warp, maximum
//! warps and blocks per SM, shared memory per SM with 1 KB reserved per block from sm_80 on).

use serde::Serialize;

/// One SM's resources.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SmLimits {
    pub regs: u32,
    pub max_warps: u32,
    pub max_blocks: u32,
    /// Shared memory per SM usable by blocks, bytes.
    pub smem: u32,
    /// Shared memory the system reserves per block, bytes.
    pub smem_reserved: u32,
}

/// The SM of an architecture named like the GPU table's `arch` ("Hopper (sm_90)"), where known.
pub fn sm_limits(arch: &str) -> Option<SmLimits> {
    let sm: u32 = arch.split("sm_").nth(1)?.trim_end_matches(')').parse().ok()?;
    let kb = 1024;
    let (max_warps, max_blocks, smem, smem_reserved) = match sm {
        70 => (64, 32, 96 * kb, 0),
        80 => (64, 32, 164 * kb, kb),
        86 => (48, 16, 100 * kb, kb),
        89 => (48, 24, 100 * kb, kb),
        90 | 100 => (64, 32, 228 * kb, kb),
        _ => return None,
    };
    Some(SmLimits { regs: 65536, max_warps, max_blocks, smem, smem_reserved })
}

/// What caps the resident blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Limiter {
    Registers,
    SharedMemory,
    Threads,
    Blocks,
}

impl Limiter {
    pub fn label(self) -> &'static str {
        match self {
            Limiter::Registers => "registers",
            Limiter::SharedMemory => "shared memory",
            Limiter::Threads => "threads",
            Limiter::Blocks => "blocks per SM",
        }
    }
}

/// A launch's theoretical occupancy.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Occupancy {
    pub blocks_per_sm: u32,
    /// Resident warps over the SM's maximum, percent.
    pub pct: f64,
    pub limiter: Limiter,
}

/// Theoretical occupancy of blocks of `threads` threads using `regs` registers a thread and
/// `smem` bytes of shared memory (static + dynamic); None for an empty block or one that cannot
/// run at all (more registers, threads or shared memory than an SM has).
pub fn theoretical(l: SmLimits, regs: u32, smem: u32, threads: u32) -> Option<Occupancy> {
    if threads == 0 {
        return None;
    }
    let warps = threads.div_ceil(32);
    // registers are allocated per warp in units of 256
    let regs_per_warp = (regs.max(1) * 32).div_ceil(256) * 256;
    let by_regs = (l.regs / regs_per_warp) / warps;
    let by_smem = if smem == 0 { u32::MAX } else { l.smem / ((smem + l.smem_reserved).div_ceil(128) * 128) };
    let by_threads = l.max_warps / warps;
    let limits = [
        (by_threads, Limiter::Threads),
        (l.max_blocks, Limiter::Blocks),
        (by_regs, Limiter::Registers),
        (by_smem, Limiter::SharedMemory),
    ];
    // the first of equal limits names it: a resource only when it binds below the thread limit
    let (blocks, limiter) = limits.iter().copied().fold(limits[0], |m, x| if x.0 < m.0 { x } else { m });
    (blocks > 0).then(|| Occupancy {
        blocks_per_sm: blocks,
        pct: 100.0 * (blocks * warps) as f64 / l.max_warps as f64,
        limiter,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h200() -> SmLimits {
        sm_limits("Hopper (sm_90)").unwrap()
    }

    /// GroupNorm backward launches as Nsight Compute measured them on the H200: achieved
    /// occupancy 23.8 % at 121 registers, 32.8–33.3 % at 80, 46.2–46.5 % at 64, each a little
    /// under the theoretical value computed here.
    #[test]
    fn gn_backward_launches_on_the_h200() {
        let o = theoretical(h200(), 121, 0, 256).unwrap();
        assert_eq!((o.blocks_per_sm, o.pct, o.limiter), (2, 25.0, Limiter::Registers));
        let o = theoretical(h200(), 80, 16384, 256).unwrap();
        assert_eq!((o.blocks_per_sm, o.pct, o.limiter), (3, 37.5, Limiter::Registers));
        let o = theoretical(h200(), 64, 32768, 256).unwrap();
        assert_eq!((o.blocks_per_sm, o.pct, o.limiter), (4, 50.0, Limiter::Registers));
    }

    #[test]
    fn each_limit_can_bind() {
        // 32 registers, no shared memory: 8 blocks of 8 warps fill the 64 warps (registers would
        // allow exactly as many: the thread limit names it)
        let o = theoretical(h200(), 32, 0, 256).unwrap();
        assert_eq!((o.blocks_per_sm, o.pct, o.limiter), (8, 100.0, Limiter::Threads));
        // 40 registers: 6 blocks
        let o = theoretical(h200(), 40, 0, 256).unwrap();
        assert_eq!((o.blocks_per_sm, o.pct, o.limiter), (6, 75.0, Limiter::Registers));
        // 24 registers: registers allow 10 blocks, threads 8
        let o = theoretical(h200(), 24, 0, 256).unwrap();
        assert_eq!((o.blocks_per_sm, o.limiter), (8, Limiter::Threads));
        // 48 KB of shared memory (+ 1 KB reserved): 228 / 49 = 4 blocks
        let o = theoretical(h200(), 32, 48 * 1024, 256).unwrap();
        assert_eq!((o.blocks_per_sm, o.pct, o.limiter), (4, 50.0, Limiter::SharedMemory));
        // one-warp blocks with few registers: 32 blocks per SM at most
        let o = theoretical(h200(), 16, 0, 32).unwrap();
        assert_eq!((o.blocks_per_sm, o.pct, o.limiter), (32, 50.0, Limiter::Blocks));
        // registers round up to 8 a thread (256 a warp): 121 counts as 128
        assert_eq!(theoretical(h200(), 121, 0, 256), theoretical(h200(), 128, 0, 256));
        // more than an SM holds
        assert_eq!(theoretical(h200(), 255, 0, 1024), None);
        assert_eq!(theoretical(h200(), 32, 0, 0), None);
    }

    #[test]
    fn architectures_of_the_gpu_table() {
        for g in super::super::gpus::gpus() {
            let l = sm_limits(g.arch);
            assert!(l.is_some(), "{}: {} has no SM limits", g.key, g.arch);
        }
        assert_eq!(sm_limits("Volta (sm_70)").unwrap().smem_reserved, 0);
        assert_eq!(sm_limits("Ada Lovelace (sm_89)").unwrap().max_warps, 48);
        assert_eq!(sm_limits("no sm here"), None);
    }
}
