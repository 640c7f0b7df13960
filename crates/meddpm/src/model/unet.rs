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

use super::config::UNetConfig;
use super::params::{init_param, node_params, topology, Node, ParamSpec};
use crate::backend::{Accum, Backend};
use crate::error::{Error, Result};
use crate::shape::{ConvShape, Dims};

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
    h: B::Buf,
    e: B::Buf,
    mean2: B::Buf,
    rstd2: B::Buf,
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
    /// Upsample: `u` holds the trilinear ×2 result that the conv reads.
    Up {
        p: usize,
        x: Dims,
        u: B::Buf,
    },
    /// cat([h, skip]) where h is the `input` layer's output and skip the `skip` layer's.
    Concat {
        skip: usize,
        skip_mode: Accum,
        x: Dims,
        ca: usize,
        cb: usize,
    },
    Out(OutHead<B>),
}

/// One planned layer: its op, which layer feeds it, how it writes its input's gradient, its
/// output (logical shape `y`) and the gradient of that output.
pub struct Layer<B: Backend> {
    /// The reference module path of the block (`input_blocks.1.0`, `output_blocks.2.cat`, `out`):
    /// the range name profilers see (see [`Backend::push_range`]).
    pub name: String,
    pub op: Op<B>,
    pub input: usize,
    pub mode: Accum,
    pub y: Dims,
    pub out: B::Buf,
    pub dout: B::Buf,
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

/// Scratch: up to four buffers for every distinct tensor size (backends check exact lengths, so
/// scratch comes in exact sizes; there are few sizes). Slot roles around a GroupNorm+SiLU+conv:
/// 0 the GroupNorm output, 1 the SiLU output (then the SiLU-backward temporary), 2 the gradient
/// of the conv input, 3 the gradient inside a ResBlock (dh). GroupNorm+SiLU outputs are not kept
/// from forward to backward: backward recomputes them into slots 0 and 1 from the saved input and
/// statistics, which halves what a ResBlock keeps (the largest tensors at 128³).
struct Scratch<B: Backend> {
    bufs: Vec<B::Buf>,
    base: std::collections::HashMap<usize, usize>,
}

impl<B: Backend> Scratch<B> {
    /// Distinct scratch buffers, each named by (element count, slot 0..3). Data stays in a
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
    pub params: Vec<B::Buf>,
    pub grads: Vec<B::Buf>,
    pub layers: Vec<Layer<B>>,
    temb: TimeEmbed<B>,
    scr: Scratch<B>,
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
        let mut bytes = 0usize;
        let mut alloc = |len: usize| -> Result<B::Buf> {
            bytes += len * 4;
            be.alloc(len)
        };
        let mut specs = Vec::new();
        let mut layers: Vec<Layer<B>> = Vec::new();
        let sp_dims = |c: usize, sp: [usize; 3]| Dims::new(n, c, sp[0], sp[1], sp[2]);
        let input_dims = sp_dims(cfg.in_channels, [cfg.depth, cfg.size, cfg.size]);
        layers.push(Layer {
            name: "input".into(),
            op: Op::Input,
            input: 0,
            mode: Accum::Overwrite,
            y: input_dims,
            out: alloc(input_dims.numel())?,
            dout: alloc(0)?,
        });
        let mut skips: Vec<usize> = Vec::new();
        // scratch slots needed per tensor size (see `Scratch` for the slot roles)
        let mut sizes = std::collections::BTreeMap::<usize, usize>::new();
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
                    (Op::Conv { p, cs }, cs.out(), prev)
                }
                Node::Down { c, sp, .. } => {
                    let cs = ConvShape::new(sp_dims(c, sp), c, 3, 2);
                    (Op::Conv { p, cs }, cs.out(), prev)
                }
                Node::Res { cin, cout, sp, .. } => {
                    let x = sp_dims(cin, sp);
                    let y = x.with_c(cout);
                    need(n * cout, 1);
                    need(x.numel(), 4);
                    need(y.numel(), 4);
                    let r = ResBlock {
                        p,
                        x,
                        cout,
                        mean1: alloc(n * g)?,
                        rstd1: alloc(n * g)?,
                        h: alloc(y.numel())?,
                        e: alloc(n * cout)?,
                        mean2: alloc(n * g)?,
                        rstd2: alloc(n * g)?,
                    };
                    (Op::Res(r), y, prev)
                }
                Node::Attn { c, sp, .. } => {
                    let x = sp_dims(c, sp);
                    let t = x.s();
                    let att_len = n * cfg.num_heads * t * t;
                    need(x.numel(), 3);
                    need(3 * x.numel(), 2);
                    need(att_len, 3);
                    let a = AttnBlock {
                        p,
                        x,
                        heads: cfg.num_heads,
                        gn: alloc(x.numel())?,
                        mean: alloc(n * g)?,
                        rstd: alloc(n * g)?,
                        qkv: alloc(3 * x.numel())?,
                        att: alloc(att_len)?,
                        a: alloc(x.numel())?,
                    };
                    (Op::Attn(a), x, prev)
                }
                Node::Up { c, sp, .. } => {
                    let x = sp_dims(c, sp);
                    need(x.up2().numel(), 1);
                    (Op::Up { p, x, u: alloc(x.up2().numel())? }, x.up2(), prev)
                }
                Node::PopConcat { h_c, skip_c, sp } => {
                    let skip = skips.pop().expect("topology pops no more than it pushes");
                    let x = sp_dims(h_c, sp);
                    let op = Op::Concat { skip, skip_mode: Accum::Overwrite, x, ca: h_c, cb: skip_c };
                    (op, x.with_c(h_c + skip_c), prev)
                }
                Node::Out { c, cout, sp } => {
                    let x = sp_dims(c, sp);
                    need(x.numel(), 4);
                    let o = OutHead { p, x, cout, mean: alloc(n * g)?, rstd: alloc(n * g)? };
                    (Op::Out(o), x.with_c(cout), prev)
                }
            };
            layers.push(Layer {
                name,
                op,
                input,
                mode: Accum::Overwrite,
                y,
                out: alloc(y.numel())?,
                dout: alloc(y.numel())?,
            });
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
        let temb = TimeEmbed {
            sin: alloc(n * cfg.model_channels)?,
            t1: alloc(n * emb)?,
            t1s: alloc(n * emb)?,
            t2: alloc(n * emb)?,
            emb_silu: alloc(n * emb)?,
            d_emb_silu: alloc(n * emb)?,
            d1: alloc(n * emb)?,
            d2: alloc(n * emb)?,
        };
        let mut scr = Scratch { bufs: Vec::new(), base: Default::default() };
        for (len, slots) in sizes {
            scr.base.insert(len, scr.bufs.len());
            for _ in 0..slots {
                scr.bufs.push(alloc(len)?);
            }
        }
        let params = specs.iter().map(|s| be.alloc(s.numel())).collect::<Result<Vec<_>>>()?;
        let grads = specs.iter().map(|s| be.alloc(s.numel())).collect::<Result<Vec<_>>>()?;
        Ok(UNet { cfg: cfg.clone(), batch, specs, params, grads, layers, temb, scr, act_bytes: bytes })
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
        &mut self.layers[0].out
    }
    /// ε̂ after `forward`.
    pub fn output(&self) -> &B::Buf {
        &self.layers.last().expect("planned").out
    }
    /// (ε̂, ∂loss/∂ε̂): the loss writes the second before `backward`.
    pub fn output_and_grad(&mut self) -> (&B::Buf, &mut B::Buf) {
        let l = self.layers.last_mut().expect("planned");
        (&l.out, &mut l.dout)
    }
    pub fn param_count(&self) -> usize {
        self.specs.iter().map(|s| s.numel()).sum()
    }

    /// PyTorch-default initialisation (zero-initialised convs included) from `seed`.
    pub fn init_params(&mut self, be: &B, seed: u64) {
        for (i, (spec, buf)) in self.specs.iter().zip(self.params.iter_mut()).enumerate() {
            be.upload_param(&init_param(spec, seed, i), &spec.shape, buf);
        }
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
        let UNet { cfg, params: w, layers, temb: te, scr, .. } = self;
        let (n, mc, emb) = (t.len(), cfg.model_channels, cfg.emb_dim());
        let g = cfg.groups;
        // time_embed: Linear, SiLU, Linear; each ResBlock's emb_layers starts with SiLU (shared).
        be.push_range("time_embed");
        be.upload(&timestep_embedding(t, mc), &mut te.sin);
        be.linear_forward(&mut te.t1, &te.sin, &w[0], &w[1], n, mc, emb);
        be.silu_forward(&mut te.t1s, &te.t1);
        be.linear_forward(&mut te.t2, &te.t1s, &w[2], &w[3], n, emb, emb);
        be.silu_forward(&mut te.emb_silu, &te.t2);
        be.pop_range();
        for i in 1..layers.len() {
            let (prev, rest) = layers.split_at_mut(i);
            let l = &mut rest[0];
            let x = &prev[l.input].out;
            be.push_range(&l.name);
            match &mut l.op {
                Op::Input => unreachable!("the input is layer 0 only"),
                Op::Conv { p, cs } => be.conv3d_forward(&mut l.out, x, &w[*p], &w[*p + 1], *cs),
                Op::Res(r) => {
                    let (p, xd, yd) = (r.p, r.x, r.x.with_c(r.cout));
                    let skip_conv = xd.c != r.cout;
                    let [gn, a] = scr.get([(xd.numel(), 0), (xd.numel(), 1)]);
                    be.groupnorm_silu_forward(gn, a, &mut r.mean1, &mut r.rstd1, x, &w[p], &w[p + 1], xd, g);
                    be.conv3d_forward(&mut r.h, a, &w[p + 2], &w[p + 3], ConvShape::new(xd, r.cout, 3, 1));
                    be.linear_forward(&mut r.e, &te.emb_silu, &w[p + 4], &w[p + 5], n, emb, r.cout);
                    be.add_channel_bias(&mut r.h, &r.e, yd);
                    let [gn, a] = scr.get([(yd.numel(), 0), (yd.numel(), 1)]);
                    be.groupnorm_silu_forward(gn, a, &mut r.mean2, &mut r.rstd2, &r.h, &w[p + 6], &w[p + 7], yd, g);
                    if skip_conv {
                        // out = skip_connection(x) + out_layers(h). The main branch goes through
                        // `dout` as scratch: backward overwrites it before reading it.
                        be.conv3d_forward(&mut l.out, x, &w[p + 10], &w[p + 11], ConvShape::new(xd, r.cout, 1, 1));
                        be.conv3d_forward(&mut l.dout, a, &w[p + 8], &w[p + 9], ConvShape::new(yd, r.cout, 3, 1));
                        be.add_assign(&mut l.out, &l.dout);
                    } else {
                        be.conv3d_forward(&mut l.out, a, &w[p + 8], &w[p + 9], ConvShape::new(yd, r.cout, 3, 1));
                        be.add_assign(&mut l.out, x);
                    }
                }
                Op::Attn(a) => {
                    let (p, xd) = (a.p, a.x);
                    be.groupnorm_forward(&mut a.gn, &mut a.mean, &mut a.rstd, x, &w[p], &w[p + 1], xd, g);
                    be.conv3d_forward(&mut a.qkv, &a.gn, &w[p + 2], &w[p + 3], ConvShape::new(xd, 3 * xd.c, 1, 1));
                    be.attention_forward(&mut a.a, &mut a.att, &a.qkv, xd, a.heads);
                    be.conv3d_forward(&mut l.out, &a.a, &w[p + 4], &w[p + 5], ConvShape::new(xd, xd.c, 1, 1));
                    be.add_assign(&mut l.out, x);
                }
                Op::Up { p, x: xd, u } => {
                    be.upsample_forward(u, x, *xd);
                    be.conv3d_forward(&mut l.out, u, &w[*p], &w[*p + 1], ConvShape::new(xd.up2(), xd.c, 3, 1));
                }
                Op::Concat { skip, x: xd, ca, cb, .. } => {
                    be.concat_channels(&mut l.out, x, &prev[*skip].out, *xd, *ca, *cb);
                }
                Op::Out(o) => {
                    let (p, xd) = (o.p, o.x);
                    let [gn, a] = scr.get([(xd.numel(), 0), (xd.numel(), 1)]);
                    be.groupnorm_silu_forward(gn, a, &mut o.mean, &mut o.rstd, x, &w[p], &w[p + 1], xd, g);
                    be.conv3d_forward(&mut l.out, a, &w[p + 2], &w[p + 3], ConvShape::new(xd, o.cout, 3, 1));
                }
            }
            be.pop_range();
        }
        be.pop_range();
    }

    /// Parameter gradients (accumulated into `grads`) from ∂loss/∂ε̂ already in the last layer's
    /// `dout` (see [`UNet::output_and_grad`]). Needs the activations of the last `forward`.
    pub fn backward(&mut self, be: &B) {
        self.backward_with(be, &mut |_, _| {});
    }

    /// [`UNet::backward`], calling `done(i, grads)` once layer `i`'s backward is queued (its
    /// parameter gradients are final from then on) and `done(0, grads)` at the very end, when the
    /// time embedding's are too. Data-parallel training starts gradient all-reduces from here
    /// (`dist::buckets`).
    pub fn backward_with(&mut self, be: &B, done: &mut dyn FnMut(usize, &mut [B::Buf])) {
        let UNet { cfg, params: w, grads: dw, layers, temb: te, scr, .. } = self;
        let (n, mc, emb, g) = (self.batch, cfg.model_channels, cfg.emb_dim(), cfg.groups);
        be.push_range("backward");
        be.zero(&mut te.d_emb_silu);
        for i in (1..layers.len()).rev() {
            let (prev, rest) = layers.split_at_mut(i);
            let l = &mut rest[0];
            let mode = l.mode;
            be.push_range(&l.name);
            match &mut l.op {
                Op::Input => unreachable!("the input is layer 0 only"),
                Op::Conv { p, cs } => {
                    let [gw, gb] = dw.get_disjoint_mut([*p, *p + 1]).expect("distinct");
                    let src = &mut prev[l.input];
                    let dinp = if l.input == 0 { None } else { Some((&mut src.dout, mode)) };
                    be.conv3d_backward(dinp, gw, gb, &l.dout, &src.out, &w[*p], *cs);
                }
                Op::Res(r) => {
                    let (p, xd, yd) = (r.p, r.x, r.x.with_c(r.cout));
                    let (xn, yn, en) = (xd.numel(), yd.numel(), n * r.cout);
                    let src = &mut prev[l.input];
                    let (x, dx) = (&src.out, &mut src.dout);
                    // skip branch first: it sets dx per `mode`, the main branch then adds.
                    if xd.c != r.cout {
                        let [gw, gb] = dw.get_disjoint_mut([p + 10, p + 11]).expect("distinct");
                        let cs = ConvShape::new(xd, r.cout, 1, 1);
                        be.conv3d_backward(Some((dx, mode)), gw, gb, &l.dout, x, &w[p + 10], cs);
                    } else if mode == Accum::Add {
                        be.add_assign(dx, &l.dout);
                    } else {
                        be.copy(dx, &l.dout);
                    }
                    // out_layers: recompute GroupNorm+SiLU of h into slots 0, 1; Conv3 backward
                    // → slot 2; GroupNorm+SiLU backward → dh in slot 3.
                    let [gn, a, da, dh] = scr.get([(yn, 0), (yn, 1), (yn, 2), (yn, 3)]);
                    let (m, rs) = (&mut r.mean2, &mut r.rstd2);
                    be.groupnorm_silu_forward(gn, a, m, rs, &r.h, &w[p + 6], &w[p + 7], yd, g);
                    let [gw, gb] = dw.get_disjoint_mut([p + 8, p + 9]).expect("distinct");
                    let cs = ConvShape::new(yd, r.cout, 3, 1);
                    be.conv3d_backward(Some((da, Accum::Overwrite)), gw, gb, &l.dout, a, &w[p + 8], cs);
                    let [gg, gb] = dw.get_disjoint_mut([p + 6, p + 7]).expect("distinct");
                    let (m, rs) = (&r.mean2, &r.rstd2);
                    be.groupnorm_silu_backward(
                        (dh, Accum::Overwrite),
                        gg,
                        gb,
                        a,
                        da,
                        gn,
                        &r.h,
                        m,
                        rs,
                        &w[p + 6],
                        yd,
                        g,
                    );
                    // emb_layers: h += Linear(SiLU(emb)), broadcast over voxels
                    let [dh, de] = scr.get([(yn, 3), (en, 0)]);
                    be.channel_sum(de, dh, yd);
                    let [gw, gb] = dw.get_disjoint_mut([p + 4, p + 5]).expect("distinct");
                    let de_silu = Some((&mut te.d_emb_silu, Accum::Add));
                    be.linear_backward(de_silu, gw, gb, de, &te.emb_silu, &w[p + 4], n, emb, r.cout);
                    // in_layers: recompute GroupNorm+SiLU of x; Conv3 backward; GroupNorm+SiLU
                    // backward added into dx.
                    let [dh, gn, a, da] = scr.get([(yn, 3), (xn, 0), (xn, 1), (xn, 2)]);
                    let (m, rs) = (&mut r.mean1, &mut r.rstd1);
                    be.groupnorm_silu_forward(gn, a, m, rs, x, &w[p], &w[p + 1], xd, g);
                    let [gw, gb] = dw.get_disjoint_mut([p + 2, p + 3]).expect("distinct");
                    let cs = ConvShape::new(xd, r.cout, 3, 1);
                    be.conv3d_backward(Some((da, Accum::Overwrite)), gw, gb, dh, a, &w[p + 2], cs);
                    let [gg, gb] = dw.get_disjoint_mut([p, p + 1]).expect("distinct");
                    let (m, rs) = (&r.mean1, &r.rstd1);
                    be.groupnorm_silu_backward((dx, Accum::Add), gg, gb, a, da, gn, x, m, rs, &w[p], xd, g);
                }
                Op::Attn(a) => {
                    let (p, xd) = (a.p, a.x);
                    let (xn, qn, an) = (xd.numel(), 3 * xd.numel(), a.att_len());
                    let src = &mut prev[l.input];
                    let (x, dx) = (&src.out, &mut src.dout);
                    if mode == Accum::Add {
                        be.add_assign(dx, &l.dout);
                    } else {
                        be.copy(dx, &l.dout);
                    }
                    let [da, dqkv, datt] = scr.get([(xn, 0), (qn, 1), (an, 2)]);
                    let [gw, gb] = dw.get_disjoint_mut([p + 4, p + 5]).expect("distinct");
                    let cs = ConvShape::new(xd, xd.c, 1, 1);
                    be.conv3d_backward(Some((da, Accum::Overwrite)), gw, gb, &l.dout, &a.a, &w[p + 4], cs);
                    be.attention_backward(dqkv, datt, da, &a.qkv, &a.att, xd, a.heads);
                    let [dqkv, dgn] = scr.get([(qn, 1), (xn, 2)]);
                    let [gw, gb] = dw.get_disjoint_mut([p + 2, p + 3]).expect("distinct");
                    let cs = ConvShape::new(xd, 3 * xd.c, 1, 1);
                    be.conv3d_backward(Some((dgn, Accum::Overwrite)), gw, gb, dqkv, &a.gn, &w[p + 2], cs);
                    let [gg, gb] = dw.get_disjoint_mut([p, p + 1]).expect("distinct");
                    be.groupnorm_backward((dx, Accum::Add), gg, gb, dgn, x, &a.mean, &a.rstd, &w[p], xd, g);
                }
                Op::Up { p, x: xd, u } => {
                    let [du] = scr.get([(xd.up2().numel(), 0)]);
                    let [gw, gb] = dw.get_disjoint_mut([*p, *p + 1]).expect("distinct");
                    let cs = ConvShape::new(xd.up2(), xd.c, 3, 1);
                    be.conv3d_backward(Some((du, Accum::Overwrite)), gw, gb, &l.dout, u, &w[*p], cs);
                    be.upsample_backward((&mut prev[l.input].dout, mode), du, *xd);
                }
                Op::Concat { skip, skip_mode, x: xd, ca, cb } => {
                    let [h, s] = prev.get_disjoint_mut([l.input, *skip]).expect("h and skip are distinct layers");
                    be.split_channels((&mut h.dout, mode), (&mut s.dout, *skip_mode), &l.dout, *xd, *ca, *cb);
                }
                Op::Out(o) => {
                    let (p, xd) = (o.p, o.x);
                    let src = &mut prev[l.input];
                    let (dx, xo) = (&mut src.dout, &src.out);
                    let [gn, a, da] = scr.get([(xd.numel(), 0), (xd.numel(), 1), (xd.numel(), 2)]);
                    be.groupnorm_silu_forward(gn, a, &mut o.mean, &mut o.rstd, xo, &w[p], &w[p + 1], xd, g);
                    let [gw, gb] = dw.get_disjoint_mut([p + 2, p + 3]).expect("distinct");
                    let cs = ConvShape::new(xd, o.cout, 3, 1);
                    be.conv3d_backward(Some((da, Accum::Overwrite)), gw, gb, &l.dout, a, &w[p + 2], cs);
                    let [gg, gb] = dw.get_disjoint_mut([p, p + 1]).expect("distinct");
                    be.groupnorm_silu_backward((dx, mode), gg, gb, a, da, gn, xo, &o.mean, &o.rstd, &w[p], xd, g);
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
        be.pop_range();
        done(0, dw);
    }
}
