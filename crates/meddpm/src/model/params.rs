//! The network's topology and its parameters, named exactly like the reference PyTorch
//! state dict (without the `denoise_fn.` prefix) and listed in `named_parameters()` order.
//!
//! [`topology`] walks the same loops as guided-diffusion's `UNetModel.__init__` and yields the
//! node list that `unet.rs` turns into its forward/backward call lists; [`param_specs`] yields
//! (key, shape, init) for every tensor. PyTorch shapes are kept as they are (Conv1d weights keep
//! their trailing 1), so an exported file loads with `load_state_dict` unchanged.

use super::config::UNetConfig;
use crate::rng::Philox;

/// One node of the U-Net, in forward order. Spatial sizes are those of the node's input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Node {
    /// Time embedding MLP: Linear(mc→4mc), SiLU, Linear(4mc→4mc). Prefix `time_embed`.
    TimeEmbed { prefix: String, mc: usize, emb: usize },
    /// `input_blocks.0.0`: Conv3 in_channels → mc.
    ConvIn { prefix: String, cin: usize, cout: usize, sp: [usize; 3] },
    /// ResBlock(cin → cout); a Conv1 skip when cin ≠ cout.
    Res { prefix: String, cin: usize, cout: usize, sp: [usize; 3] },
    /// AttentionBlock(c) with `heads` heads.
    Attn { prefix: String, c: usize, sp: [usize; 3] },
    /// Downsample: Conv3 stride 2, c → c.
    Down { prefix: String, c: usize, sp: [usize; 3] },
    /// Upsample: trilinear ×2 then Conv3 c → c.
    Up { prefix: String, c: usize, sp: [usize; 3] },
    /// End of an input block: its output is pushed on the skip stack.
    Push,
    /// Start of an output block: pop a skip (of `skip_c` channels) and concat [h, skip].
    PopConcat { h_c: usize, skip_c: usize, sp: [usize; 3] },
    /// Output head: GN(c), SiLU, Conv3 c → out_channels. Prefix `out`.
    Out { c: usize, cout: usize, sp: [usize; 3] },
}

/// How a parameter is initialised (PyTorch defaults, plus Med-DDPM's zero-initialised convs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Init {
    /// U(−1/√fan_in, 1/√fan_in): kaiming_uniform(a=√5) weights and default biases.
    Uniform {
        fan_in: usize,
    },
    Ones,
    Zeros,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    pub key: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The node list of `UNetModel` for `cfg`, in forward order.
pub fn topology(cfg: &UNetConfig) -> Vec<Node> {
    let mc = cfg.model_channels;
    let mut sp = [cfg.depth, cfg.size, cfg.size];
    let half = |s: [usize; 3]| [s[0] / 2, s[1] / 2, s[2] / 2];
    let mut nodes = vec![Node::TimeEmbed { prefix: "time_embed".into(), mc, emb: cfg.emb_dim() }];
    nodes.push(Node::ConvIn { prefix: "input_blocks.0.0".into(), cin: cfg.in_channels, cout: mc, sp });
    nodes.push(Node::Push);
    let mut chans = vec![mc];
    let (mut ch, mut ds, mut ib) = (mc, 1usize, 1usize);
    for (level, &mult) in cfg.channel_mult.iter().enumerate() {
        for _ in 0..cfg.num_res_blocks {
            let cout = mult * mc;
            nodes.push(Node::Res { prefix: format!("input_blocks.{ib}.0"), cin: ch, cout, sp });
            ch = cout;
            if cfg.attention_ds.contains(&ds) {
                nodes.push(Node::Attn { prefix: format!("input_blocks.{ib}.1"), c: ch, sp });
            }
            nodes.push(Node::Push);
            chans.push(ch);
            ib += 1;
        }
        if level + 1 != cfg.levels() {
            nodes.push(Node::Down { prefix: format!("input_blocks.{ib}.0.op"), c: ch, sp });
            nodes.push(Node::Push);
            sp = half(sp);
            chans.push(ch);
            ds *= 2;
            ib += 1;
        }
    }
    nodes.push(Node::Res { prefix: "middle_block.0".into(), cin: ch, cout: ch, sp });
    nodes.push(Node::Attn { prefix: "middle_block.1".into(), c: ch, sp });
    nodes.push(Node::Res { prefix: "middle_block.2".into(), cin: ch, cout: ch, sp });
    let mut ob = 0usize;
    for (level, &mult) in cfg.channel_mult.iter().enumerate().rev() {
        for i in 0..=cfg.num_res_blocks {
            let skip_c = chans.pop().expect("skip stack underflow");
            nodes.push(Node::PopConcat { h_c: ch, skip_c, sp });
            let cout = mult * mc;
            nodes.push(Node::Res { prefix: format!("output_blocks.{ob}.0"), cin: ch + skip_c, cout, sp });
            ch = cout;
            let mut k = 1;
            if cfg.attention_ds.contains(&ds) {
                nodes.push(Node::Attn { prefix: format!("output_blocks.{ob}.1"), c: ch, sp });
                k = 2;
            }
            if level > 0 && i == cfg.num_res_blocks {
                nodes.push(Node::Up { prefix: format!("output_blocks.{ob}.{k}.conv"), c: ch, sp });
                sp = [sp[0] * 2, sp[1] * 2, sp[2] * 2];
                ds /= 2;
            }
            ob += 1;
        }
    }
    nodes.push(Node::Out { c: ch, cout: cfg.out_channels, sp });
    nodes
}

fn conv(out: &mut Vec<ParamSpec>, key: &str, cout: usize, cin: usize, k: usize, conv1d: bool, zero: bool) {
    let shape = if conv1d { vec![cout, cin, 1] } else { vec![cout, cin, k, k, k] };
    let fan_in = cin * k * k * k;
    let init = |z: bool| if z { Init::Zeros } else { Init::Uniform { fan_in } };
    out.push(ParamSpec { key: format!("{key}.weight"), shape, init: init(zero) });
    out.push(ParamSpec { key: format!("{key}.bias"), shape: vec![cout], init: init(zero) });
}
fn linear(out: &mut Vec<ParamSpec>, key: &str, o: usize, i: usize) {
    out.push(ParamSpec { key: format!("{key}.weight"), shape: vec![o, i], init: Init::Uniform { fan_in: i } });
    out.push(ParamSpec { key: format!("{key}.bias"), shape: vec![o], init: Init::Uniform { fan_in: i } });
}
fn norm(out: &mut Vec<ParamSpec>, key: &str, c: usize) {
    out.push(ParamSpec { key: format!("{key}.weight"), shape: vec![c], init: Init::Ones });
    out.push(ParamSpec { key: format!("{key}.bias"), shape: vec![c], init: Init::Zeros });
}

/// Parameters a node owns, in `named_parameters()` order.
pub fn node_params(node: &Node, emb: usize) -> Vec<ParamSpec> {
    let mut p = Vec::new();
    match node {
        Node::TimeEmbed { prefix, mc, emb } => {
            linear(&mut p, &format!("{prefix}.0"), *emb, *mc);
            linear(&mut p, &format!("{prefix}.2"), *emb, *emb);
        }
        Node::ConvIn { prefix, cin, cout, .. } => conv(&mut p, prefix, *cout, *cin, 3, false, false),
        Node::Res { prefix, cin, cout, .. } => {
            norm(&mut p, &format!("{prefix}.in_layers.0"), *cin);
            conv(&mut p, &format!("{prefix}.in_layers.2"), *cout, *cin, 3, false, false);
            linear(&mut p, &format!("{prefix}.emb_layers.1"), *cout, emb);
            norm(&mut p, &format!("{prefix}.out_layers.0"), *cout);
            conv(&mut p, &format!("{prefix}.out_layers.3"), *cout, *cout, 3, false, true);
            if cin != cout {
                conv(&mut p, &format!("{prefix}.skip_connection"), *cout, *cin, 1, false, false);
            }
        }
        Node::Attn { prefix, c, .. } => {
            norm(&mut p, &format!("{prefix}.norm"), *c);
            conv(&mut p, &format!("{prefix}.qkv"), 3 * c, *c, 1, true, false);
            conv(&mut p, &format!("{prefix}.proj_out"), *c, *c, 1, true, true);
        }
        Node::Down { prefix, c, .. } | Node::Up { prefix, c, .. } => conv(&mut p, prefix, *c, *c, 3, false, false),
        Node::Out { c, cout, .. } => {
            norm(&mut p, "out.0", *c);
            conv(&mut p, "out.2", *cout, *c, 3, false, true);
        }
        Node::Push | Node::PopConcat { .. } => {}
    }
    p
}

/// Every parameter of the network, in the reference state-dict order.
pub fn param_specs(cfg: &UNetConfig) -> Vec<ParamSpec> {
    topology(cfg).iter().flat_map(|n| node_params(n, cfg.emb_dim())).collect()
}

/// Total parameter count.
pub fn param_count(cfg: &UNetConfig) -> usize {
    param_specs(cfg).iter().map(|p| p.numel()).sum()
}

/// Host values of one parameter per its [`Init`], drawn from `rng` (stream = parameter index).
pub fn init_param(spec: &ParamSpec, seed: u64, index: usize) -> Vec<f32> {
    let n = spec.numel();
    match spec.init {
        Init::Ones => vec![1.0; n],
        Init::Zeros => vec![0.0; n],
        Init::Uniform { fan_in } => {
            let bound = 1.0 / (fan_in as f64).sqrt();
            let r = Philox::new(seed, 0x1000_0000 + index as u64);
            (0..n)
                .map(|i| {
                    let u = r.block(i as u64)[0] as f64 / 4294967296.0;
                    ((2.0 * u - 1.0) * bound) as f32
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_parameter_counts() {
        assert_eq!(param_count(&UNetConfig::whole_head()), 40_226_433);
        assert_eq!(param_count(&UNetConfig::brats()), 57_562_564);
        // spec §4.2: 246 UNet tensors (whole-head), 338 (BraTS)
        assert_eq!(param_specs(&UNetConfig::whole_head()).len(), 246);
        assert_eq!(param_specs(&UNetConfig::brats()).len(), 338);
    }

    #[test]
    fn whole_head_keys_match_the_reference_index_map() {
        let specs = param_specs(&UNetConfig::whole_head());
        let has = |k: &str| specs.iter().any(|s| s.key == k);
        let shape = |k: &str| specs.iter().find(|s| s.key == k).unwrap().shape.clone();
        assert_eq!(specs[0].key, "time_embed.0.weight");
        assert_eq!(shape("time_embed.0.weight"), vec![256, 64]);
        assert_eq!(shape("input_blocks.0.0.weight"), vec![64, 3, 3, 3, 3]);
        for i in [1, 3, 5, 7, 9] {
            assert!(has(&format!("input_blocks.{i}.0.in_layers.2.weight")), "res {i}");
        }
        for i in [2, 4, 6, 8] {
            assert!(has(&format!("input_blocks.{i}.0.op.weight")), "down {i}");
        }
        for k in ["input_blocks.7.1", "middle_block.1", "output_blocks.2.1", "output_blocks.3.1"] {
            assert!(has(&format!("{k}.qkv.weight")), "attn {k}");
        }
        assert_eq!(shape("middle_block.1.qkv.weight"), vec![768, 256, 1]);
        for k in
            ["output_blocks.1.1.conv", "output_blocks.3.2.conv", "output_blocks.5.1.conv", "output_blocks.7.1.conv"]
        {
            assert!(has(&format!("{k}.weight")), "up {k}");
        }
        for i in [5, 7, 9] {
            assert!(has(&format!("input_blocks.{i}.0.skip_connection.weight")));
        }
        assert!(!has("input_blocks.3.0.skip_connection.weight"));
        for j in 0..10 {
            assert!(has(&format!("output_blocks.{j}.0.skip_connection.weight")), "out skip {j}");
        }
        assert_eq!(shape("output_blocks.0.0.in_layers.2.weight"), vec![256, 512, 3, 3, 3]);
        assert_eq!(specs.last().unwrap().key, "out.2.bias");
        assert_eq!(shape("out.2.weight"), vec![1, 64, 3, 3, 3]);
        // ResBlock 64→64 has 238,016 params (spec §2.5)
        let n: usize = specs.iter().filter(|s| s.key.starts_with("input_blocks.1.0.")).map(|s| s.numel()).sum();
        assert_eq!(n, 238_016);
    }

    #[test]
    fn brats_index_map() {
        let specs = param_specs(&UNetConfig::brats());
        let has = |k: &str| specs.iter().any(|s| s.key == k);
        assert!(has("input_blocks.0.0.weight"));
        assert_eq!(specs.iter().find(|s| s.key == "input_blocks.0.0.weight").unwrap().shape, vec![64, 8, 3, 3, 3]);
        for i in [3, 6, 9, 12] {
            assert!(has(&format!("input_blocks.{i}.0.op.weight")));
        }
        for j in [2, 5, 8, 11] {
            assert!(has(&format!("output_blocks.{j}.1.conv.weight")));
        }
        assert_eq!(specs.iter().filter(|s| s.key.ends_with("qkv.weight")).count(), 1);
        assert!(has("middle_block.1.qkv.weight"));
    }

    #[test]
    fn zero_init_convs() {
        let specs = param_specs(&UNetConfig::tiny());
        for s in &specs {
            let zero = s.key.contains("out_layers.3") || s.key.contains("proj_out") || s.key.starts_with("out.2");
            assert_eq!(
                matches!(s.init, Init::Zeros),
                zero || (s.key.ends_with(".bias") && matches!(s.init, Init::Zeros)),
                "{}",
                s.key
            );
        }
        let v = init_param(&specs[0], 1, 0);
        let bound = 1.0 / (specs[0].shape[1] as f32).sqrt();
        assert!(v.iter().all(|x| x.abs() <= bound) && v.iter().any(|x| x.abs() > bound * 0.9));
    }
}
