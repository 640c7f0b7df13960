//! `GpuBuf`: the CUDA backend's buffer — device memory plus its element type.
//!
//! The engine's `Backend::Buf` is one type for every precision so that the U-Net's call lists stay
//! one list; the element type travels with the buffer as a tag ([`DType`]): `alloc` gives f32,
//! `alloc_act` gives the precision's activation type (bf16 under `Precision::Bf16`). Kernels take
//! a per-call flag saying which of their pointers are bf16 ([`GpuBuf::bf`]) and compute in f32;
//! cuDNN gets matching tensor descriptors. Host data always crosses as f32: uploads into a bf16
//! buffer round to nearest even (the same rounding as `meddpm::backend::round_bf16` and the kernels'
//! `f2bf`), downloads widen exactly.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use meddpm::backend::round_bf16;
use meddpm::{DType, Layout};

/// The layout and element type of an activation as our launchers see it: what travels between
/// them in place of a `(cl: bool, bf: i32)` pair. Kernels still take both as `int` flags; a launch
/// converts with [`Mode::cl`] and [`Mode::bf_flag`] (the same 0/1 values as before).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mode {
    pub layout: Layout,
    pub dtype: DType,
}

impl Mode {
    pub(crate) fn new(layout: Layout, dtype: DType) -> Mode {
        Mode { layout, dtype }
    }

    /// From a launcher's flags: NDHWC where `cl`, bf16 where `bf` is 1 (else f32).
    pub(crate) fn from_flags(cl: bool, bf: i32) -> Mode {
        debug_assert!(bf == 0 || bf == 1, "bf16 flag {bf}");
        Mode {
            layout: if cl { Layout::Ndhwc } else { Layout::Ncdhw },
            dtype: if bf == 1 { DType::Bf16 } else { DType::F32 },
        }
    }

    /// Channels last (NDHWC): the kernels' `cl` flag.
    pub(crate) fn cl(self) -> bool {
        self.layout == Layout::Ndhwc
    }

    /// The kernels' `bf` flag: 1 where the activation is bf16, else 0.
    pub(crate) fn bf_flag(self) -> i32 {
        (self.dtype == DType::Bf16) as i32
    }
}

/// Device memory of `len` elements of type `dtype`.
pub struct GpuBuf {
    mem: CudaSlice<u8>,
    len: usize,
    dtype: DType,
}

impl GpuBuf {
    pub(crate) fn new(mem: CudaSlice<u8>, len: usize, dtype: DType) -> Self {
        debug_assert!(mem.len() >= len * dtype.bytes());
        GpuBuf { mem, len, dtype }
    }
    /// Elements (not bytes).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.bytes()
    }
    /// 1 when the buffer stores bf16 (the kernels' per-pointer dtype flag), else 0.
    pub fn bf(&self) -> i32 {
        (self.dtype == DType::Bf16) as i32
    }
    pub(crate) fn mem_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.mem
    }
}

/// Panic with a clear message unless every buffer stores f32 (ops that are f32 in every
/// precision: loss, diffusion, optimizer, linear, the attention core's f32 internals).
pub(crate) fn require_f32(what: &str, bufs: &[&GpuBuf]) {
    if let Some(b) = bufs.iter().find(|b| b.dtype() != DType::F32) {
        panic!("{what}: expects f32 buffers, got a {:?} buffer of {} elements", b.dtype(), b.len());
    }
}

/// Anything with a device address: our buffers and cudarc's slices (scratch, workspace).
pub(crate) trait DevMem {
    fn addr(&self, stream: &Arc<CudaStream>) -> u64;
}

impl DevMem for GpuBuf {
    fn addr(&self, stream: &Arc<CudaStream>) -> u64 {
        let (p, _g) = self.mem.device_ptr(stream);
        p
    }
}

impl<T: DeviceRepr> DevMem for CudaSlice<T> {
    fn addr(&self, stream: &Arc<CudaStream>) -> u64 {
        let (p, _g) = self.device_ptr(stream);
        p
    }
}

/// f32 → bf16 bits, round to nearest even.
pub(crate) fn to_bf16_bits(v: f32) -> u16 {
    (round_bf16(v).to_bits() >> 16) as u16
}

/// bf16 bits → f32 (exact).
pub(crate) fn from_bf16_bits(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn bf16_bits_round_trip_and_rounding() {
        for v in [0.0f32, -0.0, 1.0, -2.5, 3.3, 1e-30, 6.5e4, f32::INFINITY, f32::NEG_INFINITY] {
            let r = from_bf16_bits(to_bf16_bits(v));
            assert_eq!(r, round_bf16(v), "{v}");
            assert!(r == v || (r - v).abs() <= v.abs() / 256.0, "{v} -> {r}");
        }
        assert!(from_bf16_bits(to_bf16_bits(f32::NAN)).is_nan());
        // ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> 1 (even mantissa)
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6 -> 1 + 2^-6 (even)
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        // above half rounds up
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0 + 1.0 / 65536.0), 1.0 + 1.0 / 128.0);
    }
}
