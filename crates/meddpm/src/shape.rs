//! Shapes: the logical 5-D activation shape (N, C, D, H, W) and convolution geometry.
//!
//! Every activation in the engine is addressed by a logical [`Dims`]; memory layout (NCDHW or
//! NDHWC) is decided by the backend. [`ConvShape`] carries everything a 3-D convolution needs:
//! Med-DDPM uses only cubic kernels k ∈ {1, 3} with padding (k−1)/2 and stride 1 or 2.

use serde::{Deserialize, Serialize};

/// Logical activation shape (N, C, D, H, W).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Dims {
    pub n: usize,
    pub c: usize,
    pub d: usize,
    pub h: usize,
    pub w: usize,
}

impl Dims {
    pub const fn new(n: usize, c: usize, d: usize, h: usize, w: usize) -> Self {
        Dims { n, c, d, h, w }
    }
    /// Voxels per channel, S = D·H·W.
    pub const fn s(&self) -> usize {
        self.d * self.h * self.w
    }
    pub const fn numel(&self) -> usize {
        self.n * self.c * self.s()
    }
    /// Same spatial size and batch, other channel count.
    pub const fn with_c(&self, c: usize) -> Self {
        Dims { c, ..*self }
    }
    /// Spatial size doubled in D, H, W (trilinear upsampling).
    pub const fn up2(&self) -> Self {
        Dims { d: self.d * 2, h: self.h * 2, w: self.w * 2, ..*self }
    }
}

impl std::fmt::Display for Dims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}x{}x{}x{}", self.n, self.c, self.d, self.h, self.w)
    }
}

/// Geometry of one 3-D convolution: input shape, output channels, cubic kernel size k ∈ {1, 3},
/// stride ∈ {1, 2}, padding (k−1)/2 in every dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ConvShape {
    pub x: Dims,
    pub cout: usize,
    pub k: usize,
    pub stride: usize,
}

impl ConvShape {
    pub const fn new(x: Dims, cout: usize, k: usize, stride: usize) -> Self {
        ConvShape { x, cout, k, stride }
    }
    pub const fn pad(&self) -> usize {
        (self.k - 1) / 2
    }
    const fn out_len(&self, i: usize) -> usize {
        (i + 2 * self.pad() - self.k) / self.stride + 1
    }
    /// Output shape (N, Cout, Do, Ho, Wo).
    pub const fn out(&self) -> Dims {
        Dims {
            n: self.x.n,
            c: self.cout,
            d: self.out_len(self.x.d),
            h: self.out_len(self.x.h),
            w: self.out_len(self.x.w),
        }
    }
    /// Weight elements Cout·Cin·k³.
    pub const fn w_len(&self) -> usize {
        self.cout * self.x.c * self.k * self.k * self.k
    }
    /// Forward multiply-adds ×2.
    pub fn flops(&self) -> f64 {
        2.0 * (self.x.c * self.k * self.k * self.k) as f64 * self.out().numel() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn conv_out_shapes() {
        let x = Dims::new(1, 64, 128, 128, 128);
        assert_eq!(ConvShape::new(x, 64, 3, 1).out(), x);
        assert_eq!(ConvShape::new(x, 64, 3, 2).out(), Dims::new(1, 64, 64, 64, 64));
        assert_eq!(ConvShape::new(x, 32, 1, 1).out(), x.with_c(32));
        // odd sizes: stride-2 pad-1 k3 gives ceil(n/2)
        let o = ConvShape::new(Dims::new(1, 3, 5, 7, 9), 4, 3, 2).out();
        assert_eq!((o.d, o.h, o.w), (3, 4, 5));
        // 64→64 Conv3 at 128³ is 463.86 GFLOP (spec §8.1)
        let gf = ConvShape::new(x, 64, 3, 1).flops() / 1e9;
        assert!((gf - 463.86).abs() < 0.01, "{gf}");
    }
}
