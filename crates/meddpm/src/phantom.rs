//! A synthetic head phantom: a deterministic (image, mask) pair with Med-DDPM's whole-head
//! conventions, for tests that must not depend on files. The head is an ellipsoid of smoothly
//! varying intensity with a darker "ventricle" and a bright "tumour" blob whose position
//! depends on `variant`; the mask has labels 0 background, 1 head, 2 tumour.
//!
//! Returned tensors are (C, D, H, W): image 1 channel in [−1, 1]; condition 2 channels in
//! {−1, +1} (label 1, label 2), exactly what the data pipeline produces for real files.

/// (image, cond) for a D×H×W volume.
pub fn pair(d: usize, h: usize, w: usize, variant: u32) -> (Vec<f32>, Vec<f32>) {
    let s = d * h * w;
    let mut img = vec![-1f32; s];
    let mut cond = vec![-1f32; 2 * s];
    let off = [0.15 * ((variant % 3) as f32 - 1.0), 0.2 * ((variant % 2) as f32 - 0.5), 0.1];
    for z in 0..d {
        for y in 0..h {
            for x in 0..w {
                let c = |i: usize, n: usize| 2.0 * (i as f32 + 0.5) / n as f32 - 1.0;
                let (pz, py, px) = (c(z, d), c(y, h), c(x, w));
                let r2 = (pz / 0.8).powi(2) + (py / 0.85).powi(2) + (px / 0.7).powi(2);
                let i = (z * h + y) * w + x;
                if r2 < 1.0 {
                    let t2 = (pz - off[0]).powi(2) + (py - off[1]).powi(2) + (px - off[2]).powi(2);
                    let ventricle = (pz / 0.3).powi(2) + (py / 0.15).powi(2) + (px / 0.1).powi(2) < 1.0;
                    let tumour = t2 < 0.06;
                    img[i] = if tumour {
                        0.9
                    } else if ventricle {
                        -0.6
                    } else {
                        0.2 + 0.4 * (1.0 - r2) + 0.1 * (3.0 * px).sin()
                    };
                    cond[if tumour { s + i } else { i }] = 1.0;
                }
            }
        }
    }
    (img, cond)
}

#[cfg(test)]
mod tests {
    #[test]
    fn phantom_follows_the_conventions() {
        let (img, cond) = super::pair(16, 16, 16, 1);
        assert!(img.iter().all(|v| (-1.0..=1.0).contains(v)));
        assert!(cond.iter().all(|&v| v == 1.0 || v == -1.0));
        let s = 16 * 16 * 16;
        let head = cond[..s].iter().filter(|&&v| v == 1.0).count();
        let tumour = cond[s..].iter().filter(|&&v| v == 1.0).count();
        assert!(head > s / 5 && tumour > 10, "head {head} tumour {tumour}");
        // channels are mutually exclusive, as in the reference one-hot
        assert!((0..s).all(|i| !(cond[i] == 1.0 && cond[s + i] == 1.0)));
    }
}
