//! The report's charts as people read them: the roofline lists its roofs generically (FP32 plus
//! one per conv/GEMM math: TF32, BF16), draws each in its own style with its ridge point
//! labelled; the stacked bars of `matrix.svg` fill the x axis (no empty slots) and keep the
//! legend beside the chart.

use meddpm::analysis::gpus::{find, Math};
use meddpm::analysis::matrix::ConfigInput;
use meddpm::analysis::ncu::NcuData;
use meddpm::analysis::profile::{profile_unet, Options};
use meddpm::analysis::report::{self, roofs, Input};
use meddpm::analysis::timed::Timed;
use meddpm::cpu::CpuBackend;
use meddpm::model::UNetConfig;
use meddpm::Backend;
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meddpm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn roofs_are_a_list_per_math() {
    let h200 = find("h200").unwrap();
    let r = roofs(&h200, &[Math::Tf32]);
    assert_eq!(r.iter().map(|x| x.label.as_str()).collect::<Vec<_>>(), ["FP32", "TF32 conv/GEMM"]);
    assert_eq!(r[0].flops, h200.fp32_tflops * 1e12);
    assert_eq!(r[1].flops, h200.tf32_tflops.unwrap() * 1e12);
    let all = roofs(&h200, &[Math::Fp32, Math::Tf32, Math::Bf16]);
    assert_eq!(all.iter().map(|x| x.label.as_str()).collect::<Vec<_>>(), ["FP32", "TF32 conv/GEMM", "BF16 conv/GEMM"]);
    // V100 has no TF32 tensor cores: its TF32 convs run at the FP32 roof, drawn once.
    assert_eq!(roofs(&find("v100").unwrap(), &[Math::Tf32]).len(), 1);
}

/// x coordinates (left, right) of the `<rect>`s filled with `fill` in an SVG.
fn rects_x(svg: &str, fill: &str) -> Vec<(f64, f64)> {
    let attr = |tag: &str, name: &str| -> Option<f64> {
        let k = format!(" {name}=\"");
        let s = tag.find(&k)? + k.len();
        tag[s..].split('"').next()?.parse().ok()
    };
    svg.split("<rect")
        .skip(1)
        .filter(|t| t.contains(&format!("fill=\"{fill}\"")))
        .filter_map(|t| Some((attr(t, "x")?, attr(t, "x")? + attr(t, "width")?)))
        .collect()
}

/// x of the `<text>` element whose content is `content` (plotters writes it on its own line).
fn text_x(svg: &str, content: &str) -> Option<f64> {
    let at = svg.find(&format!(">\n{content}\n</text>"))?;
    let tag = &svg[svg[..at].rfind("<text")?..at];
    let s = tag.find(" x=\"")? + 4;
    tag[s..].split('"').next()?.parse().ok()
}

#[test]
fn roofline_and_matrix_charts() {
    let be = Timed::new(CpuBackend::new());
    let o = Options { warmup: 0, repeats: 1, ..Options::default() };
    let passes = profile_unet(&be, &UNetConfig::tiny(), &o).unwrap();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/ncu");
    let ncu = NcuData::load(Some(&fx.join("h200_conv_raw.csv")), None).unwrap();
    let pick = |ids: &[u64]| ncu.kernels.iter().filter(|k| ids.contains(&k.id)).cloned().collect::<Vec<_>>();
    let matrix = vec![
        ConfigInput::from_ncu("fp32 NCDHW", &pick(&[0])),
        ConfigInput::from_ncu("TF32 NCDHW", &pick(&[5, 6, 7, 8])),
    ];
    // Place the CPU records on the H200's roofs (as a GPU run would be).
    let input = Input {
        title: "tiny".into(),
        device: be.describe(),
        device_gpu: find("h200"),
        math: Some(Math::Tf32),
        config: "tiny".into(),
        passes,
        matrix,
        top_n: 10,
        ..Input::default()
    };
    let dir = tmp("charts");
    report::write(&input, &dir).unwrap();

    let roof = std::fs::read_to_string(dir.join("roofline.svg")).unwrap();
    for s in ["FP32 ridge", "TF32 ridge", "FP32 roof", "TF32 conv/GEMM roof"] {
        assert!(roof.contains(s), "roofline.svg lacks {s:?}");
    }
    // Two line styles: solid black and the blue dashed roof.
    assert!(roof.contains("stroke=\"#000000\"") && roof.contains("stroke=\"#1F5AC8\""), "roof colours");

    // matrix.svg: 2 bars; the conv-forward segments (#1F77B4) of the two bars are centred in
    // the two halves of the axis, the last one ending near its right end (no empty slot).
    let m = std::fs::read_to_string(dir.join("matrix.svg")).unwrap();
    let mut bars = rects_x(&m, "#1F77B4");
    bars.retain(|(l, r)| r - l > 20.0); // the legend swatch is 12 px wide
    bars.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    assert_eq!(bars.len(), 2, "{bars:?}");
    let (w0, w1) = (bars[0].1 - bars[0].0, bars[1].1 - bars[1].0);
    let pitch = bars[1].0 - bars[0].0;
    assert!((w0 - w1).abs() < 1.0 && w0 > 0.7 * pitch, "bars {bars:?}");
    // Bar i spans [i + 0.1, i + 0.9] of an axis 0..2: the axis ends 0.1 pitch after the last bar,
    // and right there the legend panel begins (no empty slots between them).
    let axis_end = bars[1].1 + 0.1 * pitch;
    let legend_x = text_x(&m, "conv forward").expect("legend entry for conv forward");
    assert!(
        legend_x > axis_end && legend_x - axis_end < 0.2 * pitch,
        "legend at {legend_x}, axis end {axis_end}, bars {bars:?}"
    );
    for name in ["fp32 NCDHW", "TF32 NCDHW"] {
        assert!(text_x(&m, name).is_some(), "matrix.svg lacks the bar name {name}");
    }
    if std::env::var_os("MEDDPM_KEEP_CHARTS").is_none() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
