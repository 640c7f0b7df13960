//! The volume viewer: one self-contained HTML file (no network: the voxels are embedded as
//! base64 of u8-quantised volumes, the script and style are inline, and a Content-Security-Policy
//! forbids every fetch) showing three orthogonal slices of each volume side by side, with
//! position sliders, window/level, and a label mask as a coloured overlay.
//!
//! Slices use the voxel axes and orientation of the PNG previews (`preview.rs`): axial = z-slice
//! shown x → right, y → up; coronal = y-slice, x → right, z → up; sagittal = x-slice, y → right,
//! z → up; displayed with the voxel spacing as aspect ratio. Intensity volumes are quantised to
//! 0..255 over their own min..max (kept in the page, so window/level read in the volume's units);
//! the mask keeps its integer labels (0 transparent, then the preview palette). Volumes of other
//! sizes than the first are cut at the same relative position; the mask overlays the volumes of
//! its own size.
//!
//! The page's state is driven by its controls only; `window.meddpmView` exposes the decoded data
//! and the render function for tests (`tests/view_browser.rs` drives it in headless Chromium).

use super::nifti::Volume;
use super::preview::PALETTE;
use crate::error::{Error, Result};
use base64::Engine;
use serde::Serialize;
use std::path::Path;

/// One volume to show: a column of three slices, titled `name`.
pub struct Layer<'a> {
    pub name: String,
    pub volume: &'a Volume,
}

#[derive(Serialize)]
struct VolumeJson {
    name: String,
    dims: [usize; 3],
    spacing: [f32; 3],
    /// Value of quantised level 0 and of 255.
    lo: f32,
    hi: f32,
    /// base64 of X·Y·Z bytes, x fastest.
    data: String,
}

#[derive(Serialize)]
struct MaskJson {
    name: String,
    dims: [usize; 3],
    /// base64 of X·Y·Z label bytes, x fastest.
    data: String,
    labels: Vec<u8>,
}

#[derive(Serialize)]
struct PageJson {
    title: String,
    volumes: Vec<VolumeJson>,
    mask: Option<MaskJson>,
    palette: Vec<[u8; 3]>,
}

/// Intensity quantisation of a volume: (lo, hi, bytes) with byte = round((v − lo)/(hi − lo)·255);
/// non-finite voxels become 0.
pub fn quantise(v: &Volume) -> (f32, f32, Vec<u8>) {
    let (lo, hi) = v
        .data
        .iter()
        .filter(|x| x.is_finite())
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 0.0) };
    let range = if hi > lo { hi - lo } else { 1.0 };
    let bytes = v
        .data
        .iter()
        .map(|&x| if x.is_finite() { ((x - lo) / range * 255.0).round().clamp(0.0, 255.0) as u8 } else { 0 })
        .collect();
    (lo, hi, bytes)
}

/// Mask labels as bytes: each voxel rounded, negative → 0, above 255 → 255.
fn mask_bytes(m: &Volume) -> Vec<u8> {
    m.data.iter().map(|&x| if x.is_finite() { x.round().clamp(0.0, 255.0) as u8 } else { 0 }).collect()
}

/// The HTML page for `layers` (at least one), with `mask` (name, volume) as overlay.
pub fn html(title: &str, layers: &[Layer<'_>], mask: Option<(&str, &Volume)>) -> Result<String> {
    if layers.is_empty() {
        return Err(Error::Config("view: no volume to show".into()));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut volumes = Vec::new();
    for l in layers {
        if l.volume.is_empty() || l.volume.data.len() != l.volume.len() {
            return Err(Error::Config(format!(
                "view: {} has no voxels or a data length that is not its dims {:?}",
                l.name, l.volume.dims
            )));
        }
        let (lo, hi, bytes) = quantise(l.volume);
        volumes.push(VolumeJson {
            name: l.name.clone(),
            dims: l.volume.dims,
            spacing: l.volume.spacing.map(|s| if s.is_finite() && s > 0.0 { s } else { 1.0 }),
            lo,
            hi,
            data: b64.encode(bytes),
        });
    }
    let mask = match mask {
        None => None,
        Some((name, m)) => {
            if !layers.iter().any(|l| l.volume.dims == m.dims) {
                let sizes: Vec<String> = layers.iter().map(|l| format!("{} {:?}", l.name, l.volume.dims)).collect();
                return Err(Error::Config(format!(
                    "view: the mask {name} has dims {:?}, but no volume has that size ({}); the overlay needs the same grid",
                    m.dims,
                    sizes.join(", ")
                )));
            }
            let bytes = mask_bytes(m);
            let mut labels: Vec<u8> = bytes.iter().copied().filter(|&b| b > 0).collect();
            labels.sort_unstable();
            labels.dedup();
            Some(MaskJson { name: name.to_string(), dims: m.dims, data: b64.encode(bytes), labels })
        }
    };
    let page = PageJson { title: title.to_string(), volumes, mask, palette: PALETTE.to_vec() };
    // JSON inside <script>: no "<" may appear raw (it could close the element); \u003c is the
    // same character to the JSON parser.
    let json = serde_json::to_string(&page).map_err(|e| Error::Config(format!("view: {e}")))?.replace('<', "\\u003c");
    Ok(TEMPLATE.replace("{{TITLE}}", &escape_html(title)).replace("{{DATA}}", &json))
}

/// Write [`html`] to `path` atomically (temporary file, then rename).
pub fn write_html(
    path: impl AsRef<Path>,
    title: &str,
    layers: &[Layer<'_>],
    mask: Option<(&str, &Volume)>,
) -> Result<()> {
    let path = path.as_ref();
    let page = html(title, layers, mask)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp.html", std::process::id()));
    let result = std::fs::write(&tmp, page).and_then(|_| std::fs::rename(&tmp, path)).map_err(|e| Error::io(path, e));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn escape_html(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// The page: style, controls, a grid of canvases, and the script that decodes and draws.
const TEMPLATE: &str = r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>{{TITLE}}</title>
<style>
body { background: #202028; color: #ddd; font: 14px sans-serif; margin: 12px; }
h1 { font-size: 16px; margin: 0 0 8px 0; }
#controls { display: grid; grid-template-columns: max-content 220px max-content; gap: 4px 10px; align-items: center; margin-bottom: 10px; }
#grid { display: grid; gap: 6px; align-items: start; }
.name { text-align: center; font-weight: bold; }
.plane { color: #999; font-size: 12px; writing-mode: vertical-rl; transform: rotate(180deg); text-align: center; }
canvas { image-rendering: pixelated; background: #000; cursor: crosshair; display: block; }
#legend span { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; vertical-align: middle; }
</style>
</head>
<body>
<h1>{{TITLE}}</h1>
<div id="controls">
  <label for="x">x (sagittal)</label><input type="range" id="x"><span id="x-val"></span>
  <label for="y">y (coronal)</label><input type="range" id="y"><span id="y-val"></span>
  <label for="z">z (axial)</label><input type="range" id="z"><span id="z-val"></span>
  <label for="level">level</label><input type="range" id="level" min="0" max="100" value="50"><span id="level-val"></span>
  <label for="window">window</label><input type="range" id="window" min="1" max="200" value="100"><span id="window-val"></span>
  <label for="opacity">mask overlay</label><input type="range" id="opacity" min="0" max="100" value="40"><span id="opacity-val"></span>
</div>
<div id="grid"></div>
<p id="legend"></p>
<p id="readout">&nbsp;</p>
<script type="application/json" id="meddpm-data">{{DATA}}</script>
<script>
"use strict";
(function () {
  const page = JSON.parse(document.getElementById("meddpm-data").textContent);
  const decode = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
  const vols = page.volumes.map((v) => Object.assign({}, v, { bytes: decode(v.data) }));
  const mask = page.mask ? Object.assign({}, page.mask, { bytes: decode(page.mask.data) }) : null;
  const first = vols[0].dims;
  const el = (id) => document.getElementById(id);
  const axes = ["x", "y", "z"];
  axes.forEach((a, i) => { const s = el(a); s.min = 0; s.max = first[i] - 1; s.value = Math.floor(first[i] / 2); });
  if (!mask) { el("opacity").disabled = true; }

  // (width, height) of plane p (0 axial, 1 coronal, 2 sagittal) of dims (X, Y, Z), and its
  // physical size from the spacing.
  const planeSize = (d, p) => (p === 0 ? [d[0], d[1]] : p === 1 ? [d[0], d[2]] : [d[1], d[2]]);
  const planeMm = (v, p) => { const s = v.spacing, [w, h] = planeSize(v.dims, p);
    return p === 0 ? [w * s[0], h * s[1]] : p === 1 ? [w * s[0], h * s[2]] : [w * s[1], h * s[2]]; };
  const maxMm = Math.max(...vols.flatMap((v) => [0, 1, 2].flatMap((p) => planeMm(v, p))));
  const cssScale = 256 / maxMm;
  // Slice index of an axis of n voxels at the position of slider axis a (fraction of the first volume).
  const sliceOf = (a, n) => Math.min(n - 1, Math.floor(((+el(axes[a]).value + 0.5) / first[a]) * n));
  // Linear voxel index shown at (u, w) (w = 0 at the top) of plane p of a volume with dims d.
  const voxel = (d, p, u, w) => {
    const [nx, ny, nz] = d;
    const at = (x, y, z) => x + nx * (y + ny * z);
    if (p === 0) return at(u, ny - 1 - w, sliceOf(2, nz));
    if (p === 1) return at(u, sliceOf(1, ny), nz - 1 - w);
    return at(sliceOf(0, nx), u, nz - 1 - w);
  };

  const grid = el("grid");
  grid.style.gridTemplateColumns = "max-content " + vols.map(() => "max-content").join(" ");
  grid.appendChild(document.createElement("div"));
  vols.forEach((v) => { const d = document.createElement("div"); d.className = "name"; d.textContent = v.name; grid.appendChild(d); });
  const canvases = [];
  ["axial", "coronal", "sagittal"].forEach((label, p) => {
    const l = document.createElement("div"); l.className = "plane"; l.textContent = label; grid.appendChild(l);
    vols.forEach((v, i) => {
      const [w, h] = planeSize(v.dims, p), [mw, mh] = planeMm(v, p);
      const c = document.createElement("canvas");
      c.width = w; c.height = h; c.id = "c-" + i + "-" + p;
      c.style.width = Math.round(mw * cssScale) + "px"; c.style.height = Math.round(mh * cssScale) + "px";
      c.addEventListener("click", (ev) => pick(v, p, c, ev));
      c.addEventListener("mousemove", (ev) => readout(v, p, c, ev));
      grid.appendChild(c);
      canvases.push({ c, v, p });
    });
  });
  if (mask) {
    const lg = el("legend");
    lg.textContent = "mask " + mask.name + ":";
    mask.labels.forEach((lab) => {
      const s = document.createElement("span"); const rgb = page.palette[lab % page.palette.length];
      s.style.background = "rgb(" + rgb.join(",") + ")"; lg.appendChild(s); lg.appendChild(document.createTextNode("label " + lab));
    });
  }

  const cellAt = (v, p, c, ev) => {
    const r = c.getBoundingClientRect();
    const [w, h] = planeSize(v.dims, p);
    return [Math.min(w - 1, Math.floor(((ev.clientX - r.left) / r.width) * w)), Math.min(h - 1, Math.floor(((ev.clientY - r.top) / r.height) * h))];
  };
  // Clicking a slice moves the two other planes through the clicked voxel.
  function pick(v, p, c, ev) {
    const [u, w] = cellAt(v, p, c, ev);
    const [nx, ny, nz] = v.dims;
    const set = (a, i, n) => { el(axes[a]).value = Math.min(first[a] - 1, Math.floor(((i + 0.5) / n) * first[a])); };
    if (p === 0) { set(0, u, nx); set(1, ny - 1 - w, ny); }
    else if (p === 1) { set(0, u, nx); set(2, nz - 1 - w, nz); }
    else { set(1, u, ny); set(2, nz - 1 - w, nz); }
    render();
  }
  function readout(v, p, c, ev) {
    const [u, w] = cellAt(v, p, c, ev);
    const q = v.bytes[voxel(v.dims, p, u, w)];
    const val = v.lo + (q / 255) * (v.hi - v.lo);
    el("readout").textContent = v.name + ": " + val.toPrecision(4);
  }

  function render() {
    const level = +el("level").value / 100, width = +el("window").value / 100;
    const alpha = mask ? +el("opacity").value / 100 : 0;
    const v0 = vols[0];
    axes.forEach((a, i) => { el(a + "-val").textContent = el(a).value + " / " + first[i]; });
    const units = (f) => (v0.lo + f * (v0.hi - v0.lo)).toPrecision(3);
    el("level-val").textContent = units(level) + " (" + v0.name + ")";
    el("window-val").textContent = units(width) + " wide";
    el("opacity-val").textContent = mask ? Math.round(alpha * 100) + " %" : "no mask";
    const lo = (level - width / 2) * 255, span = width * 255;
    for (const { c, v, p } of canvases) {
      const [w, h] = planeSize(v.dims, p);
      const img = c.getContext("2d").createImageData(w, h);
      const m = mask && mask.dims.every((n, i) => n === v.dims[i]) ? mask.bytes : null;
      for (let row = 0; row < h; row++) {
        for (let u = 0; u < w; u++) {
          const k = voxel(v.dims, p, u, row);
          let g = Math.max(0, Math.min(255, ((v.bytes[k] - lo) / span) * 255));
          let rgb = [g, g, g];
          const lab = m ? m[k] : 0;
          if (lab > 0 && alpha > 0) {
            const col = page.palette[lab % page.palette.length];
            rgb = rgb.map((x, j) => (1 - alpha) * x + alpha * col[j]);
          }
          const o = 4 * (row * w + u);
          img.data[o] = rgb[0]; img.data[o + 1] = rgb[1]; img.data[o + 2] = rgb[2]; img.data[o + 3] = 255;
        }
      }
      c.getContext("2d").putImageData(img, 0, 0);
    }
    document.body.dataset.rendered = String(+(document.body.dataset.rendered || 0) + 1);
  }
  ["x", "y", "z", "level", "window", "opacity"].forEach((id) => el(id).addEventListener("input", render));
  window.meddpmView = { volumes: vols, mask: mask, render: render };
  render();
})();
</script>
</body>
</html>
"#;

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(dims: [usize; 3]) -> Volume {
        let data = (0..dims[0] * dims[1] * dims[2]).map(|i| i as f32).collect();
        Volume::new(dims, [1.0, 1.0, 2.0], data)
    }

    /// The embedded JSON of a page.
    fn data_of(page: &str) -> serde_json::Value {
        let start = page.find(r#"<script type="application/json" id="meddpm-data">"#).expect("data element")
            + r#"<script type="application/json" id="meddpm-data">"#.len();
        let end = start + page[start..].find("</script>").expect("end of data");
        serde_json::from_str(&page[start..end]).expect("valid JSON")
    }

    #[test]
    fn page_embeds_the_quantised_voxels_and_the_mask() {
        let v = ramp([3, 4, 5]);
        let other = Volume::new([2, 2, 2], [1.0; 3], vec![-1.0, 1.0, 0.0, 0.5, 0.25, 1.0, -1.0, 0.0]);
        let mut m = Volume::new([3, 4, 5], [1.0; 3], vec![0.0; 60]);
        m.data[7] = 2.0;
        m.data[59] = 1.0;
        let layers = [Layer { name: "ramp <b>".into(), volume: &v }, Layer { name: "small".into(), volume: &other }];
        let page = html("t & <t>", &layers, Some(("mask.nii.gz", &m))).unwrap();
        // Self-contained: no URL that a browser would fetch.
        for bad in ["http:", "https:", "src=", "href=", "@import", "url("] {
            assert!(!page.contains(bad), "page contains {bad}");
        }
        assert!(page.contains("<title>t &amp; &lt;t&gt;</title>"));
        let d = data_of(&page);
        let b64 = base64::engine::general_purpose::STANDARD;
        let vols = d["volumes"].as_array().unwrap();
        assert_eq!(vols.len(), 2);
        assert_eq!(vols[0]["name"], "ramp <b>");
        assert_eq!(vols[0]["dims"], serde_json::json!([3, 4, 5]));
        assert_eq!(vols[0]["spacing"], serde_json::json!([1.0, 1.0, 2.0]));
        let (lo, hi) = (vols[0]["lo"].as_f64().unwrap(), vols[0]["hi"].as_f64().unwrap());
        assert_eq!((lo, hi), (0.0, 59.0));
        let bytes = b64.decode(vols[0]["data"].as_str().unwrap()).unwrap();
        assert_eq!(bytes.len(), 60);
        for (i, &b) in bytes.iter().enumerate() {
            assert_eq!(b, (i as f64 / 59.0 * 255.0).round() as u8, "voxel {i}");
        }
        let small = b64.decode(vols[1]["data"].as_str().unwrap()).unwrap();
        assert_eq!(small, vec![0, 255, 128, 191, 159, 255, 0, 128]);
        let mj = &d["mask"];
        assert_eq!(mj["labels"], serde_json::json!([1, 2]));
        let mb = b64.decode(mj["data"].as_str().unwrap()).unwrap();
        assert_eq!((mb[7], mb[59], mb.iter().filter(|&&b| b != 0).count()), (2, 1, 2));
        assert_eq!(d["palette"].as_array().unwrap().len(), PALETTE.len());
    }

    #[test]
    fn bad_input_is_an_error_naming_the_file() {
        let v = ramp([3, 4, 5]);
        let m = Volume::new([2, 2, 2], [1.0; 3], vec![0.0; 8]);
        let layers = [Layer { name: "a.nii.gz".into(), volume: &v }];
        let e = html("t", &layers, Some(("m.nii.gz", &m))).unwrap_err().to_string();
        assert!(e.contains("m.nii.gz") && e.contains("[2, 2, 2]") && e.contains("a.nii.gz [3, 4, 5]"), "{e}");
        assert!(html("t", &[], None).is_err());
    }

    #[test]
    fn constant_and_non_finite_volumes_quantise_without_nan() {
        let v = Volume::new([2, 1, 1], [1.0; 3], vec![3.0, f32::NAN]);
        assert_eq!(quantise(&v), (3.0, 3.0, vec![0, 0]));
    }
}
