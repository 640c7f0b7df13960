//! Analytic cost of the U-Net: FLOPs per forward pass and per training micro-step, split by
//! kind, counted from the same topology the engine runs (spec §8 conventions: a multiply-add is
//! 2 FLOP; conv = 2·Cin·Cout·k³·output voxels; attention = 2·T²·C for QKᵀ and again for AV).
//! Used by `info`, `bench` (achieved TFLOP/s) and the roofline in `profile`.

use super::config::UNetConfig;
use super::params::{topology, Node};
use crate::shape::{ConvShape, Dims};

/// FLOPs of one forward pass at batch 1, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Flops {
    /// 3×3×3 and 1×1×1 convolutions outside attention (incl. Down/Up convs and skips).
    pub conv: f64,
    /// Attention: qkv and proj 1×1 convs, QKᵀ, AV (softmax not counted).
    pub attention: f64,
    /// Time-embedding and emb_layers linears.
    pub linear: f64,
}

impl Flops {
    pub fn total(&self) -> f64 {
        self.conv + self.attention + self.linear
    }
    /// A training micro-step: backward costs 2× forward (dX + dW) except the input conv's dX.
    pub fn train_step(&self, cfg: &UNetConfig) -> f64 {
        let conv_in =
            ConvShape::new(Dims::new(1, cfg.in_channels, cfg.depth, cfg.size, cfg.size), cfg.model_channels, 3, 1);
        3.0 * self.total() - conv_in.flops()
    }
}

/// Forward FLOPs of `cfg` at batch 1.
pub fn forward_flops(cfg: &UNetConfig) -> Flops {
    let mut f = Flops::default();
    let dims = |c: usize, sp: [usize; 3]| Dims::new(1, c, sp[0], sp[1], sp[2]);
    let emb = cfg.emb_dim() as f64;
    for node in topology(cfg) {
        match node {
            Node::TimeEmbed { mc, emb, .. } => f.linear += 2.0 * (mc * emb + emb * emb) as f64,
            Node::ConvIn { cin, cout, sp, .. } => f.conv += ConvShape::new(dims(cin, sp), cout, 3, 1).flops(),
            Node::Down { c, sp, .. } => f.conv += ConvShape::new(dims(c, sp), c, 3, 2).flops(),
            Node::Up { c, sp, .. } => f.conv += ConvShape::new(dims(c, sp).up2(), c, 3, 1).flops(),
            Node::Res { cin, cout, sp, .. } => {
                f.conv += ConvShape::new(dims(cin, sp), cout, 3, 1).flops()
                    + ConvShape::new(dims(cout, sp), cout, 3, 1).flops();
                if cin != cout {
                    f.conv += ConvShape::new(dims(cin, sp), cout, 1, 1).flops();
                }
                f.linear += 2.0 * emb * cout as f64;
            }
            Node::Attn { c, sp, .. } => {
                let x = dims(c, sp);
                let t = x.s() as f64;
                f.attention += ConvShape::new(x, 3 * c, 1, 1).flops()
                    + ConvShape::new(x, c, 1, 1).flops()
                    + 4.0 * t * t * c as f64;
            }
            Node::Out { c, cout, sp } => f.conv += ConvShape::new(dims(c, sp), cout, 3, 1).flops(),
            Node::Push | Node::PopConcat { .. } => {}
        }
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn whole_head_flops_match_the_spec() {
        let f = forward_flops(&UNetConfig::whole_head());
        // spec §8.1: conv 5.494 TFLOP; attention 0.043 TFLOP incl. ≈0.25 GFLOP of softmax we skip
        assert!((f.conv / 1e12 - 5.494).abs() < 0.003, "conv {}", f.conv / 1e12);
        assert!((f.attention / 1e12 - 0.043).abs() < 0.001, "attention {}", f.attention / 1e12);
        // spec §8.2: 16.69 TFLOP per micro-step (incl. elementwise and attention recompute)
        let t = f.train_step(&UNetConfig::whole_head()) / 1e12;
        assert!((t - 16.6).abs() < 0.15, "train {t}");
        let b = forward_flops(&UNetConfig::brats()).total() / 1e12;
        assert!((b - 21.3).abs() < 0.1, "brats {b}");
    }
}
