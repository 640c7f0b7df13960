//! The Med-DDPM U-Net over any [`Backend`]: planned buffers, forward, and backward.
//!
//! [`UNet::new`] turns the node list of `params::topology` into a flat list of [`Layer`]s, each
//! owning its output, the gradient of its output, and what its backward needs; all buffers are
//! allocated here, once (invariant: `forward` and `backward` allocate nothing). `forward` walks
//! the list front to back; `backward` walks it back to front, each layer writing the gradient of
//! its input(s) with the [`Accum`] mode planned here: the last consumer of a tensor in forward
//! order writes (`Overwrite`) and every earlier one adds (`Add`) — these are the U-Net's skips.
//!
//! Semantics follow the reference `UNetModel` (guided-diffusion with Med-DDPM's changes, spec §2):
//! ResBlock  h = conv(silu(gn(x))) + emb_linear(silu(emb)); out = skip(x) + conv(silu(gn(h)))
//! Attention out = x + proj(attn(qkv(gn(x))))           (legacy head order, 1 head by default)
//! Down      conv k3 stride 2;   Up  trilinear ×2 then conv k3
//! Decoder   each output block starts with cat([h, skip]) on channels.
//!
//! Memory plan: every layer output that backward needs is kept, except concatenations (read again
//! from their two inputs by the block that reads them, in its backward; one buffer per size
//! serves them all, as that block's scratch) and upsampled tensors (recomputed in scratch). Layer
//! output gradients share buffers by lifetime: a gradient lives from its last consumer's backward
//! to its own layer's backward, and buffers of the same size whose lifetimes do not overlap are
//! one buffer.
//!
//! Precision: activations, their gradients and the scratch are [`Backend::alloc_act`] buffers
//! (bf16 under `Precision::Bf16`); the network input and output ε̂ (and ∂loss/∂ε̂), GroupNorm
//! statistics and the time embedding are f32. When activations are bf16 the convolutions read
//! bf16 copies of their weights (`lowp`), refreshed from the f32 parameters before the first
//! forward after [`UNet::params_changed`] (which `set_params`, `init_params` and the trainer's
//! optimizer step call). [`MemPlan`] counts the bytes of every buffer class.

use super::config::UNetConfig;
use super::params::{init_param, node_params, topology, Node, ParamSpec};
use crate::backend::{Accum, Backend, GnSiluBack};
use crate::error::{Error, Result};
use crate::shape::{ConvShape, Dims};

/// Process-unique U-Net ids (the graph keys of [`Backend::replay`]).
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Sinusoidal timestep embedding, Med-DDPM flavour: max_period 1000, [cos, sin] order,
/// computed in f32 like the reference. Returns (N, dim) row-major.
pub fn timestep_embedding(t: &[f32], dim: usize) -> Vec<f32> {
    let half = dim / 2;
    let mut out = vec![0f32; t.len() * dim];
    for (n, &tn) in t.iter().enumerate() {
        for i in 0..half {
            let freq = (-(1000f32).ln() * i as f32 / half as f32).exp();
            let arg = tn * freq;
            out[n * dim + i] = arg.cos();
            out[n * dim + half + i] = arg.sin();
        }
    }
    out
}

/// A ResBlock's saved activations. `p` indexes its first parameter (in_layers.0.weight).
pub struct ResBlock<B: Backend> {
    p: usize,
    x: Dims,
    cout: usize,
    mean1: B::Buf,
    rstd1: B::Buf,
    /// in_layers' conv output without any bias: the GroupNorm that reads it adds `e` per (n, c)
    /// as its input offset (`Backend::groupnorm_silu_forward`'s `off`), so h + e is never stored.
    h: B::Buf,
    /// emb_layers' output + both folded biases (f32, N × cout): h's per-channel offset.
    e: B::Buf,
    /// ∂loss/∂e in backward (f32, N × cout); summed over N it is also in_layers' conv bias
    /// gradient.
    de: B::Buf,
    /// dout summed over voxels per sample in backward (f32, N × cout): out_layers' conv bias
    /// gradient and the skip conv's (one reduction for both).
    ds: B::Buf,
    /// emb_layers' bias + in_layers' conv bias (f32, cout): the bias of emb_layers' Linear, so `e`
    /// carries both.
    b_in: B::Buf,
    /// out_layers' conv bias + the skip conv's bias (f32, cout; skip-conv blocks only): added to
    /// the skip branch, onto which out_layers' conv is accumulated (cuDNN's β = 1).
    b_out: Option<B::Buf>,
    mean2: B::Buf,
    rstd2: B::Buf,
    /// The input is a skip concatenation (the decoder's ResBlocks). Its buffer is not kept for
    /// the backward, so the block uses it as its own scratch and needs none of the
    /// concatenation's size (the largest tensors at 128³): forward builds the concatenation
    /// there with its GroupNorm statistics (`concat_channels_stats`; the Concat layer's forward
    /// does nothing), runs the skip conv, then GroupNorm+SiLU over it in place from those
    /// statistics; backward writes the conv's data gradient into the concatenation's gradient
    /// buffer, then `groupnorm_silu_backward_cat_in` takes the skip conv's weight gradient, the
    /// GroupNorm+SiLU backward (writing SiLU(GroupNorm(x)) into the concatenation's buffer for
    /// the conv's weight gradient) and the skip conv's data gradient, and delivers the sum to the
    /// two parts; a backend may read x from the parts there rather than rebuild it.
    cat_in: bool,
    /// The layer that reads this block's output and needs its GroupNorm statistics (a ResBlock
    /// over it, not a concatenation, or the output head), where out_layers' fused conv takes them
    /// in its epilogue straight into that layer's buffers (`Backend::fused_conv_out_stats`);
    /// decided at the start of every forward.
    y_to: Option<usize>,
    /// in_layers' statistics of x are in mean1/rstd1 already, taken by the producing ResBlock
    /// (its `y_to` is this layer); decided with it.
    x_stats: bool,
}

/// An AttentionBlock's saved activations. `p` indexes norm.weight.
pub struct AttnBlock<B: Backend> {
    p: usize,
    x: Dims,
    heads: usize,
    gn: B::Buf,
    mean: B::Buf,
    rstd: B::Buf,
    qkv: B::Buf,
    att: B::Buf,
    a: B::Buf,
}

impl<B: Backend> AttnBlock<B> {
    fn att_len(&self) -> usize {
        self.x.n * self.heads * self.x.s() * self.x.s()
    }
}

/// The output head GN → SiLU → Conv3. `p` indexes out.0.weight.
pub struct OutHead<B: Backend> {
    p: usize,
    x: Dims,
    cout: usize,
    mean: B::Buf,
    rstd: B::Buf,
    /// The statistics of the input are in mean/rstd already (the producing ResBlock's `y_to`).
    stats_given: bool,
}

pub enum Op<B: Backend> {
    /// The network input cat([x_t, cond]) (N, in, D, H, W), written by the caller.
    Input,
    /// input_blocks.0.0 and Downsample: one convolution.
    Conv {
        p: usize,
        cs: ConvShape,
    },
    Res(ResBlock<B>),
    Attn(AttnBlock<B>),
    /// Upsample: trilinear ×2 into scratch (slot 1, recomputed in backward), then the conv.
    /// `bias`: the conv adds its bias (its concatenation is never stored, see `Concat::free`);
    /// else the concatenation that reads it adds it (`cat_bias`).
    Up {
        p: usize,
        x: Dims,
        bias: bool,
    },
    /// cat([h, skip]) where h is the `input` layer's output and skip the `skip` layer's.
    /// `free`: the `cat_in` ResBlock that reads it never stores it (`Backend::cat_conv_fusable`,
    /// decided at each forward, before the upsampling conv that feeds it runs).
    Concat {
        skip: usize,
        skip_mode: Accum,
        x: Dims,
        ca: usize,
        cb: usize,
        free: bool,
    },
    Out(OutHead<B>),
}

/// The bias concatenation `layers[cat]` adds to its first input: an upsampling conv's (its
/// parameter index), which that conv leaves out unless the concatenation is never stored; None
/// for any other input.
fn cat_bias<B: Backend>(layers: &[Layer<B>], cat: usize) -> Option<usize> {
    match (&layers[cat].op, &layers[layers[cat].input].op) {
        (Op::Concat { free: false, .. }, Op::Up { p, bias: false, .. }) => Some(p + 1),
        _ => None,
    }
}

/// One planned layer: its op, which layer feeds it, how it writes its input's gradient, its
/// output (logical shape `y`) and the gradient of that output (indices into `UNet::acts`).
pub struct Layer<B: Backend> {
    /// The reference module path of the block (`input_blocks.1.0`, `output_blocks.2.cat`, `out`):
    /// the range name profilers see (see [`Backend::push_range`]).
    pub name: String,
    pub op: Op<B>,
    pub input: usize,
    pub mode: Accum,
    pub y: Dims,
    /// Output buffer (shared by all concatenations of one size: none is kept for the backward).
    pub out: usize,
    /// Output-gradient buffer (shared by lifetime with other layers' gradients).
    pub dout: usize,
}

/// The time-embedding MLP's activations (N × emb each, tiny).
struct TimeEmbed<B: Backend> {
    sin: B::Buf,
    t1: B::Buf,
    t1s: B::Buf,
    t2: B::Buf,
    emb_silu: B::Buf,
    d_emb_silu: B::Buf,
    d1: B::Buf,
    d2: B::Buf,
}

/// Bytes of the planned buffers, by class (what `meddpm info` prints).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemPlan {
    /// Layer outputs kept from forward to backward, and one buffer per size for the
    /// concatenations, which are not kept (activation type).
    pub outputs: usize,
    /// Gradients of the layer outputs, buffers shared by lifetime (activation type).
    pub grads: usize,
    /// Block internals kept for backward: ResBlock h, attention GroupNorm/qkv/probabilities/output
    /// (activation type).
    pub saved: usize,
    /// Scratch shared by all blocks (activation type).
    pub scratch: usize,
    /// The network input and output ε̂ with its gradient (f32).
    pub io: usize,
    /// GroupNorm statistics, time embedding, per-block embedding biases (f32).
    pub small: usize,
    /// Parameters and their gradients (f32).
    pub params: usize,
    /// bf16 copies of the conv weights (only when activations are bf16).
    pub lowp: usize,
}

impl MemPlan {
    /// Everything the U-Net allocates.
    pub fn total(&self) -> usize {
        self.outputs + self.grads + self.saved + self.scratch + self.io + self.small + self.params + self.lowp
    }
    /// Activation-side bytes (everything but parameters, gradients and weight copies).
    pub fn activations(&self) -> usize {
        self.outputs + self.grads + self.saved + self.scratch + self.io + self.small
    }
    /// (class, bytes) rows in a fixed order, for reports.
    pub fn rows(&self) -> [(&'static str, usize); 8] {
        [
            ("layer outputs (kept; concatenations not stored)", self.outputs),
            ("layer output gradients (shared by lifetime)", self.grads),
            ("block internals kept for backward", self.saved),
            ("shared scratch (recomputed GN+SiLU, temporaries)", self.scratch),
            ("network input, output and its gradient (f32)", self.io),
            ("statistics and embeddings (f32)", self.small),
            ("parameters and gradients (f32)", self.params),
            ("bf16 copies of the conv weights", self.lowp),
        ]
    }
}

/// Assign the layers' output and output-gradient buffers (see the module docs): the network input,
/// ε̂ and ∂loss/∂ε̂ are f32; every other output its own activation buffer except concatenations
/// (one shared buffer per size, not kept); gradients by lifetime in backward, greedily.
fn plan_acts<B: Backend>(
    layers: &mut [Layer<B>],
    mem: &mut MemPlan,
    alloc: &dyn Fn(&mut usize, usize) -> Result<B::Buf>,
    act: &dyn Fn(&mut usize, usize) -> Result<B::Buf>,
) -> Result<Vec<B::Buf>> {
    let mut acts = Vec::new();
    let mut push = |b: B::Buf| {
        acts.push(b);
        acts.len() - 1
    };
    let last = layers.len() - 1;
    let mut cat_pool = std::collections::HashMap::<usize, usize>::new();
    for (i, l) in layers.iter_mut().enumerate() {
        let len = l.y.numel();
        l.out = match l.op {
            _ if i == 0 || i == last => push(alloc(&mut mem.io, len)?),
            Op::Concat { .. } => match cat_pool.get(&len) {
                Some(&b) => b,
                None => {
                    let b = push(act(&mut mem.outputs, len)?);
                    cat_pool.insert(len, b);
                    b
                }
            },
            _ => push(act(&mut mem.outputs, len)?),
        };
    }
    // ∂loss/∂ε̂ (written by the loss before backward) and the input's (never written: empty)
    layers[last].dout = push(alloc(&mut mem.io, layers[last].y.numel())?);
    layers[0].dout = push(alloc(&mut mem.io, 0)?);
    // Backward runs layer i at time last − i. Layer j's gradient is first written by its last
    // consumer (in forward order) and last read by layer j itself.
    // A concatenation's two inputs get their gradients from its consumer, the `cat_in` ResBlock
    // right after it (`groupnorm_silu_backward_cat_in`), so their lifetimes start there.
    let mut last_use = vec![0usize; layers.len()];
    for (k, l) in layers.iter().enumerate() {
        let at = match l.op {
            Op::Concat { .. } => k + 1,
            _ => k,
        };
        last_use[l.input] = last_use[l.input].max(at);
        if let Op::Concat { skip, .. } = l.op {
            last_use[skip] = last_use[skip].max(at);
        }
    }
    let mut live: Vec<(usize, usize, usize)> = (1..last).map(|j| (last - last_use[j], last - j, j)).collect();
    live.sort();
    // per size: (buffer, time its current lifetime ends)
    let mut pool = std::collections::HashMap::<usize, Vec<(usize, usize)>>::new();
    for (start, end, j) in live {
        let len = layers[j].y.numel();
        let free = pool.entry(len).or_default();
        let b = match free.iter_mut().find(|(_, until)| *until < start) {
            Some(slot) => {
                slot.1 = end;
                slot.0
            }
            None => {
                let b = push(act(&mut mem.grads, len)?);
                pool.get_mut(&len).expect("entry made above").push((b, end));
                b
            }
        };
        layers[j].dout = b;
    }
    Ok(acts)
}

/// Scratch: up to three buffers for every distinct tensor size (backends check exact lengths, so
/// scratch comes in exact sizes; there are few sizes). Slot roles around a GroupNorm+SiLU+conv:
/// 0 the SiLU output (the conv's input), 1 the gradient of the conv input, 2 the gradient inside a
/// ResBlock (dh). GroupNorm+SiLU outputs are not kept from forward to backward: backward recomputes
/// them into slot 0 from the saved input and statistics, which halves what a ResBlock keeps (the
/// largest tensors at 128³) — in the GroupNorm+SiLU backward's own elementwise pass
/// (`groupnorm_silu_backward_act`), so the conv's data gradient runs before its weight gradient;
/// the GroupNorm output itself is never stored (the fused backward recomputes it).
struct Scratch<B: Backend> {
    bufs: Vec<B::Buf>,
    base: std::collections::HashMap<usize, usize>,
}

impl<B: Backend> Scratch<B> {
    /// Distinct scratch buffers, each named by (element count, slot 0..2). Data stays in a
    /// slot between calls, so a phase of backward can hand a result to the next by slot.
    fn get<const K: usize>(&mut self, req: [(usize, usize); K]) -> [&mut B::Buf; K] {
        let idx = req.map(|(len, slot)| self.base[&len] + slot);
        self.bufs.get_disjoint_mut(idx).expect("distinct scratch slots")
    }
}

pub struct UNet<B: Backend> {
    pub cfg: UNetConfig,
    pub batch: usize,
    pub specs: Vec<ParamSpec>,
    /// f32 parameters in `specs` order. After writing them directly, call
    /// [`UNet::params_changed`].
    pub params: Vec<B::Buf>,
    pub grads: Vec<B::Buf>,
    pub layers: Vec<Layer<B>>,
    /// Layer outputs and output gradients (see [`Layer::out`], [`Layer::dout`]).
    acts: Vec<B::Buf>,
    temb: TimeEmbed<B>,
    scr: Scratch<B>,
    /// Attention-probability gradients (activation type, one per attention size).
    scr_att: Scratch<B>,
    /// Activation-type copies of the conv weights (Some for every conv weight when activations
    /// are bf16, else all None): what the convolutions read.
    lowp: Vec<Option<B::Buf>>,
    derived_fresh: bool,
    /// Identity of this network's buffers for [`Backend::replay`]: a process-unique id, and which
    /// of two parameter-buffer sets is in (toggled by [`UNet::params_swapped`]).
    graph_id: u64,
    graph_epoch: u64,
    /// Bytes of every planned buffer, by class.
    pub mem: MemPlan,
    /// Bytes of all activation, gradient and scratch buffers (excluding parameters).
    pub act_bytes: usize,
}

impl<B: Backend> UNet<B> {
    /// Validate `cfg` and plan every buffer for batch size `batch`. Parameters start at zero:
    /// call [`UNet::init_params`] or [`UNet::set_params`].
    pub fn new(be: &B, cfg: &UNetConfig, batch: usize) -> Result<Self> {
        cfg.validate()?;
        if batch == 0 {
            return Err(Error::Config("batch must be > 0".into()));
        }
        let n = batch;
        let emb = cfg.emb_dim();
        let g = cfg.groups;
        let ab = be.precision().act_dtype().bytes();
        let mut mem = MemPlan::default();
        // f32 buffers (counted into `class`) and activation-type buffers
        let alloc = |class: &mut usize, len: usize| -> Result<B::Buf> {
            *class += len * 4;
            be.alloc(len)
        };
        let act = |class: &mut usize, len: usize| -> Result<B::Buf> {
            *class += len * ab;
            be.alloc_act(len)
        };
        let mut conv_w: Vec<usize> = Vec::new();
        let mut specs = Vec::new();
        let mut layers: Vec<Layer<B>> = Vec::new();
        let sp_dims = |c: usize, sp: [usize; 3]| Dims::new(n, c, sp[0], sp[1], sp[2]);
        let input_dims = sp_dims(cfg.in_channels, [cfg.depth, cfg.size, cfg.size]);
        // buffers are assigned after the walk (see below); usize::MAX until then
        let unset = usize::MAX;
        layers.push(Layer {
            name: "input".into(),
            op: Op::Input,
            input: 0,
            mode: Accum::Overwrite,
            y: input_dims,
            out: unset,
            dout: unset,
        });
        let mut skips: Vec<usize> = Vec::new();
        // scratch slots needed per tensor size (see `Scratch` for the slot roles)
        let mut sizes = std::collections::BTreeMap::<usize, usize>::new();
        // the attention-probability gradients (one per attention size)
        let mut sizes_att = std::collections::BTreeSet::<usize>::new();
        let mut need = |len: usize, slots: usize| {
            let e = sizes.entry(len).or_insert(0);
            *e = (*e).max(slots);
        };
        let mut concats = 0usize;
        for node in topology(cfg) {
            let p = specs.len();
            let name = match &node {
                Node::ConvIn { prefix, .. }
                | Node::Res { prefix, .. }
                | Node::Attn { prefix, .. }
                | Node::Down { prefix, .. }
                | Node::Up { prefix, .. }
                | Node::TimeEmbed { prefix, .. } => prefix.clone(),
                Node::PopConcat { .. } => {
                    concats += 1;
                    format!("output_blocks.{}.cat", concats - 1)
                }
                Node::Out { .. } => "out".into(),
                Node::Push => String::new(),
            };
            specs.extend(node_params(&node, emb));
            let prev = layers.len() - 1;
            let (op, y, input) = match node {
                Node::TimeEmbed { .. } => continue,
                Node::Push => {
                    skips.push(prev);
                    continue;
                }
                Node::ConvIn { cin, cout, sp, .. } => {
                    let cs = ConvShape::new(sp_dims(cin, sp), cout, 3, 1);
                    conv_w.push(p);
                    (Op::Conv { p, cs }, cs.out(), prev)
                }
                Node::Down { c, sp, .. } => {
                    let cs = ConvShape::new(sp_dims(c, sp), c, 3, 2);
                    conv_w.push(p);
                    (Op::Conv { p, cs }, cs.out(), prev)
                }
                Node::Res { cin, cout, sp, .. } => {
                    let x = sp_dims(cin, sp);
                    let y = x.with_c(cout);
                    let cat_in = matches!(layers[prev].op, Op::Concat { .. });
                    assert!(!cat_in || cin != cout, "a ResBlock after a concatenation has a skip conv");
                    if !cat_in {
                        need(x.numel(), 2);
                    }
                    need(y.numel(), 3);
                    conv_w.extend([p + 2, p + 8]);
                    if cin != cout {
                        conv_w.push(p + 10);
                    }
                    let r = ResBlock {
                        p,
                        x,
                        cout,
                        mean1: alloc(&mut mem.small, n * g)?,
                        rstd1: alloc(&mut mem.small, n * g)?,
                        h: act(&mut mem.saved, y.numel())?,
                        e: alloc(&mut mem.small, n * cout)?,
                        de: alloc(&mut mem.small, n * cout)?,
                        ds: alloc(&mut mem.small, n * cout)?,
                        b_in: alloc(&mut mem.small, cout)?,
                        b_out: if cin != cout { Some(alloc(&mut mem.small, cout)?) } else { None },
                        mean2: alloc(&mut mem.small, n * g)?,
                        rstd2: alloc(&mut mem.small, n * g)?,
                        cat_in,
                        y_to: None,
                        x_stats: false,
                    };
                    (Op::Res(r), y, prev)
                }
                Node::Attn { c, sp, .. } => {
                    let x = sp_dims(c, sp);
                    let t = x.s();
                    let att_len = n * cfg.num_heads * t * t;
                    need(x.numel(), 2);
                    need(3 * x.numel(), 1);
                    sizes_att.insert(att_len);
                    conv_w.extend([p + 2, p + 4]);
                    let a = AttnBlock {
                        p,
                        x,
                        heads: cfg.num_heads,
                        gn: act(&mut mem.saved, x.numel())?,
                        mean: alloc(&mut mem.small, n * g)?,
                        rstd: alloc(&mut mem.small, n * g)?,
                        qkv: act(&mut mem.saved, 3 * x.numel())?,
                        att: act(&mut mem.saved, att_len)?,
                        a: act(&mut mem.saved, x.numel())?,
                    };
                    (Op::Attn(a), x, prev)
                }
                Node::Up { c, sp, .. } => {
                    let x = sp_dims(c, sp);
                    need(x.up2().numel(), 2);
                    conv_w.push(p);
                    (Op::Up { p, x, bias: false }, x.up2(), prev)
                }
                Node::PopConcat { h_c, skip_c, sp } => {
                    let skip = skips.pop().expect("topology pops no more than it pushes");
                    let x = sp_dims(h_c, sp);
                    let op = Op::Concat { skip, skip_mode: Accum::Overwrite, x, ca: h_c, cb: skip_c, free: false };
                    (op, x.with_c(h_c + skip_c), prev)
                }
                Node::Out { c, cout, sp } => {
                    let x = sp_dims(c, sp);
                    need(x.numel(), 2);
                    conv_w.push(p + 2);
                    let o = OutHead {
                        p,
                        x,
                        cout,
                        mean: alloc(&mut mem.small, n * g)?,
                        rstd: alloc(&mut mem.small, n * g)?,
                        stats_given: false,
                    };
                    (Op::Out(o), x.with_c(cout), prev)
                }
            };
            layers.push(Layer { name, op, input, mode: Accum::Overwrite, y, out: unset, dout: unset });
        }
        // Gradient modes: in backward (reverse order) the first writer of a tensor's gradient is
        // its last consumer in forward order; it overwrites, every other consumer adds.
        let mut written = vec![false; layers.len()];
        for i in (1..layers.len()).rev() {
            let src = layers[i].input;
            layers[i].mode = if std::mem::replace(&mut written[src], true) { Accum::Add } else { Accum::Overwrite };
            if let Op::Concat { skip, skip_mode, .. } = &mut layers[i].op {
                *skip_mode = if std::mem::replace(&mut written[*skip], true) { Accum::Add } else { Accum::Overwrite };
            }
        }
        // a concatenation has one consumer, which therefore overwrites its gradient (the in-place
        // backward of a `cat_in` ResBlock relies on it); that consumer is a `cat_in` ResBlock,
        // which builds the concatenation in forward
        assert!(layers.iter().all(|l| !matches!(&l.op, Op::Res(r) if r.cat_in) || l.mode == Accum::Overwrite));
        assert!(layers
            .iter()
            .all(|l| { !matches!(layers[l.input].op, Op::Concat { .. }) || matches!(&l.op, Op::Res(r) if r.cat_in) }));
        let acts = plan_acts(&mut layers, &mut mem, &alloc, &act)?;
        let small = &mut mem.small;
        let temb = TimeEmbed {
            sin: alloc(small, n * cfg.model_channels)?,
            t1: alloc(small, n * emb)?,
            t1s: alloc(small, n * emb)?,
            t2: alloc(small, n * emb)?,
            emb_silu: alloc(small, n * emb)?,
            d_emb_silu: alloc(small, n * emb)?,
            d1: alloc(small, n * emb)?,
            d2: alloc(small, n * emb)?,
        };
        let mut scr = Scratch { bufs: Vec::new(), base: Default::default() };
        for (len, slots) in sizes {
            scr.base.insert(len, scr.bufs.len());
            for _ in 0..slots {
                scr.bufs.push(act(&mut mem.scratch, len)?);
            }
        }
        let mut scr_att = Scratch { bufs: Vec::new(), base: Default::default() };
        for len in sizes_att {
            scr_att.base.insert(len, scr_att.bufs.len());
            scr_att.bufs.push(act(&mut mem.scratch, len)?);
        }
        let params = specs.iter().map(|s| alloc(&mut mem.params, s.numel())).collect::<Result<Vec<_>>>()?;
        let grads = specs.iter().map(|s| alloc(&mut mem.params, s.numel())).collect::<Result<Vec<_>>>()?;
        let mut lowp: Vec<Option<B::Buf>> = specs.iter().map(|_| None).collect();
        if be.precision().act_dtype() != crate::backend::DType::F32 {
            for &i in &conv_w {
                lowp[i] = Some(act(&mut mem.lowp, specs[i].numel())?);
            }
        }
        let act_bytes = mem.activations();
        Ok(UNet {
            cfg: cfg.clone(),
            batch,
            specs,
            params,
            grads,
            layers,
            acts,
            temb,
            scr,
            scr_att,
            lowp,
            derived_fresh: false,
            graph_id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            graph_epoch: 0,
            mem,
            act_bytes,
        })
    }

    /// Mark the f32 parameters as changed: the weight copies the convolutions read are refreshed
    /// before the next forward.
    pub fn params_changed(&mut self) {
        self.derived_fresh = false;
    }

    /// Mark the parameter *buffers* as swapped with another set of the same shapes (the EMA weights
    /// in, or back out: `Trainer::with_ema`): the two sets alternate, so each keeps its own
    /// replayed graphs. Implies [`UNet::params_changed`].
    pub fn params_swapped(&mut self) {
        self.params_changed();
        self.graph_epoch ^= 1;
    }

    /// The [`Backend::replay`] key of one pass of this network with its current buffers.
    fn graph_key(&self, pass: u64) -> u64 {
        (self.graph_id << 40) ^ (self.graph_epoch << 2) ^ pass
    }

    /// Refresh what is derived from the parameters if they changed: the activation-type weight
    /// copies and the ResBlocks' folded biases (`ResBlock::b_in`, `b_out`), one launch each: per
    /// parameter update, not per forward (a sampling run's forwards share one).
    fn refresh_derived(&mut self, be: &B) {
        if self.derived_fresh {
            return;
        }
        let mut pairs: Vec<(&mut B::Buf, &B::Buf)> =
            self.lowp.iter_mut().zip(&self.params).filter_map(|(l, p)| l.as_mut().map(|l| (l, p))).collect();
        be.cast_all(&mut pairs);
        let w = &self.params;
        let mut triples: Vec<(&mut B::Buf, &B::Buf, &B::Buf)> = Vec::new();
        for l in &mut self.layers {
            if let Op::Res(r) = &mut l.op {
                let p = r.p;
                triples.push((&mut r.b_in, &w[p + 5], &w[p + 3]));
                if let Some(b_out) = &mut r.b_out {
                    triples.push((b_out, &w[p + 11], &w[p + 9]));
                }
            }
        }
        be.add_bias_vectors_all(&mut triples);
        self.derived_fresh = true;
    }

    /// Logical shape of the network input (N, in_channels, D, H, W).
    pub fn input_dims(&self) -> Dims {
        self.layers[0].y
    }
    /// Logical shape of the output ε̂ (N, out_channels, D, H, W).
    pub fn output_dims(&self) -> Dims {
        self.layers.last().expect("planned").y
    }
    /// The network input buffer, to be filled with cat([x_t, cond]) before `forward`.
    pub fn input_mut(&mut self) -> &mut B::Buf {
        &mut self.acts[self.layers[0].out]
    }
    /// ε̂ after `forward`.
    pub fn output(&self) -> &B::Buf {
        &self.acts[self.layers.last().expect("planned").out]
    }
    /// (ε̂, ∂loss/∂ε̂): the loss writes the second before `backward`.
    pub fn output_and_grad(&mut self) -> (&B::Buf, &mut B::Buf) {
        let l = self.layers.last().expect("planned");
        let [o, d] = self.acts.get_disjoint_mut([l.out, l.dout]).expect("distinct buffers");
        (o, d)
    }
    /// Layer `i`'s output buffer after `forward` (a concatenation's holds the last one computed).
    pub fn layer_output(&self, i: usize) -> &B::Buf {
        &self.acts[self.layers[i].out]
    }
    pub fn param_count(&self) -> usize {
        self.specs.iter().map(|s| s.numel()).sum()
    }

    /// PyTorch-default initialisation (zero-initialised convs included) from `seed`.
    pub fn init_params(&mut self, be: &B, seed: u64) {
        for (i, (spec, buf)) in self.specs.iter().zip(self.params.iter_mut()).enumerate() {
            be.upload_param(&init_param(spec, seed, i), &spec.shape, buf);
        }
        self.params_changed();
    }
    /// Load host parameters given in `specs` order and PyTorch layouts.
    pub fn set_params(&mut self, be: &B, host: &[Vec<f32>]) -> Result<()> {
        if host.len() != self.specs.len() {
            return Err(Error::Config(format!("expected {} parameter tensors, got {}", self.specs.len(), host.len())));
        }
        for ((spec, buf), h) in self.specs.iter().zip(self.params.iter_mut()).zip(host) {
            if h.len() != spec.numel() {
                return Err(Error::Config(format!(
                    "parameter {} has {} elements, expected {} for shape {:?}",
                    spec.key,
                    h.len(),
                    spec.numel(),
                    spec.shape
                )));
            }
            be.upload_param(h, &spec.shape, buf);
        }
        self.params_changed();
        Ok(())
    }
    /// Parameters (or with `grads`, their gradients) as host tensors in PyTorch layouts.
    pub fn host_tensors(&self, be: &B, grads: bool) -> Vec<Vec<f32>> {
        let bufs = if grads { &self.grads } else { &self.params };
        self.specs
            .iter()
            .zip(bufs)
            .map(|(spec, b)| {
                let mut h = vec![0f32; spec.numel()];
                be.download_param(b, &spec.shape, &mut h);
                h
            })
            .collect()
    }
    pub fn zero_grads(&mut self, be: &B) {
        for g in &mut self.grads {
            be.zero(g);
        }
    }

    /// ε̂ = UNet(input, t): one timestep per batch element (the raw index 0..T−1 as a float).
    pub fn forward(&mut self, be: &B, t: &[f32]) {
        assert_eq!(t.len(), self.batch, "one timestep per batch element");
        be.push_range("forward");
        // host work first (weight copies when the parameters changed, the timestep embedding's
        // upload); the rest is one fixed call list, replayed as a graph where the backend can
        self.refresh_derived(be);
        be.upload(&timestep_embedding(t, self.cfg.model_channels), &mut self.temb.sin);
        let key = self.graph_key(0);
        be.replay(key, &mut || self.forward_calls(be));
        be.pop_range();
    }

    /// The forward's device calls (see [`UNet::forward`]).
    fn forward_calls(&mut self, be: &B) {
        let UNet { cfg, params: w, layers, acts, temb: te, scr, lowp, .. } = self;
        // conv weights: the activation-type copy where there is one
        let cw = |i: usize| lowp[i].as_ref().unwrap_or(&w[i]);
        let (n, mc, emb) = (self.batch, cfg.model_channels, cfg.emb_dim());
        let g = cfg.groups;
        // time_embed: Linear, SiLU, Linear; each ResBlock's emb_layers starts with SiLU (shared).
        be.push_range("time_embed");
        be.linear_forward(&mut te.t1, &te.sin, &w[0], &w[1], n, mc, emb);
        be.silu_forward(&mut te.t1s, &te.t1);
        be.linear_forward(&mut te.t2, &te.t1s, &w[2], &w[3], n, emb, emb);
        be.silu_forward(&mut te.emb_silu, &te.t2);
        be.pop_range();
        // which skip concatenations are never stored (their ResBlock reads the parts), decided
        // before the upsampling convs that feed them run: such a conv adds its own bias
        for c in 1..layers.len() {
            let Op::Concat { ca, .. } = layers[c].op else { continue };
            let free = match layers.iter().find(|l| l.input == c).map(|l| &l.op) {
                Some(Op::Res(r)) if r.cat_in => {
                    let cs = ConvShape::new(r.x, r.cout, 3, 1);
                    be.cat_conv_fusable(&acts[layers[c].out], cw(r.p + 2), cw(r.p + 10), cs, ca, g)
                }
                _ => false,
            };
            if let Op::Concat { free: f, .. } = &mut layers[c].op {
                *f = free;
            }
            let u = layers[c].input;
            if let Op::Up { bias, .. } = &mut layers[u].op {
                *bias = free;
            }
        }
        // which ResBlocks' out_layers convs take the GroupNorm statistics of their output for the
        // layer that reads it (both fused: the producer's epilogue, the reader's given statistics)
        let fused_stats = be.fused_conv_out_stats();
        for i in 1..layers.len() {
            let k = layers.iter().position(|l| l.input == i);
            let take = fused_stats
                && match (&layers[i].op, k.map(|k| &layers[k].op)) {
                    (Op::Res(r), Some(reader @ (Op::Res(_) | Op::Out(_)))) => {
                        let out_cs = ConvShape::new(r.x.with_c(r.cout), r.cout, 3, 1);
                        be.gn_conv_fusable(&r.h, cw(r.p + 8), out_cs, true, g)
                            && match reader {
                                Op::Res(c) => {
                                    let in_cs = ConvShape::new(c.x, c.cout, 3, 1);
                                    !c.cat_in && be.gn_conv_fusable(&acts[layers[i].out], cw(c.p + 2), in_cs, false, g)
                                }
                                _ => true,
                            }
                    }
                    _ => false,
                };
            if let Op::Res(r) = &mut layers[i].op {
                r.y_to = k.filter(|_| take);
            }
            match k.map(|k| &mut layers[k].op) {
                Some(Op::Res(c)) => c.x_stats = take,
                Some(Op::Out(o)) => o.stats_given = take,
                _ => {}
            }
        }
        for i in 1..layers.len() {
            let (oi, xi) = (layers[i].out, layers[layers[i].input].out);
            // a skip concatenation is built by the ResBlock that reads it (with its statistics)
            if let Op::Concat { .. } = layers[i].op {
                continue;
            }
            let cat = match &layers[layers[i].input].op {
                Op::Concat { skip, x: xd, ca, cb, free, .. } => {
                    let inp = layers[i].input;
                    let ab = cat_bias(layers, inp);
                    Some((layers[layers[inp].input].out, layers[*skip].out, ab, *xd, *ca, *cb, *free))
                }
                _ => None,
            };
            // a ResBlock that takes its reader's statistics holds that layer's buffers too
            let y_to = match &layers[i].op {
                Op::Res(r) => r.y_to,
                _ => None,
            };
            let (l, reader) = match y_to {
                Some(k) => {
                    let [l, c] = layers.get_disjoint_mut([i, k]).expect("distinct layers");
                    (l, Some(c))
                }
                None => (&mut layers[i], None),
            };
            be.push_range(&l.name);
            // the output and the input; where the input is a concatenation, its two parts
            let (out, x, parts) = match cat {
                Some((hi, si, ..)) => {
                    let [out, x, h, s] = acts.get_disjoint_mut([oi, xi, hi, si]).expect("distinct buffers");
                    (out, x, Some((&*h, &*s)))
                }
                None => {
                    let [out, x] = acts.get_disjoint_mut([oi, xi]).expect("distinct buffers");
                    (out, x, None)
                }
            };
            match &mut l.op {
                Op::Input | Op::Concat { .. } => unreachable!("the input is layer 0; concatenations are above"),
                Op::Conv { p, cs } => be.conv3d_forward(out, x, cw(*p), &w[*p + 1], *cs),
                Op::Res(r) => {
                    let (p, xd, yd) = (r.p, r.x, r.x.with_c(r.cout));
                    // the skip conv, in_layers' conv, out_layers' conv
                    let skip_cs = ConvShape::new(xd, r.cout, 1, 1);
                    let (in_cs, out_cs) = (ConvShape::new(xd, r.cout, 3, 1), ConvShape::new(yd, r.cout, 3, 1));
                    // Biases folded, so no pass only adds one: in_layers' conv bias rides with
                    // the time embedding's, and both reach h as the second GroupNorm's input
                    // offset; out_layers' conv bias rides with the skip branch, onto which that
                    // conv is accumulated (out = skip + conv + biases, cuDNN β = 1).
                    // (b_in and b_out, the folded sums, are refreshed with the weight copies:
                    // `UNet::refresh_derived`)
                    let b_out = r.b_out.as_ref().unwrap_or(&w[p + 9]);
                    let free = cat.is_some_and(|c| c.6);
                    if r.cat_in && free {
                        // the skip concatenation never stored: the skip conv and its GroupNorm
                        // statistics from the two parts (the first carries its bias already)
                        let ((h, sk), (.., ca, _, _)) = (parts.expect("cat_in"), cat.expect("cat_in"));
                        let stats = (&mut r.mean1, &mut r.rstd1);
                        be.concat_skip_conv_stats(out, (h, sk), stats, (cw(p + 10), b_out), skip_cs, ca, g);
                    } else if r.cat_in {
                        // x is the skip concatenation, built here with its GroupNorm statistics;
                        // skip conv first, then GroupNorm+SiLU → conv over it (see
                        // `ResBlock::cat_in`)
                        let ((h, sk), (_, _, ab, cd, ca, cb, _)) = (parts.expect("cat_in"), cat.expect("cat_in"));
                        let stats = (&mut r.mean1, &mut r.rstd1);
                        be.concat_channels_stats(x, h, ab.map(|k| &w[k]), sk, stats, cd, ca, cb, g);
                        be.conv3d_forward_acc((out, Accum::Overwrite), x, cw(p + 10), Some(b_out), skip_cs);
                    }
                    // e = Linear(SiLU(emb)) + in_layers' conv bias + its own: the second GroupNorm's
                    // input offset
                    be.linear_forward(&mut r.e, &te.emb_silu, &w[p + 4], &r.b_in, n, emb, r.cout);
                    // Where both convs fuse, out_layers' GroupNorm statistics of h + e come from
                    // in_layers' conv epilogue (no pass reads h for them)
                    let in_fused = free || be.gn_conv_fusable(x, cw(p + 2), in_cs, false, g);
                    let out_fused = be.gn_conv_fusable(&r.h, cw(p + 8), out_cs, true, g);
                    let h_stats = in_fused && out_fused && be.fused_conv_out_stats();
                    // in_layers: GroupNorm+SiLU → Conv3 into h
                    let (h, (m1, r1), (g1, b1)) =
                        ((&mut r.h, Accum::Overwrite), (&mut r.mean1, &mut r.rstd1), (&w[p], &w[p + 1]));
                    let ys = h_stats.then_some((&mut r.mean2, &mut r.rstd2, Some(&r.e)));
                    if free {
                        let ((hp, sk), (.., ca, _, _)) = (parts.expect("cat_in"), cat.expect("cat_in"));
                        be.groupnorm_silu_conv3d_fused_cat(
                            h.0,
                            (hp, sk),
                            (m1, r1),
                            (g1, b1),
                            cw(p + 2),
                            in_cs,
                            ca,
                            g,
                            ys,
                        );
                    } else if in_fused {
                        // GroupNorm+SiLU as the conv's prologue, silu(GN(x)) never stored (a
                        // concatenation's statistics are given; it keeps its values, which its
                        // backward rebuilds anyway)
                        let wbz = (cw(p + 2), None, None);
                        let fresh = !r.cat_in && !r.x_stats;
                        be.groupnorm_silu_conv3d_fused(h, (x, None), (m1, r1), fresh, (g1, b1), wbz, in_cs, g, ys);
                    } else if r.cat_in {
                        be.groupnorm_silu_recompute_inplace(x, m1, r1, g1, b1, xd, g);
                        be.conv3d_forward_acc(h, x, cw(p + 2), None, in_cs);
                    } else {
                        let [a] = scr.get([(xd.numel(), 0)]);
                        be.groupnorm_silu_forward(a, m1, r1, x, None, g1, b1, xd, g);
                        be.conv3d_forward_acc(h, a, cw(p + 2), None, in_cs);
                    }
                    // out_layers: GroupNorm(h + e)+SiLU → Conv3 added onto the skip branch (a
                    // concatenation's skip conv ran above), or with the identity skip x as the
                    // residual: out = x + conv + bias in one call where the backend can
                    if !r.cat_in && r.b_out.is_some() {
                        be.conv3d_forward_acc((out, Accum::Overwrite), x, cw(p + 10), Some(b_out), skip_cs);
                    }
                    let res = (!r.cat_in && r.b_out.is_none()).then_some(&*x);
                    let (he, st, gb) = ((&r.h, Some(&r.e)), (&mut r.mean2, &mut r.rstd2), (&w[p + 6], &w[p + 7]));
                    // the reader's statistics of out where it takes them (`y_to`)
                    let ys = reader.map(|c| match &mut c.op {
                        Op::Res(c) => (&mut c.mean1, &mut c.rstd1, None),
                        Op::Out(o) => (&mut o.mean, &mut o.rstd, None),
                        _ => unreachable!("y_to names a ResBlock or the head"),
                    });
                    assert!(out_fused || ys.is_none(), "{}: y_to set, out_layers not fused", l.name);
                    if out_fused {
                        let wbz = (cw(p + 8), res.map(|_| b_out), res);
                        be.groupnorm_silu_conv3d_fused((out, Accum::Add), he, st, !h_stats, gb, wbz, out_cs, g, ys);
                    } else {
                        let [a] = scr.get([(yd.numel(), 0)]);
                        be.groupnorm_silu_forward(a, st.0, st.1, he.0, he.1, gb.0, gb.1, yd, g);
                        match res {
                            Some(z) => be.conv3d_forward_res(out, a, cw(p + 8), b_out, z, out_cs),
                            None => be.conv3d_forward_acc((out, Accum::Add), a, cw(p + 8), None, out_cs),
                        }
                    }
                }
                Op::Attn(a) => {
                    let (p, xd) = (a.p, a.x);
                    be.groupnorm_forward(&mut a.gn, &mut a.mean, &mut a.rstd, x, &w[p], &w[p + 1], xd, g);
                    be.conv3d_forward(&mut a.qkv, &a.gn, cw(p + 2), &w[p + 3], ConvShape::new(xd, 3 * xd.c, 1, 1));
                    be.attention_forward(&mut a.a, &mut a.att, &a.qkv, xd, a.heads);
                    // out = x + proj_out(a), the residual and the bias with the conv
                    be.conv3d_forward_res(out, &a.a, cw(p + 4), &w[p + 5], x, ConvShape::new(xd, xd.c, 1, 1));
                }
                Op::Up { p, x: xd, bias } => {
                    // the doubled input in scratch, or inside the conv (a backend's fusion)
                    let [u] = scr.get([(xd.up2().numel(), 1)]);
                    // without its bias where the concatenation that reads `out` adds it (`cat_bias`)
                    let cs = ConvShape::new(xd.up2(), xd.c, 3, 1);
                    be.upsample_conv3d_forward(out, u, x, *xd, cw(*p), bias.then(|| &w[*p + 1]), cs);
                }
                Op::Out(o) => {
                    // GN → SiLU → Conv3 in one call: a backend may fuse it (`a` then unwritten)
                    let (p, xd) = (o.p, o.x);
                    let [a] = scr.get([(xd.numel(), 0)]);
                    let (stats, gb, wb) = ((&mut o.mean, &mut o.rstd), (&w[p], &w[p + 1]), (cw(p + 2), &w[p + 3]));
                    let cs = ConvShape::new(xd, o.cout, 3, 1);
                    be.groupnorm_silu_conv3d_forward(out, a, stats, !o.stats_given, x, gb, wb, cs, g);
                }
            }
            be.pop_range();
        }
    }

    /// Parameter gradients (accumulated into `grads`) from ∂loss/∂ε̂ already in the last layer's
    /// `dout` (see [`UNet::output_and_grad`]). Needs the activations of the last `forward`.
    pub fn backward(&mut self, be: &B) {
        be.push_range("backward");
        let key = self.graph_key(1);
        be.replay(key, &mut || self.backward_calls(be, &mut |_, _| {}));
        be.pop_range();
    }

    /// [`UNet::backward`], calling `done(i, grads)` once layer `i`'s backward is queued (its
    /// parameter gradients are final from then on) and `done(0, grads)` at the very end, when the
    /// time embedding's are too. Data-parallel training starts gradient all-reduces from here
    /// (`dist::buckets`). A hook that launches collectives mid-backward can not be captured into a
    /// replayed graph: this path always launches from the host.
    pub fn backward_with(&mut self, be: &B, done: &mut dyn FnMut(usize, &mut [B::Buf])) {
        be.push_range("backward");
        self.backward_calls(be, done);
        be.pop_range();
    }

    /// The backward's device calls (see [`UNet::backward`]), reporting finished layers to `done`.
    fn backward_calls(&mut self, be: &B, done: &mut dyn FnMut(usize, &mut [B::Buf])) {
        let UNet { cfg, params: w, grads: dw, layers, acts, temb: te, scr, scr_att, lowp, .. } = self;
        let cw = |i: usize| lowp[i].as_ref().unwrap_or(&w[i]);
        let (n, mc, emb, g) = (self.batch, cfg.model_channels, cfg.emb_dim(), cfg.groups);
        be.zero(&mut te.d_emb_silu);
        for i in (1..layers.len()).rev() {
            let inp = layers[i].input;
            let (di, xi, dxi) = (layers[i].dout, layers[inp].out, layers[inp].dout);
            be.push_range(&layers[i].name);
            // an input that is a concatenation was not kept: its only reader, the `cat_in`
            // ResBlock, reads it from its two parts (`groupnorm_silu_backward_cat_in`)
            let ab = match layers[inp].op {
                Op::Concat { .. } => cat_bias(layers, inp),
                _ => None,
            };
            let mode = layers[i].mode;
            if let Op::Concat { .. } = &layers[i].op {
                // its consumer, the `cat_in` ResBlock after it, delivered both parts' gradients
                be.pop_range();
                done(i, dw);
                continue;
            }
            // the output gradient, the input (where it is a concatenation: its buffer, which the
            // block fills), the input's gradient, and where the input is a concatenation its two
            // parts, their gradients with their modes
            let cat_parts = match &layers[inp].op {
                Op::Concat { skip, skip_mode, ca, cb, .. } => {
                    let (hp, sp) = (layers[layers[inp].input].dout, layers[*skip].dout);
                    let (hi, si) = (layers[layers[inp].input].out, layers[*skip].out);
                    Some((hp, sp, hi, si, layers[inp].mode, *skip_mode, (*ca, *cb)))
                }
                _ => None,
            };
            let (dout, x, dx, parts) = match cat_parts {
                Some((hp, sp, hi, si, mh, msk, cacb)) => {
                    let ids = [di, xi, dxi, hp, sp, hi, si];
                    let [dout, x, dx, gh, gs, h, s] = acts.get_disjoint_mut(ids).expect("distinct buffers");
                    (dout, x, dx, Some(((gh, mh), (gs, msk), (&*h, &*s), cacb)))
                }
                None => {
                    let [dout, x, dx] = acts.get_disjoint_mut([di, xi, dxi]).expect("distinct buffers");
                    (dout, x, dx, None)
                }
            };
            let dout = &*dout;
            match &mut layers[i].op {
                Op::Input | Op::Concat { .. } => unreachable!("the input is layer 0; concatenations are above"),
                Op::Conv { p, cs } => {
                    let [gw, gb] = dw.get_disjoint_mut([*p, *p + 1]).expect("distinct");
                    let dinp = if inp == 0 { None } else { Some((dx, mode)) };
                    be.conv3d_backward(dinp, gw, Some(gb), dout, x, cw(*p), *cs);
                }
                Op::Res(r) => {
                    let (p, xd, yd) = (r.p, r.x, r.x.with_c(r.cout));
                    let (xn, yn) = (xd.numel(), yd.numel());
                    // Bias gradients from channel sums taken once: out_layers' conv and the skip
                    // conv both have Σ dout (taken with out_layers' data gradient, below);
                    // in_layers' conv has Σₙ de (below).
                    // skip branch first: it sets dx per `mode`, the main branch then adds (a
                    // `cat_in` block adds its skip branch last, below)
                    // (an identity skip's dout rides in in_layers' GroupNorm+SiLU backward, below)
                    if r.cat_in {
                    } else if xd.c != r.cout {
                        let cs = ConvShape::new(xd, r.cout, 1, 1);
                        be.conv3d_backward(Some((&mut *dx, mode)), &mut dw[p + 10], None, dout, x, cw(p + 10), cs);
                    }
                    // out_layers: Conv3's data gradient → slot 1 (and Σ dout); GroupNorm+SiLU
                    // backward → dh in slot 2, recomputing SiLU(GroupNorm(h)) into slot 0 on the
                    // way; Conv3's weight gradient from it.
                    let [a, da, dh] = scr.get([(yn, 0), (yn, 1), (yn, 2)]);
                    let cs = ConvShape::new(yd, r.cout, 3, 1);
                    let [gg, gb] = dw.get_disjoint_mut([p + 6, p + 7]).expect("distinct");
                    // with dh's channel sums, the gradient of emb_layers' output (h + Linear(SiLU(emb)),
                    // broadcast over voxels: the GroupNorm's input offset)
                    let gn = GnSiluBack {
                        dinp: (&mut *dh, Accum::Overwrite),
                        dsum: Some(&mut r.de),
                        res: None,
                        act: &mut *a,
                        dgb: (gg, gb),
                        inp: &r.h,
                        off: Some(&r.e),
                        ms: (&r.mean2, &r.rstd2),
                        gb: (&w[p + 6], &w[p + 7]),
                        x: yd,
                        groups: g,
                        dout_sum: Some(&mut r.ds),
                    };
                    be.conv3d_backward_data_gn(da, dout, cw(p + 8), cs, gn);
                    be.bias_grad_rows(&mut dw[p + 9], &r.ds, n, r.cout);
                    if xd.c != r.cout {
                        be.bias_grad_rows(&mut dw[p + 11], &r.ds, n, r.cout);
                    }
                    be.conv3d_backward(None, &mut dw[p + 8], None, dout, a, cw(p + 8), cs);
                    let [gw, gb] = dw.get_disjoint_mut([p + 4, p + 5]).expect("distinct");
                    let de_silu = Some((&mut te.d_emb_silu, Accum::Add));
                    be.linear_backward(de_silu, gw, gb, &r.de, &te.emb_silu, &w[p + 4], n, emb, r.cout);
                    be.bias_grad_rows(&mut dw[p + 3], &r.de, n, r.cout);
                    if r.cat_in {
                        // in_layers over the concatenation cat([h, skip]): the conv's data
                        // gradient into dx; then in one call the skip conv's weight gradient, the
                        // GroupNorm+SiLU backward (x, the concatenation's buffer, receives
                        // SiLU(GroupNorm(x))), the skip conv's data gradient, and the sum
                        // delivered to the concatenation's two parts (the Concat layer's backward
                        // is empty); the conv's weight gradient last.
                        let [dh] = scr.get([(yn, 2)]);
                        let cs1 = ConvShape::new(xd, r.cout, 1, 1);
                        let cs = ConvShape::new(xd, r.cout, 3, 1);
                        be.conv3d_backward_data((&mut *dx, Accum::Overwrite), dh, cw(p + 2), cs);
                        let [gg, gb, gw1] = dw.get_disjoint_mut([p, p + 1, p + 10]).expect("distinct");
                        let (ms, gmb) = ((&r.mean1, &r.rstd1), (&w[p], &w[p + 1]));
                        let (ph, ps, (h, s), cacb) = parts.expect("a cat_in block reads a concatenation");
                        let cat = (h, ab.map(|k| &w[k]), s);
                        let skip = (dout, &r.ds, cw(p + 10), gw1, cs1);
                        be.groupnorm_silu_backward_cat_in(dx, x, cat, (ph, ps), (gg, gb), ms, gmb, skip, cacb, g);
                        be.conv3d_backward(None, &mut dw[p + 2], None, dh, x, cw(p + 2), cs);
                        be.pop_range();
                        done(i, dw);
                        continue;
                    }
                    // in_layers: Conv3's data gradient; GroupNorm+SiLU backward added into dx
                    // (with an identity skip, dx per `mode` += dout + it, in one pass),
                    // recomputing GroupNorm+SiLU of x on the way; Conv3's weight gradient.
                    let [dh, a, da] = scr.get([(yn, 2), (xn, 0), (xn, 1)]);
                    let cs = ConvShape::new(xd, r.cout, 3, 1);
                    let [gg, gb] = dw.get_disjoint_mut([p, p + 1]).expect("distinct");
                    let res = xd.c == r.cout;
                    let gn = GnSiluBack {
                        dinp: (&mut *dx, if res { mode } else { Accum::Add }),
                        dsum: None,
                        res: res.then_some(dout),
                        act: &mut *a,
                        dgb: (gg, gb),
                        inp: x,
                        off: None,
                        ms: (&r.mean1, &r.rstd1),
                        gb: (&w[p], &w[p + 1]),
                        x: xd,
                        groups: g,
                        dout_sum: None,
                    };
                    be.conv3d_backward_data_gn(da, dh, cw(p + 2), cs, gn);
                    be.conv3d_backward(None, &mut dw[p + 2], None, dh, a, cw(p + 2), cs);
                }
                Op::Attn(a) => {
                    let (p, xd) = (a.p, a.x);
                    let (xn, qn, an) = (xd.numel(), 3 * xd.numel(), a.att_len());
                    if mode == Accum::Add {
                        be.add_assign(dx, dout);
                    } else {
                        be.copy(dx, dout);
                    }
                    let [da, dqkv] = scr.get([(xn, 0), (qn, 0)]);
                    let [datt] = scr_att.get([(an, 0)]);
                    let [gw, gb] = dw.get_disjoint_mut([p + 4, p + 5]).expect("distinct");
                    let cs = ConvShape::new(xd, xd.c, 1, 1);
                    be.conv3d_backward(Some((da, Accum::Overwrite)), gw, Some(gb), dout, &a.a, cw(p + 4), cs);
                    be.attention_backward(dqkv, datt, da, &a.qkv, &a.att, xd, a.heads);
                    let [dqkv, dgn] = scr.get([(qn, 0), (xn, 1)]);
                    let [gw, gb] = dw.get_disjoint_mut([p + 2, p + 3]).expect("distinct");
                    let cs = ConvShape::new(xd, 3 * xd.c, 1, 1);
                    be.conv3d_backward(Some((dgn, Accum::Overwrite)), gw, Some(gb), dqkv, &a.gn, cw(p + 2), cs);
                    let [gg, gb] = dw.get_disjoint_mut([p, p + 1]).expect("distinct");
                    be.groupnorm_backward((dx, Accum::Add), gg, gb, dgn, x, &a.mean, &a.rstd, &w[p], xd, g);
                }
                Op::Up { p, x: xd, .. } => {
                    // the conv's gradients, its upsampled input recomputed (slot 1; or inside the
                    // data gradient, a backend's fusion); the input's gradient → slot 0
                    let [du, u] = scr.get([(xd.up2().numel(), 0), (xd.up2().numel(), 1)]);
                    let [gw, gb] = dw.get_disjoint_mut([*p, *p + 1]).expect("distinct");
                    let cs = ConvShape::new(xd.up2(), xd.c, 3, 1);
                    be.upsample_conv3d_backward(du, u, gw, Some(gb), dout, x, *xd, cw(*p), cs);
                    be.upsample_backward((dx, mode), du, *xd);
                }
                Op::Out(o) => {
                    let (p, xd) = (o.p, o.x);
                    let xo = &*x;
                    // the conv's data gradient; GroupNorm+SiLU backward, recomputing the conv's
                    // input on the way; the conv's weight and bias gradients
                    let [a, da] = scr.get([(xd.numel(), 0), (xd.numel(), 1)]);
                    let cs = ConvShape::new(xd, o.cout, 3, 1);
                    let [gg, gb] = dw.get_disjoint_mut([p, p + 1]).expect("distinct");
                    let gn = GnSiluBack {
                        dinp: (dx, mode),
                        dsum: None,
                        res: None,
                        act: &mut *a,
                        dgb: (gg, gb),
                        inp: xo,
                        off: None,
                        ms: (&o.mean, &o.rstd),
                        gb: (&w[p], &w[p + 1]),
                        x: xd,
                        groups: g,
                        dout_sum: None,
                    };
                    be.conv3d_backward_data_gn(da, dout, cw(p + 2), cs, gn);
                    let [gw, gb] = dw.get_disjoint_mut([p + 2, p + 3]).expect("distinct");
                    be.conv3d_backward(None, gw, Some(gb), dout, a, cw(p + 2), cs);
                }
            }
            be.pop_range();
            done(i, dw);
        }
        // time_embed backward: SiLU (emb_layers), Linear 2, SiLU, Linear 0 (no input grad).
        be.push_range("time_embed");
        be.silu_backward((&mut te.d2, Accum::Overwrite), &te.d_emb_silu, &te.t2);
        let [gw, gb] = dw.get_disjoint_mut([2, 3]).expect("distinct");
        be.linear_backward(Some((&mut te.d1, Accum::Overwrite)), gw, gb, &te.d2, &te.t1s, &w[2], n, emb, emb);
        be.silu_backward((&mut te.d2, Accum::Overwrite), &te.d1, &te.t1);
        let [gw, gb] = dw.get_disjoint_mut([0, 1]).expect("distinct");
        be.linear_backward(None, gw, gb, &te.d2, &te.sin, &w[0], n, mc, emb);
        be.pop_range();
        done(0, dw);
    }
}
