//! The GroupNorm operations the trait provides from its core (`Backend::groupnorm_stats` plus
//! the recomputation or the concatenation): on the CPU backend, in fp32 and in the bf16
//! emulation, bit for bit the fused single-pass kernels of `cpu/groupnorm.rs` with the bf16
//! rounding where the GPU stores bf16 (outputs rounded, the f32 statistics and the per-channel
//! offset sum not) — odd shapes, with and without the offset and the concatenation's bias.

use meddpm::backend::round_bf16;
use meddpm::cpu::{elementwise, groupnorm, CpuBackend};
use meddpm::testing::randn_f32;
use meddpm::{Backend, Dims};

/// Bit-equal, NaN-free.
fn same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.to_bits() == w.to_bits() && !g.is_nan(), "{what}: element {i}: {g:e} vs {w:e}");
    }
}

fn rounded(bf16: bool, mut v: Vec<f32>) -> Vec<f32> {
    if bf16 {
        v.iter_mut().for_each(|x| *x = round_bf16(*x));
    }
    v
}

const SHAPES: [(Dims, usize); 3] =
    [(Dims::new(2, 6, 3, 5, 7), 3), (Dims::new(1, 8, 4, 4, 5), 8), (Dims::new(2, 4, 1, 3, 11), 1)];

#[test]
fn groupnorm_silu_forward_is_the_fused_kernel() {
    for bf16 in [false, true] {
        let be = if bf16 { CpuBackend::bf16() } else { CpuBackend::new() };
        for (i, &(x, groups)) in SHAPES.iter().enumerate() {
            let s = i as u64 * 10;
            // activations as they are stored (bf16-representable in bf16 mode)
            let inp = rounded(bf16, randn_f32(5, s, x.numel(), 1.5));
            let (gamma, beta) = (randn_f32(5, s + 1, x.c, 1.0), randn_f32(5, s + 2, x.c, 1.0));
            let off = randn_f32(5, s + 3, x.n * x.c, 0.7);
            let ng = x.n * groups;
            for with_off in [false, true] {
                let name = format!("{x} / {groups} groups, bf16 {bf16}, offset {with_off}");
                // the fused kernel: GroupNorm+SiLU of inp (+ off, summed in f32, unrounded)
                let mut xi = inp.clone();
                if with_off {
                    elementwise::add_channel_bias(&mut xi, &off, x);
                }
                let (mut want, mut wm, mut wr) = (vec![0f32; x.numel()], vec![0f32; ng], vec![0f32; ng]);
                groupnorm::groupnorm_silu_forward(&mut want, &mut wm, &mut wr, &xi, &gamma, &beta, x, groups);
                let want = rounded(bf16, want);

                let (mut out, mut m, mut r) = (vec![0f32; x.numel()], vec![0f32; ng], vec![0f32; ng]);
                let o = with_off.then_some(&off);
                be.groupnorm_silu_forward(&mut out, &mut m, &mut r, &inp, o, &gamma, &beta, x, groups);
                same(&format!("{name}: forward"), &out, &want);
                same(&format!("{name}: mean"), &m, &wm);
                same(&format!("{name}: rstd"), &r, &wr);
                // the statistics alone
                let (mut m2, mut r2) = (vec![0f32; ng], vec![0f32; ng]);
                be.groupnorm_stats(&mut m2, &mut r2, &inp, o, x, groups);
                same(&format!("{name}: groupnorm_stats mean"), &m2, &wm);
                same(&format!("{name}: groupnorm_stats rstd"), &r2, &wr);
                if with_off {
                    continue;
                }
                // in place
                let (mut xb, mut m3, mut r3) = (inp.clone(), vec![0f32; ng], vec![0f32; ng]);
                be.groupnorm_silu_forward_inplace(&mut xb, &mut m3, &mut r3, &gamma, &beta, x, groups);
                same(&format!("{name}: in place"), &xb, &want);
                same(&format!("{name}: in place mean"), &m3, &wm);
                same(&format!("{name}: in place rstd"), &r3, &wr);
            }
        }
    }
}

#[test]
fn concat_channels_stats_is_the_concatenation_and_its_statistics() {
    for bf16 in [false, true] {
        let be = if bf16 { CpuBackend::bf16() } else { CpuBackend::new() };
        for (i, &(x, groups)) in SHAPES.iter().enumerate() {
            let s = 100 + i as u64 * 10;
            let (ca, cb) = (x.c / 2, x.c - x.c / 2);
            let (xa, xb) = (x.with_c(ca), x.with_c(cb));
            let a = rounded(bf16, randn_f32(6, s, xa.numel(), 1.0));
            let b = rounded(bf16, randn_f32(6, s + 1, xb.numel(), 1.0));
            let bias = randn_f32(6, s + 2, ca, 0.5);
            let ng = x.n * groups;
            for with_bias in [false, true] {
                let name = format!("{x} = {ca} + {cb} channels / {groups} groups, bf16 {bf16}, bias {with_bias}");
                let hb = with_bias.then_some(&bias[..]);
                let mut want = vec![0f32; x.numel()];
                elementwise::concat_channels_bias(&mut want, &a, hb, &b, x, ca, cb);
                let want = rounded(bf16, want);
                let (mut wm, mut wr) = (vec![0f32; ng], vec![0f32; ng]);
                groupnorm::groupnorm_stats(&mut wm, &mut wr, &want, x, groups);

                let (mut out, mut m, mut r) = (vec![0f32; x.numel()], vec![0f32; ng], vec![0f32; ng]);
                be.concat_channels_stats(
                    &mut out,
                    &a,
                    with_bias.then_some(&bias),
                    &b,
                    (&mut m, &mut r),
                    x,
                    ca,
                    cb,
                    groups,
                );
                same(&format!("{name}: concatenation"), &out, &want);
                same(&format!("{name}: mean"), &m, &wm);
                same(&format!("{name}: rstd"), &r, &wr);
            }
        }
    }
}
