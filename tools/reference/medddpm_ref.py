"""Self-contained PyTorch reference of the Med-DDPM denoiser and its diffusion buffers.

What: guided-diffusion's ``UNetModel`` (dims=3) with Med-DDPM's changes, re-written from
``shared/docs/medddpm-spec.md`` §2-§4 (reference code: mobaidoctor/med-ddpm
``diffusion_model/{unet,modules,trainer}.py``), plus the cosine schedule (T=250, s=0.008) and a
``GaussianDiffusion`` wrapper whose state dict has the 13 schedule buffers and the UNet under
``denoise_fn.``, exactly like a real Med-DDPM checkpoint's ``'model'`` / ``'ema'`` dicts.

Why: it produces golden files (forward output, loss and every parameter gradient) for the Rust
engine, key lists for the real configurations, and ``.pt`` fixtures for the checkpoint reader.

Semantics kept from the reference (do not "fix"):
  * timestep embedding: max_period 1000 (not 10000), concatenation [cos, sin], cos first;
  * ResBlock: GN -> SiLU -> Conv3; + Linear(SiLU(emb)) as a per-channel bias; GN -> SiLU ->
    Dropout(0) -> Conv3 (zero-init); skip = identity or Conv1;
  * AttentionBlock: GN, Conv1d qkv, QKVAttentionLegacy (heads split before q/k/v), q and k each
    scaled by ch^(-1/4), softmax in (at least) fp32, Conv1d proj_out (zero-init), residual;
  * Downsample: Conv3 stride (2,2,2) pad 1; Upsample: trilinear x2 in all three dims
    (align_corners=False) then Conv3; head: GN, SiLU, Conv3 (zero-init);
  * PyTorch default init except the three zero-initialised convs.

Deliberate differences, all numerically neutral in float32:
  * the reference's GroupNorm32 and softmax cast to float32 and its forward casts the input to
    float32 (``self.dtype``); here they compute in ``promote(float32, dtype)`` so that
    ``model.double()`` runs end-to-end in float64 (golden files). In float32 this is identical.
  * the timestep embedding is computed in the same promoted dtype (float32 for a float32 model,
    with the reference's exact op order).
  * AttentionBlock's hard-wired gradient checkpointing only changes memory, not values; it is
    available here as ``use_checkpoint`` (default off).

Module and attribute names reproduce the reference state-dict keys and their order
(``time_embed.0/2``, ``input_blocks.i.j``, ``in_layers.0/2``, ``emb_layers.1``,
``out_layers.0/3``, ``skip_connection``, ``norm``, ``qkv``, ``proj_out``, ``op``, ``conv``,
``middle_block``, ``output_blocks``, ``out.0/out.2``). Configs use the Rust ``UNetConfig`` field
names (crates/meddpm/src/model/config.rs).
"""

import math
from collections import OrderedDict

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# ---- configurations (mirror UNetConfig::whole_head / brats / tiny in model/config.rs) ----------

WHOLE_HEAD = dict(depth=128, size=128, in_channels=3, out_channels=1, model_channels=64,
                  channel_mult=[1, 1, 2, 3, 4], num_res_blocks=1, attention_ds=[8], num_heads=1,
                  groups=32)
BRATS = dict(WHOLE_HEAD, depth=144, size=192, in_channels=8, out_channels=4, num_res_blocks=2,
             attention_ds=[])
TINY = dict(depth=8, size=8, in_channels=3, out_channels=1, model_channels=8,
            channel_mult=[1, 2, 2], num_res_blocks=1, attention_ds=[2], num_heads=1, groups=4)
# Second golden case: 2 heads, 2 res blocks, attention at every level, non-cubic 8x4x4 volume.
TINY_HEADS2 = dict(depth=8, size=4, in_channels=3, out_channels=1, model_channels=8,
                   channel_mult=[1, 2], num_res_blocks=2, attention_ds=[1, 2], num_heads=2,
                   groups=4)
CONFIG_FIELDS = ["depth", "size", "in_channels", "out_channels", "model_channels", "channel_mult",
                 "num_res_blocks", "attention_ds", "num_heads", "groups"]


def compute_dtype(dtype):
    """float32 for half types and float32, float64 for float64 (reference: always float32)."""
    return torch.promote_types(torch.float32, dtype)


# ---- building blocks ---------------------------------------------------------------------------

class GroupNorm32(nn.GroupNorm):
    """GroupNorm(groups, C), eps 1e-5, affine; computed in at least float32."""

    def forward(self, x):
        ct = compute_dtype(x.dtype)
        return F.group_norm(x.to(ct), self.num_groups, self.weight.to(ct), self.bias.to(ct),
                            self.eps).to(x.dtype)


def zero_module(m):
    for p in m.parameters():
        p.detach().zero_()
    return m


def timestep_embedding(t, dim, max_period=1000, dtype=torch.float32):
    """[cos(t*f), sin(t*f)] with f_i = exp(-ln(max_period) * i / half), i < half; t may be float."""
    ct = compute_dtype(dtype)
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=ct) / half).to(t.device)
    args = t[:, None].to(ct) * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb.to(dtype)


class TimestepBlock(nn.Module):
    """A module whose forward takes (x, emb)."""


class TimestepEmbedSequential(nn.Sequential, TimestepBlock):
    def forward(self, x, emb):
        for layer in self:
            x = layer(x, emb) if isinstance(layer, TimestepBlock) else layer(x)
        return x


class ResBlock(TimestepBlock):
    def __init__(self, channels, emb_channels, out_channels, groups, dropout=0.0):
        super().__init__()
        self.channels, self.out_channels = channels, out_channels
        self.in_layers = nn.Sequential(
            GroupNorm32(groups, channels), nn.SiLU(),
            nn.Conv3d(channels, out_channels, 3, padding=1))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, out_channels))
        self.out_layers = nn.Sequential(
            GroupNorm32(groups, out_channels), nn.SiLU(), nn.Dropout(p=dropout),
            zero_module(nn.Conv3d(out_channels, out_channels, 3, padding=1)))
        if out_channels == channels:
            self.skip_connection = nn.Identity()
        else:
            self.skip_connection = nn.Conv3d(channels, out_channels, 1)

    def forward(self, x, emb):
        h = self.in_layers(x)
        e = self.emb_layers(emb).to(h.dtype)
        h = h + e[(...,) + (None,) * (h.dim() - e.dim())]
        h = self.out_layers(h)
        return self.skip_connection(x) + h


class QKVAttentionLegacy(nn.Module):
    """Heads split before q/k/v: head h owns channels [3*ch*h, 3*ch*(h+1)) = [q_h, k_h, v_h]."""

    def __init__(self, n_heads):
        super().__init__()
        self.n_heads = n_heads

    def forward(self, qkv):
        bs, width, length = qkv.shape
        assert width % (3 * self.n_heads) == 0, f"qkv width {width} vs {self.n_heads} heads"
        ch = width // (3 * self.n_heads)
        q, k, v = qkv.reshape(bs * self.n_heads, ch * 3, length).split(ch, dim=1)
        scale = 1 / math.sqrt(math.sqrt(ch))
        w = torch.einsum("bct,bcs->bts", q * scale, k * scale)
        w = torch.softmax(w.to(compute_dtype(w.dtype)), dim=-1).to(w.dtype)
        a = torch.einsum("bts,bcs->bct", w, v)
        return a.reshape(bs, -1, length)


class AttentionBlock(nn.Module):
    def __init__(self, channels, num_heads, groups, use_checkpoint=False):
        super().__init__()
        self.channels, self.num_heads, self.use_checkpoint = channels, num_heads, use_checkpoint
        self.norm = GroupNorm32(groups, channels)
        self.qkv = nn.Conv1d(channels, channels * 3, 1)
        self.attention = QKVAttentionLegacy(num_heads)
        self.proj_out = zero_module(nn.Conv1d(channels, channels, 1))

    def _forward(self, x):
        b, c, *spatial = x.shape
        x = x.reshape(b, c, -1)
        h = self.proj_out(self.attention(self.qkv(self.norm(x))))
        return (x + h).reshape(b, c, *spatial)

    def forward(self, x):
        if self.use_checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Downsample(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.channels = channels
        self.op = nn.Conv3d(channels, channels, 3, stride=(2, 2, 2), padding=1)

    def forward(self, x):
        assert x.shape[1] == self.channels
        return self.op(x)


class Upsample(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.channels = channels
        self.conv = nn.Conv3d(channels, channels, 3, padding=1)

    def forward(self, x):
        assert x.shape[1] == self.channels
        d, h, w = x.shape[2:]
        x = F.interpolate(x, (d * 2, h * 2, w * 2), mode="trilinear")  # align_corners=False
        return self.conv(x)


# ---- the network -------------------------------------------------------------------------------

class UNetModel(nn.Module):
    """Med-DDPM's UNet. ``cfg`` is a dict with the UNetConfig fields (depth/size unused here)."""

    def __init__(self, cfg, use_checkpoint=False):
        super().__init__()
        self.cfg = dict(cfg)
        mc, groups, heads = cfg["model_channels"], cfg["groups"], cfg["num_heads"]
        mult, nrb, attn = list(cfg["channel_mult"]), cfg["num_res_blocks"], set(cfg["attention_ds"])
        self.model_channels = mc
        emb = 4 * mc
        self.time_embed = nn.Sequential(nn.Linear(mc, emb), nn.SiLU(), nn.Linear(emb, emb))

        ch = input_ch = int(mult[0] * mc)
        self.input_blocks = nn.ModuleList(
            [TimestepEmbedSequential(nn.Conv3d(cfg["in_channels"], ch, 3, padding=1))])
        chans, ds = [ch], 1
        for level, m in enumerate(mult):
            for _ in range(nrb):
                layers = [ResBlock(ch, emb, int(m * mc), groups)]
                ch = int(m * mc)
                if ds in attn:
                    layers.append(AttentionBlock(ch, heads, groups, use_checkpoint))
                self.input_blocks.append(TimestepEmbedSequential(*layers))
                chans.append(ch)
            if level != len(mult) - 1:
                self.input_blocks.append(TimestepEmbedSequential(Downsample(ch)))
                chans.append(ch)
                ds *= 2

        self.middle_block = TimestepEmbedSequential(
            ResBlock(ch, emb, ch, groups), AttentionBlock(ch, heads, groups, use_checkpoint),
            ResBlock(ch, emb, ch, groups))

        self.output_blocks = nn.ModuleList([])
        for level, m in list(enumerate(mult))[::-1]:
            for i in range(nrb + 1):
                ich = chans.pop()
                layers = [ResBlock(ch + ich, emb, int(mc * m), groups)]
                ch = int(mc * m)
                if ds in attn:
                    layers.append(AttentionBlock(ch, heads, groups, use_checkpoint))
                if level and i == nrb:
                    layers.append(Upsample(ch))
                    ds //= 2
                self.output_blocks.append(TimestepEmbedSequential(*layers))

        self.out = nn.Sequential(GroupNorm32(groups, ch), nn.SiLU(),
                                 zero_module(nn.Conv3d(input_ch, cfg["out_channels"], 3, padding=1)))

    def forward(self, x, timesteps):
        dtype = self.time_embed[0].weight.dtype
        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels, dtype=dtype))
        hs = []
        h = x.to(dtype)
        for module in self.input_blocks:
            h = module(h, emb)
            hs.append(h)
        h = self.middle_block(h, emb)
        for module in self.output_blocks:
            h = torch.cat([h, hs.pop()], dim=1)
            h = module(h, emb)
        return self.out(h.to(x.dtype))


# ---- diffusion schedule ------------------------------------------------------------------------

def cosine_beta_schedule(timesteps, s=0.008):
    """betas_t = 1 - abar_{t+1}/abar_t, abar_i = f(i/T)/f(0), f(u) = cos^2((u+s)/(1+s)*pi/2),
    clipped to [0, 0.999]; float64 (reference builds the grid as linspace(0, T+1, T+1)/(T+1))."""
    steps = timesteps + 1
    x = np.linspace(0, steps, steps)
    ac = np.cos(((x / steps) + s) / (1 + s) * np.pi * 0.5) ** 2
    ac = ac / ac[0]
    betas = 1 - (ac[1:] / ac[:-1])
    return np.clip(betas, a_min=0, a_max=0.999)


def schedule_buffers(timesteps=250):
    """The 13 GaussianDiffusion buffers in registration order, as float64 numpy arrays."""
    betas = cosine_beta_schedule(timesteps)
    alphas = 1.0 - betas
    ac = np.cumprod(alphas, axis=0)
    ac_prev = np.append(1.0, ac[:-1])
    pv = betas * (1.0 - ac_prev) / (1.0 - ac)
    coef2 = (1.0 - ac_prev) * np.sqrt(alphas) / (1.0 - ac)
    return OrderedDict([
        ("betas", betas),
        ("alphas_cumprod", ac),
        ("alphas_cumprod_prev", ac_prev),
        ("sqrt_alphas_cumprod", np.sqrt(ac)),
        ("sqrt_one_minus_alphas_cumprod", np.sqrt(1.0 - ac)),
        ("log_one_minus_alphas_cumprod", np.log(1.0 - ac)),
        ("sqrt_recip_alphas_cumprod", np.sqrt(1.0 / ac)),
        ("sqrt_recipm1_alphas_cumprod", np.sqrt(1.0 / ac - 1)),
        ("posterior_variance", pv),
        ("posterior_log_variance_clipped", np.log(np.maximum(pv, 1e-20))),
        ("posterior_mean_coef1", betas * np.sqrt(ac_prev) / (1.0 - ac)),
        ("posterior_mean_coef2", coef2),
        ("posterior_mean_coef3", 1.0 - coef2),
    ])


class GaussianDiffusion(nn.Module):
    """State-dict shape of Med-DDPM's GaussianDiffusion: 13 float32 buffers + ``denoise_fn.*``.

    ``p_losses`` is the training objective (spec §3.2) with L1 loss."""

    def __init__(self, denoise_fn, timesteps=250):
        super().__init__()
        self.denoise_fn = denoise_fn
        self.num_timesteps = timesteps
        for name, v in schedule_buffers(timesteps).items():
            self.register_buffer(name, torch.tensor(v, dtype=torch.float32))

    def q_sample(self, x0, t, noise):
        shape = (-1,) + (1,) * (x0.dim() - 1)
        return (self.sqrt_alphas_cumprod[t].reshape(shape).to(x0.dtype) * x0
                + self.sqrt_one_minus_alphas_cumprod[t].reshape(shape).to(x0.dtype) * noise)

    def p_losses(self, x0, cond, t, noise):
        x_t = self.q_sample(x0, t, noise)
        eps_hat = self.denoise_fn(torch.cat([x_t, cond], 1), t)
        return (noise - eps_hat).abs().mean()


def param_count(model):
    return sum(p.numel() for p in model.parameters())
