//! UNetConfig: every knob of Med-DDPM's `create_model` / `UNetModel`, with the reference presets
//! (whole-head 128³ and BraTS 192×192×144) and validation that names what is wrong.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// The U-Net's hyper-parameters (spec §2.1). Volumes are (depth, size, size) = (D, H, W).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UNetConfig {
    /// Volume depth D (NIfTI axis 2).
    pub depth: usize,
    /// Volume height = width H = W (NIfTI axes 1 and 0).
    pub size: usize,
    /// Input channels: image channels + condition channels (3 whole-head, 8 BraTS).
    pub in_channels: usize,
    /// Output channels: image channels, ε only (1 whole-head, 4 BraTS).
    pub out_channels: usize,
    /// Base width (64 in Med-DDPM).
    pub model_channels: usize,
    /// Width multiplier per level ((1,1,2,3,4) in Med-DDPM).
    pub channel_mult: Vec<usize>,
    /// ResBlocks per level on the encoder side (decoder has one more).
    pub num_res_blocks: usize,
    /// Downsample rates ds at which encoder/decoder ResBlocks are followed by attention.
    /// The reference derives them as image_size // r for r in attention_resolutions ("16"):
    /// [8] at size 128; at size 192 the ds 12 never occurs, so BraTS has [] here.
    pub attention_ds: Vec<usize>,
    /// Attention heads (1 in Med-DDPM; legacy qkv order).
    pub num_heads: usize,
    /// GroupNorm groups (32).
    pub groups: usize,
}

impl UNetConfig {
    /// The whole-head model (`model_128.pt`): 3 → 1 channels at 128³, attention at 16³ and 8³.
    pub fn whole_head() -> Self {
        UNetConfig {
            depth: 128,
            size: 128,
            in_channels: 3,
            out_channels: 1,
            model_channels: 64,
            channel_mult: vec![1, 1, 2, 3, 4],
            num_res_blocks: 1,
            attention_ds: vec![8],
            num_heads: 1,
            groups: 32,
        }
    }
    /// The BraTS 4-modality model (`model_brats.pt`): 8 → 4 channels at 144×192×192.
    pub fn brats() -> Self {
        UNetConfig {
            depth: 144,
            size: 192,
            in_channels: 8,
            out_channels: 4,
            num_res_blocks: 2,
            attention_ds: vec![],
            ..Self::whole_head()
        }
    }
    /// The demo model (`meddpm train` with no options, the bundled demo checkpoint): the
    /// whole-head topology at 32³ with 8 base channels, 4 levels, 4 groups, attention at ds 4 —
    /// small enough to train in minutes on 2 CPU cores.
    pub fn demo() -> Self {
        UNetConfig {
            depth: 32,
            size: 32,
            model_channels: 8,
            channel_mult: vec![1, 2, 2, 4],
            attention_ds: vec![4],
            groups: 4,
            ..Self::whole_head()
        }
    }
    /// A tiny Med-DDPM-shaped model for tests: same topology (5 levels would
    /// need 32³ at least), 3 levels, 2 groups, attention at ds 2 and in the middle.
    pub fn tiny() -> Self {
        UNetConfig {
            depth: 8,
            size: 8,
            in_channels: 3,
            out_channels: 1,
            model_channels: 8,
            channel_mult: vec![1, 2, 2],
            num_res_blocks: 1,
            attention_ds: vec![2],
            num_heads: 1,
            groups: 4,
        }
    }

    /// The named presets (`meddpm train --preset`, Python's `preset=`).
    pub const PRESETS: [&'static str; 4] = ["demo", "tiny", "whole-head", "brats"];

    /// The preset of that name ([`UNetConfig::PRESETS`]), or `None`.
    pub fn preset(name: &str) -> Option<Self> {
        Some(match name {
            "demo" => Self::demo(),
            "tiny" => Self::tiny(),
            "whole-head" => Self::whole_head(),
            "brats" => Self::brats(),
            _ => return None,
        })
    }

    /// Number of resolution levels.
    pub fn levels(&self) -> usize {
        self.channel_mult.len()
    }
    /// Time-embedding width (4 × model_channels).
    pub fn emb_dim(&self) -> usize {
        4 * self.model_channels
    }
    /// Condition channels (in − out).
    pub fn cond_channels(&self) -> usize {
        self.in_channels - self.out_channels
    }

    /// Check every constraint the network needs; the error names the field and the expectation.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.channel_mult.is_empty() {
            return bad("channel_mult must have at least one level".into());
        }
        for (name, v) in [
            ("depth", self.depth),
            ("size", self.size),
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("model_channels", self.model_channels),
            ("num_heads", self.num_heads),
            ("groups", self.groups),
        ] {
            if v == 0 {
                return bad(format!("{name} must be > 0"));
            }
        }
        if self.in_channels <= self.out_channels {
            return bad(format!(
                "in_channels ({}) must exceed out_channels ({}): the input is the noisy image plus the condition mask",
                self.in_channels, self.out_channels
            ));
        }
        if let Some(m) = self.channel_mult.iter().find(|&&m| m == 0) {
            return bad(format!("channel_mult entries must be > 0, got {m}"));
        }
        let f = 1usize << (self.levels() - 1);
        for (name, v) in [("depth", self.depth), ("size", self.size)] {
            if v % f != 0 {
                return bad(format!(
                    "{name} = {v} must be divisible by 2^(levels-1) = {f} for {} levels",
                    self.levels()
                ));
            }
        }
        for c in self.channel_mult.iter().map(|m| m * self.model_channels) {
            if c % self.groups != 0 {
                return bad(format!("groups = {} must divide every level width; {c} is not divisible", self.groups));
            }
            if c % self.num_heads != 0 {
                return bad(format!(
                    "num_heads = {} must divide every attention width; {c} is not divisible",
                    self.num_heads
                ));
            }
        }
        if !self.model_channels.is_multiple_of(self.groups) {
            return bad(format!("groups = {} must divide model_channels = {}", self.groups, self.model_channels));
        }
        if !self.model_channels.is_multiple_of(2) {
            return bad(format!("model_channels = {} must be even (sinusoidal embedding)", self.model_channels));
        }
        for ds in &self.attention_ds {
            if !ds.is_power_of_two() || *ds >= (1 << self.levels()) {
                return bad(format!("attention_ds entry {ds} is not a downsample rate of this network (1, 2, .. {f})"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn presets_validate_and_bad_configs_are_named() {
        for c in [UNetConfig::whole_head(), UNetConfig::brats(), UNetConfig::demo(), UNetConfig::tiny()] {
            c.validate().unwrap();
        }
        let e = UNetConfig { size: 120, ..UNetConfig::whole_head() }.validate().unwrap_err().to_string();
        assert!(e.contains("size = 120") && e.contains("16"), "{e}");
        let e = UNetConfig { model_channels: 0, ..UNetConfig::whole_head() }.validate().unwrap_err().to_string();
        assert!(e.contains("model_channels must be > 0"), "{e}");
        let e = UNetConfig { groups: 5, ..UNetConfig::whole_head() }.validate().unwrap_err().to_string();
        assert!(e.contains("groups = 5"), "{e}");
        let e = UNetConfig { attention_ds: vec![12], ..UNetConfig::whole_head() }.validate().unwrap_err().to_string();
        assert!(e.contains("attention_ds entry 12"), "{e}");
    }
}
