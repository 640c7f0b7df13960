//! Counter-based random numbers: Philox4x32-10 (Salmon et al., SC'11) with a bit-identical CUDA
//! twin, so a CPU and a GPU run draw the same timesteps and noise from one seed.
//!
//! A [`Philox`] is (seed, stream). Draw number `i` of a stream encrypts the counter
//! (i_lo, i_hi, stream_lo, stream_hi) under key (seed_lo, seed_hi). There is no hidden state:
//! callers keep an offset (saved in checkpoints), which makes resume exact. Normals use the
//! Box–Muller cosine branch computed in f64 and rounded to f32, so CPU and GPU agree.

use serde::{Deserialize, Serialize};

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// A Philox stream: key = seed, counter high half = stream id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Philox {
    pub seed: u64,
    pub stream: u64,
}

/// The Philox4x32-10 block function.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for _ in 0..10 {
        let p0 = (M0 as u64) * (c[0] as u64);
        let p1 = (M1 as u64) * (c[2] as u64);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

impl Philox {
    pub const fn new(seed: u64, stream: u64) -> Self {
        Philox { seed, stream }
    }
    /// The four 32-bit words of draw `i`.
    pub fn block(&self, i: u64) -> [u32; 4] {
        let ctr = [i as u32, (i >> 32) as u32, self.stream as u32, (self.stream >> 32) as u32];
        philox4x32_10(ctr, [self.seed as u32, (self.seed >> 32) as u32])
    }
    /// Standard normal draw `i` (Box–Muller, cosine branch, f64 math rounded to f32).
    pub fn normal(&self, i: u64) -> f32 {
        let r = self.block(i);
        let u1 = (r[0] as f64 + 1.0) * (1.0 / 4294967296.0); // (0, 1]
        let u2 = r[1] as f64 * (1.0 / 4294967296.0); // [0, 1)
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }
    /// Uniform integer in [0, n) from draw `i` (64-bit multiply-shift; bias < 2⁻³²·n).
    pub fn below(&self, i: u64, n: u32) -> u32 {
        ((self.block(i)[2] as u64 * n as u64) >> 32) as u32
    }
    /// Fill `out` with normals `offset .. offset + out.len()`.
    pub fn fill_normal(&self, offset: u64, out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate() {
            *o = self.normal(offset + i as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn philox_known_answer() {
        // Random123 known-answer vectors for philox4x32_10.
        assert_eq!(philox4x32_10([0, 0, 0, 0], [0, 0]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32_10([0xffffffff; 4], [0xffffffff; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32_10([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }
    #[test]
    fn normals_have_unit_moments() {
        let r = Philox::new(7, 3);
        let mut v = vec![0f32; 200_000];
        r.fill_normal(11, &mut v);
        let m = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(m.abs() < 0.01 && (var - 1.0).abs() < 0.02, "mean {m} var {var}");
        // streams and offsets differ
        assert_ne!(Philox::new(7, 4).normal(11), v[0]);
        assert_eq!(r.normal(12), v[1]);
        let counts = (0..10_000).fold([0u32; 5], |mut c, i| {
            c[r.below(i, 5) as usize] += 1;
            c
        });
        assert!(counts.iter().all(|&c| (1800..2200).contains(&c)), "{counts:?}");
    }
}
