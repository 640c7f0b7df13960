//! FP8 as meddpm uses it on Hopper: the spec the CPU emulation (`CpuBackend::fp8`) runs and every
//! fp8 GPU kernel is tested against.
//!
//! - **Formats.** E4M3 (bias 7, max 448, no infinity, NaN = S.1111.111) for activations and
//!   weights; E5M2 (bias 15, max 57344, IEEE-like infinities and NaNs) for gradients.
//! - **Conversion** ([`Fp8Format::encode`]) is bit for bit CUDA's `__nv_cvt_float_to_fp8(x,
//!   __NV_SATFINITE, ·)` (the `cvt.rn.satfinite.{e4m3,e5m2}x2.f32` instruction): round to nearest,
//!   ties to even; a magnitude beyond the largest finite value (infinity included) saturates to it
//!   with its sign; below half the smallest subnormal it flushes to a signed zero; NaN becomes the
//!   canonical positive NaN 0x7F (CUDA's host path canonicalises NaN first; the device's NaN sign
//!   is not part of the contract, so kernels are checked with "NaN is NaN").
//! - **Scales** are powers of two, so scaling and unscaling are exact and the only rounding is the
//!   conversion: per tensor for activations ([`pow2_scale`] of the tensor's amax), per output
//!   channel for conv weights ([`channel_scales`]). A scale maps the amax to at most the format's
//!   largest finite value.
//! - **Delayed scaling** ([`AmaxHistory`]) as NVIDIA Transformer Engine does it: a step quantises
//!   with the scale from the amaxes of earlier steps (the "max" of a rolling window), then records
//!   its own amax; values beyond the scale's range saturate.
//! - **Which convs run in fp8** ([`conv_runs_fp8`]): the wide 3×3×3 stride-1 ones (≥ 16 channels
//!   in and out). The few-channel first and last convs, the 1×1 skips, the stride-2 downsamplers
//!   and attention stay bf16; so do GroupNorm, softmax, the time embedding, the loss, the master
//!   weights and the optimizer.
//! - **On the GPU** ([`gpu_support`]): `--precision fp8` needs sm_90 (FP8 `wgmma`), and stays an
//!   error there until the fp8 conv kernel has passed its parity test against this spec.

use crate::shape::ConvShape;

/// An 8-bit floating-point format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 4 exponent bits (bias 7), 3 mantissa bits; max 448; NaN = 0x7F/0xFF; no infinity.
    E4M3,
    /// 5 exponent bits (bias 15), 2 mantissa bits; max 57344; ±infinity 0x7C/0xFC.
    E5M2,
}

/// The canonical NaN every NaN input converts to (both formats).
pub const NAN_CODE: u8 = 0x7F;

impl Fp8Format {
    /// Mantissa bits.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8Format::E4M3 => 3,
            Fp8Format::E5M2 => 2,
        }
    }
    /// Exponent bias.
    pub const fn bias(self) -> i32 {
        match self {
            Fp8Format::E4M3 => 7,
            Fp8Format::E5M2 => 15,
        }
    }
    /// The code of the largest finite magnitude (sign bit clear).
    pub const fn max_code(self) -> u8 {
        match self {
            Fp8Format::E4M3 => 0x7E,
            Fp8Format::E5M2 => 0x7B,
        }
    }
    /// The largest finite value.
    pub const fn max_finite(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }
    /// The value of a code.
    pub fn decode(self, code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let mag = code & 0x7F;
        let mb = self.mantissa_bits();
        let (field, man) = ((mag >> mb) as i32, (mag & ((1 << mb) - 1)) as i32);
        match self {
            Fp8Format::E4M3 if mag == 0x7F => return f32::NAN,
            Fp8Format::E5M2 if field == 31 => return if man == 0 { sign * f32::INFINITY } else { f32::NAN },
            _ => {}
        }
        // subnormal: man · 2^(1 − bias − mb); normal: (2^mb + man) · 2^(field − bias − mb)
        let (m, e) = if field == 0 { (man, 1 - self.bias()) } else { ((1 << mb) + man, field - self.bias()) };
        sign * m as f32 * 2f32.powi(e - mb as i32)
    }
    /// `x` converted as `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ·)` does (see the module docs).
    pub fn encode(self, x: f32) -> u8 {
        if x.is_nan() {
            return NAN_CODE;
        }
        let sign = ((x.to_bits() >> 31) as u8) << 7;
        let a = x.abs();
        if a > self.max_finite() {
            return sign | self.max_code();
        }
        let mb = self.mantissa_bits() as i32;
        // the fp8 exponent of `a`'s binade, no lower than the smallest normal's (subnormals share
        // its quantum); f32 subnormals (field 0) fall far below it
        let e = (((a.to_bits() >> 23) & 0xFF) as i32 - 127).max(1 - self.bias());
        // `a` in units of the binade's quantum 2^(e − mb): exact (a power-of-two scaling), then
        // rounded to an integer, ties to even; a carry into the next binade stays correct below
        let m = (a * 2f32.powi(mb - e)).round_ties_even() as i32;
        // code = (exponent field − 1) << mb + m, for subnormals (field 0, m < 2^mb) and normals
        let code = ((e + self.bias() - 1) << mb) + m;
        sign | code as u8
    }
    /// `x` rounded to this format (encode, then decode).
    pub fn round(self, x: f32) -> f32 {
        self.decode(self.encode(x))
    }
}

/// The largest power of two `s` with `amax · s ≤ fmt.max_finite()`; 1 for an amax that is zero
/// or not finite (nothing to scale). Kept within 2^±100 so it and its inverse are normal f32.
pub fn pow2_scale(amax: f32, fmt: Fp8Format) -> f32 {
    if !(amax.is_finite() && amax > 0.0) {
        return 1.0;
    }
    let max = fmt.max_finite() as f64;
    let mut k = (max / amax as f64).log2().floor() as i32;
    // log2's rounding may be off by one at exact powers of two: settle it exactly
    while (amax as f64) * 2f64.powi(k) > max {
        k -= 1;
    }
    while (amax as f64) * 2f64.powi(k + 1) <= max {
        k += 1;
    }
    2f32.powi(k.clamp(-100, 100))
}

/// The largest finite magnitude in `x` (0 for an empty or all-NaN slice).
pub fn amax(x: &[f32]) -> f32 {
    x.iter().filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()))
}

/// Per output channel scales of a conv weight in PyTorch's layout (`cout` rows of equal length).
pub fn channel_scales(w: &[f32], cout: usize, fmt: Fp8Format) -> Vec<f32> {
    assert!(cout > 0 && w.len().is_multiple_of(cout), "fp8 channel_scales: {} weights for {cout} channels", w.len());
    w.chunks(w.len() / cout).map(|row| pow2_scale(amax(row), fmt)).collect()
}

/// `x` quantised with `scale` and brought back: round(x · s) / s, exact but for the rounding.
pub fn quantize(x: f32, scale: f32, fmt: Fp8Format) -> f32 {
    fmt.round(x * scale) / scale
}

/// `src` quantised per tensor (its own amax's scale) into `dst`; returns the scale.
pub fn quantize_tensor_into(dst: &mut Vec<f32>, src: &[f32], fmt: Fp8Format) -> f32 {
    let s = pow2_scale(amax(src), fmt);
    dst.clear();
    dst.extend(src.iter().map(|&v| quantize(v, s, fmt)));
    s
}

/// A conv weight (PyTorch layout, `cout` rows) quantised per output channel into `dst`.
pub fn quantize_channels_into(dst: &mut Vec<f32>, w: &[f32], cout: usize, fmt: Fp8Format) {
    let scales = channel_scales(w, cout, fmt);
    dst.clear();
    let row = w.len() / cout;
    dst.extend(w.iter().enumerate().map(|(i, &v)| quantize(v, scales[i / row], fmt)));
}

/// Delayed scaling: a rolling window of the last `len` amaxes of one tensor (Transformer Engine's
/// `amax_history`, "max" algorithm). A step quantises with [`AmaxHistory::scale`] (from the
/// earlier steps), then [`AmaxHistory::record`]s its own amax. `margin` lowers the scale by 2^margin
/// (headroom for growth between steps).
#[derive(Clone, Debug, PartialEq)]
pub struct AmaxHistory {
    fmt: Fp8Format,
    hist: Vec<f32>,
    next: usize,
    filled: usize,
    margin: i32,
}

impl AmaxHistory {
    /// An empty history of `len` ≥ 1 steps.
    pub fn new(fmt: Fp8Format, len: usize, margin: i32) -> Self {
        assert!(len >= 1, "fp8 AmaxHistory: a history of at least one step");
        AmaxHistory { fmt, hist: vec![0.0; len], next: 0, filled: 0, margin }
    }
    /// The window's largest amax; `None` before the first record.
    pub fn amax(&self) -> Option<f32> {
        (self.filled > 0).then(|| self.hist[..self.filled].iter().fold(0f32, |m, &v| m.max(v)))
    }
    /// The scale for the next step: [`pow2_scale`] of the window's amax, lowered by the margin;
    /// before the first record, `current`'s (the step's own amax: scaling just in time).
    pub fn scale(&self, current: f32) -> f32 {
        let s = pow2_scale(self.amax().unwrap_or(current), self.fmt);
        (s * 2f32.powi(-self.margin)).clamp(2f32.powi(-100), 2f32.powi(100))
    }
    /// Record a step's amax, replacing the oldest once the window is full. A non-finite amax
    /// (a diverged step, which the caller skips) is not recorded.
    pub fn record(&mut self, amax: f32) {
        if !amax.is_finite() {
            return;
        }
        self.hist[self.next] = amax.abs();
        self.next = (self.next + 1) % self.hist.len();
        self.filled = (self.filled + 1).min(self.hist.len());
    }
}

/// Whether a conv runs in fp8 under `Precision::Fp8`: 3×3×3, stride 1, at least 16 channels in
/// and out (the wide convs the wgmma kernels take). Every other conv runs as in bf16.
pub fn conv_runs_fp8(cs: &ConvShape) -> bool {
    cs.k == 3 && cs.stride == 1 && cs.x.c >= MIN_CHANNELS && cs.cout >= MIN_CHANNELS
}

/// The fewest input and output channels of a conv that runs in fp8.
pub const MIN_CHANNELS: usize = 16;

/// Whether the fp8 conv kernel has passed its GPU parity test against this spec. Until it has,
/// `--precision fp8` is refused on every GPU.
pub const GPU_KERNEL_VERIFIED: bool = false;

/// Whether `--precision fp8` can run on CUDA device `ordinal` of compute capability `cc`: Ok, or
/// the message that says why not and what to use instead.
pub fn gpu_support(ordinal: usize, cc: (i32, i32)) -> Result<(), String> {
    if cc.0 != 9 {
        return Err(format!(
            "--precision fp8 needs an sm_90 (Hopper) GPU, whose FP8 wgmma it runs on; device cuda:{ordinal} is \
             sm_{}{}: use --precision bf16",
            cc.0, cc.1
        ));
    }
    if !GPU_KERNEL_VERIFIED {
        return Err(format!(
            "--precision fp8 is not available on device cuda:{ordinal} (sm_{}{}) yet: its fp8 conv kernel has not \
             passed its GPU parity test; use --precision bf16 (the fp8 CPU emulation runs in eval-configs' \
             cpu-fp8 row)",
            cc.0, cc.1
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::Dims;

    const FORMATS: [Fp8Format; 2] = [Fp8Format::E4M3, Fp8Format::E5M2];

    /// The independent reference: the nearest finite code to `x` found by searching the table of
    /// all codes (from `decode`, itself checked against known values below), ties to the even
    /// code; NaN → the canonical NaN. Saturation and flushing to zero fall out of the search.
    fn reference(fmt: Fp8Format, x: f32) -> u8 {
        if x.is_nan() {
            return NAN_CODE;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        // beyond twice the largest value the largest is the nearest; clamping there keeps the
        // differences below exact in f64 (at 1e30 they would round to equal)
        let a = (x as f64).abs().min(2.0 * fmt.max_finite() as f64);
        let mut best = 0u8;
        let mut best_d = f64::INFINITY;
        for (c, &v) in table(fmt).iter().enumerate() {
            let c = c as u8;
            let d = (v - a).abs();
            if d < best_d || (d == best_d && c.is_multiple_of(2)) {
                best = c;
                best_d = d;
            }
        }
        sign | best
    }

    /// The values of the codes 0 ..= max_code, from `decode`.
    fn table(fmt: Fp8Format) -> &'static [f64] {
        static T: std::sync::OnceLock<[Vec<f64>; 2]> = std::sync::OnceLock::new();
        let t = T.get_or_init(|| FORMATS.map(|f| (0..=f.max_code()).map(|c| f.decode(c) as f64).collect()));
        &t[(fmt == Fp8Format::E5M2) as usize]
    }

    /// Encode agrees with the reference on `x` (codes compared as bits).
    fn check(fmt: Fp8Format, x: f32) {
        let (got, want) = (fmt.encode(x), reference(fmt, x));
        assert_eq!(got, want, "{fmt:?} encode({x:e} = {:#010x}): {got:#04x}, want {want:#04x}", x.to_bits());
    }

    /// The values of the non-negative finite codes, in code order.
    fn finite_values(fmt: Fp8Format) -> Vec<f32> {
        (0..=fmt.max_code()).map(|c| fmt.decode(c)).collect()
    }

    #[test]
    fn decode_matches_the_formats_definitions() {
        let e4 = Fp8Format::E4M3;
        assert_eq!(e4.decode(0x00), 0.0);
        assert!(e4.decode(0x80).is_sign_negative() && e4.decode(0x80) == 0.0);
        assert_eq!(e4.decode(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4.decode(0x07), 7.0 * 2f32.powi(-9)); // largest subnormal
        assert_eq!(e4.decode(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(e4.decode(0x38), 1.0);
        assert_eq!(e4.decode(0x3C), 1.5);
        assert_eq!(e4.decode(0x7E), 448.0);
        assert_eq!(e4.decode(0xFE), -448.0);
        assert_eq!(e4.decode(0x77), 240.0); // 1.875 · 2^7: S.1110.111 is finite in E4M3
        assert!(e4.decode(0x7F).is_nan() && e4.decode(0xFF).is_nan());
        let e5 = Fp8Format::E5M2;
        assert_eq!(e5.decode(0x01), 2f32.powi(-16));
        assert_eq!(e5.decode(0x04), 2f32.powi(-14));
        assert_eq!(e5.decode(0x3C), 1.0);
        assert_eq!(e5.decode(0x7B), 57344.0);
        assert_eq!(e5.decode(0x7C), f32::INFINITY);
        assert_eq!(e5.decode(0xFC), f32::NEG_INFINITY);
        assert!((0x7D..=0x7F).all(|c| e5.decode(c).is_nan()));
        for fmt in FORMATS {
            assert_eq!(fmt.decode(fmt.max_code()), fmt.max_finite());
            let v = finite_values(fmt);
            assert!(v.windows(2).all(|w| w[0] < w[1]), "{fmt:?}: codes in value order");
        }
    }

    #[test]
    fn every_code_round_trips() {
        for fmt in FORMATS {
            for c in 0..=255u8 {
                let v = fmt.decode(c);
                if v.is_nan() {
                    assert_eq!(fmt.encode(v), NAN_CODE);
                } else if v.is_infinite() {
                    // E5M2's infinities saturate
                    assert_eq!(fmt.encode(v), (c & 0x80) | fmt.max_code());
                } else {
                    assert_eq!(fmt.encode(v), c, "{fmt:?} code {c:#04x} = {v:e}");
                    check(fmt, v);
                }
            }
        }
    }

    /// Every midpoint between neighbouring codes (ties: to the even code), its neighbours one f32
    /// ulp either side (to the nearer code), and the same mirrored to negative values.
    #[test]
    fn every_midpoint_rounds_to_even_and_its_neighbours_to_the_nearer() {
        for fmt in FORMATS {
            let v = finite_values(fmt);
            for (i, w) in v.windows(2).enumerate() {
                let mid = ((w[0] as f64 + w[1] as f64) / 2.0) as f32;
                assert_eq!(mid as f64, (w[0] as f64 + w[1] as f64) / 2.0, "midpoints are f32");
                let even = (if i % 2 == 0 { i } else { i + 1 }) as u8;
                assert_eq!(fmt.encode(mid), even, "{fmt:?}: tie {mid:e} between codes {i} and {}", i + 1);
                assert_eq!(fmt.encode(-mid), 0x80 | even);
                assert_eq!(fmt.encode(mid.next_down()), i as u8);
                assert_eq!(fmt.encode(mid.next_up()), i as u8 + 1);
                for x in [mid, mid.next_down(), mid.next_up()] {
                    check(fmt, x);
                    check(fmt, -x);
                }
            }
        }
    }

    /// Every f32 binade that reaches the formats (and a few beyond), each with every 12-bit
    /// mantissa prefix and a low-bit pattern: all roundings of normals, subnormals and flushes.
    #[test]
    fn each_binade_matches_the_table_search() {
        for fmt in FORMATS {
            for exp in (127 - 30)..=(127 + 20) {
                for prefix in 0..4096u32 {
                    for low in [0u32, 1, 0x400, 0x7FF] {
                        let bits = (exp << 23) | (prefix << 11) | low;
                        check(fmt, f32::from_bits(bits));
                        check(fmt, -f32::from_bits(bits));
                    }
                }
            }
        }
    }

    #[test]
    fn saturation_infinities_nan_and_flush_to_zero() {
        for fmt in FORMATS {
            let (max, mc) = (fmt.max_finite(), fmt.max_code());
            for x in [max.next_up(), max * 1.0625, max * 1.125, max * 2.0, 1e30, f32::MAX, f32::INFINITY] {
                assert_eq!(fmt.encode(x), mc, "{fmt:?}: {x:e} saturates");
                assert_eq!(fmt.encode(-x), 0x80 | mc);
                check(fmt, x);
            }
            for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001), f32::from_bits(0xFFC0_1234)] {
                assert_eq!(fmt.encode(nan), NAN_CODE, "{fmt:?}: NaN {:#x}", nan.to_bits());
            }
            let half_min = fmt.decode(1) / 2.0;
            for x in [half_min, half_min.next_down(), 1e-30, f32::from_bits(1), 0.0] {
                assert_eq!(fmt.encode(x), 0x00, "{fmt:?}: {x:e} flushes to +0");
                assert_eq!(fmt.encode(-x), 0x80, "{fmt:?}: −{x:e} flushes to −0");
            }
            assert_eq!(fmt.encode(half_min.next_up()), 0x01);
        }
        // E4M3's largest value's upper neighbour (464) is a tie that the even code 448 wins
        assert_eq!(Fp8Format::E4M3.encode(464.0), 0x7E);
        // E5M2's is 61440, which round-to-even would carry into infinity: it saturates
        assert_eq!(Fp8Format::E5M2.encode(61440.0), 0x7B);
    }

    #[test]
    fn subnormals_match_the_table_search() {
        for fmt in FORMATS {
            let min_normal = fmt.decode(1 << fmt.mantissa_bits());
            // 4096 evenly spaced values over (0, 2 · min normal) and f32 subnormals
            for i in 0..4096 {
                let x = min_normal * 2.0 * i as f32 / 4096.0;
                check(fmt, x);
                check(fmt, -x);
            }
            for bits in [1u32, 2, 0x40_0000, 0x7F_FFFF] {
                check(fmt, f32::from_bits(bits));
            }
        }
    }

    #[test]
    fn random_bits_match_the_table_search() {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..400_000 {
            // splitmix64
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let (a, b) = (f32::from_bits(z as u32), f32::from_bits((z >> 32) as u32));
            // the second draw in the formats' range: random sign, exponent 2^-20 … 2^17
            let b = f32::from_bits((b.to_bits() & 0x807F_FFFF) | ((107 + (z >> 58) as u32 % 38) << 23));
            for fmt in FORMATS {
                check(fmt, a);
                check(fmt, b);
            }
        }
    }

    /// Every one of the 2³² f32 values (a few minutes in release): run by hand.
    #[test]
    #[ignore = "exhaustive over all 2^32 f32: run by hand (cargo test --release -p meddpm --lib fp8 -- --ignored)"]
    fn all_f32_match_the_table_search() {
        use rayon::prelude::*;
        (0..=u16::MAX).into_par_iter().for_each(|hi| {
            for lo in 0..=u16::MAX {
                let x = f32::from_bits(((hi as u32) << 16) | lo as u32);
                for fmt in FORMATS {
                    let (got, want) = (fmt.encode(x), reference_fast(fmt, x));
                    assert_eq!(got, want, "{fmt:?} {:#010x}", x.to_bits());
                }
            }
        });
    }

    /// [`reference`] by binary search over the sorted table (for the exhaustive test).
    fn reference_fast(fmt: Fp8Format, x: f32) -> u8 {
        if x.is_nan() {
            return NAN_CODE;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = x.abs() as f64;
        let v = table(fmt);
        let i = v.partition_point(|&t| t < a);
        if i == 0 {
            return sign;
        }
        if i == v.len() {
            return sign | fmt.max_code();
        }
        let (dl, dh) = (a - v[i - 1], v[i] - a);
        let c = if dl < dh || (dl == dh && (i - 1) % 2 == 0) { i - 1 } else { i };
        sign | c as u8
    }

    #[test]
    fn scales_are_the_largest_powers_of_two_that_fit() {
        for fmt in FORMATS {
            let max = fmt.max_finite();
            for amax in [1e-20f32, 1e-3, 0.3, 1.0, 3.5, max / 2.0, max, max.next_up(), max * 3.0, 1e30] {
                let s = pow2_scale(amax, fmt);
                assert_eq!(s.to_bits() & 0x7F_FFFF, 0, "{fmt:?} amax {amax:e}: scale {s:e} is a power of two");
                assert!(amax * s <= max, "{fmt:?} amax {amax:e}: scaled to {}", amax * s);
                assert!(amax * s * 2.0 > max, "{fmt:?} amax {amax:e}: scale {s:e} is not the largest");
            }
            for amax in [0.0, f32::NAN, f32::INFINITY] {
                assert_eq!(pow2_scale(amax, fmt), 1.0);
            }
            assert_eq!(pow2_scale(max, fmt), 1.0);
        }
        // per output channel: each row gets its own
        let w = [1.0, -2.0, 0.5, 100.0, 3.0, -0.001];
        assert_eq!(channel_scales(&w, 2, Fp8Format::E4M3), vec![128.0, 4.0]);
        assert_eq!(channel_scales(&w, 3, Fp8Format::E4M3), vec![128.0, 4.0, 128.0]);
        assert_eq!(amax(&[f32::NAN, -3.0, f32::INFINITY, 2.0]), 3.0);
    }

    #[test]
    fn quantisation_is_exact_but_for_the_rounding_and_never_overflows() {
        let fmt = Fp8Format::E4M3;
        let src: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 7.3e-3).collect();
        let mut q = Vec::new();
        let s = quantize_tensor_into(&mut q, &src, fmt);
        assert_eq!(s, pow2_scale(amax(&src), fmt));
        for (&x, &y) in src.iter().zip(&q) {
            // y · s is a code's value; y is the nearest within half a code step of x · s
            assert_eq!(fmt.round(y * s), y * s);
            assert_eq!(y * s, fmt.round(x * s), "{x:e}");
            assert!((y - x).abs() <= x.abs() / 16.0 + 2f32.powi(-10) / s);
        }
        // the amax itself lands within [max/2, max]: the scaled tensor uses the top binade
        let top = q.iter().fold(0f32, |m, v| m.max(v.abs())) * s;
        assert!((fmt.max_finite() / 2.0..=fmt.max_finite()).contains(&top), "{top}");
        // rows of amax 2 and 96: scales 128 and 4 (96 · 4 = 384 is a code)
        let w = [1.0, -2.0, 0.3, 96.0, 3.0, -0.001];
        let mut wq = Vec::new();
        quantize_channels_into(&mut wq, &w, 2, fmt);
        assert_eq!(wq[..3], [1.0, -2.0, quantize(0.3, 128.0, fmt)]);
        assert_eq!(wq[3..5], [96.0, 3.0]);
        assert_eq!(wq[5], quantize(-0.001, 4.0, fmt));
        assert_ne!(wq[2], 0.3);
    }

    #[test]
    fn delayed_scaling_uses_the_earlier_steps_window() {
        let fmt = Fp8Format::E4M3;
        let mut h = AmaxHistory::new(fmt, 3, 0);
        // before any record: the step's own amax
        assert_eq!(h.amax(), None);
        assert_eq!(h.scale(3.0), pow2_scale(3.0, fmt));
        h.record(3.0);
        // the window's max, whatever this step's amax is
        assert_eq!(h.scale(100.0), pow2_scale(3.0, fmt));
        h.record(10.0);
        h.record(1.0);
        assert_eq!(h.amax(), Some(10.0));
        h.record(f32::NAN); // a diverged step is not recorded
        assert_eq!(h.amax(), Some(10.0));
        h.record(2.0); // 3 leaves
        assert_eq!(h.amax(), Some(10.0));
        h.record(2.0); // 10 leaves
        assert_eq!(h.amax(), Some(2.0));
        assert_eq!(h.scale(0.0), pow2_scale(2.0, fmt));
        // a margin of 1 halves the scale
        let mut m = AmaxHistory::new(fmt, 2, 1);
        m.record(2.0);
        assert_eq!(m.scale(0.0), pow2_scale(2.0, fmt) / 2.0);
        // a value above the delayed scale's range saturates instead of overflowing
        let s = h.scale(0.0);
        assert_eq!(quantize(1e4, s, fmt), fmt.max_finite() / s);
    }

    #[test]
    fn only_wide_3x3x3_stride_1_convs_run_in_fp8() {
        let x = |c| Dims::new(1, c, 8, 8, 8);
        assert!(conv_runs_fp8(&ConvShape::new(x(16), 16, 3, 1)));
        assert!(conv_runs_fp8(&ConvShape::new(x(64), 128, 3, 1)));
        assert!(!conv_runs_fp8(&ConvShape::new(x(3), 64, 3, 1)), "the first conv");
        assert!(!conv_runs_fp8(&ConvShape::new(x(64), 1, 3, 1)), "the last conv");
        assert!(!conv_runs_fp8(&ConvShape::new(x(15), 64, 3, 1)));
        assert!(!conv_runs_fp8(&ConvShape::new(x(64), 15, 3, 1)));
        assert!(!conv_runs_fp8(&ConvShape::new(x(64), 64, 1, 1)), "a 1×1 skip");
        assert!(!conv_runs_fp8(&ConvShape::new(x(64), 64, 3, 2)), "a downsampler");
    }

    #[test]
    fn gpus_refuse_fp8_with_a_reason() {
        let e = gpu_support(1, (8, 9)).unwrap_err();
        assert!(e.contains("--precision fp8") && e.contains("sm_90") && e.contains("cuda:1") && e.contains("sm_89"));
        let e = gpu_support(0, (10, 0)).unwrap_err();
        assert!(e.contains("sm_100"), "{e}");
        // until the kernel has passed its parity test, Hopper too
        let e = gpu_support(0, (9, 0)).unwrap_err();
        assert!(e.contains("parity test") && e.contains("bf16"), "{e}");
    }
}
