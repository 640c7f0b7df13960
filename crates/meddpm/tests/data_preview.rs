//! PNG previews: layout (columns = volumes, rows = axial/coronal/sagittal mid-slices), the
//! slice orientation, colours, and a PNG that decodes back to the same pixels; a sample's files
//! with their preview and viewer page (`data::output::write_sample_with_views`).

use meddpm::data::nifti::{read_volume, Volume};
use meddpm::data::output::{image_volumes, write_sample_with_views, Beside};
use meddpm::data::preview::{guess_kind, label_position, render, render_at, render_titled, write_png, Kind, PALETTE};
use meddpm::data::{demo, Convention};

fn vol(f: impl Fn(usize, usize, usize) -> f32) -> Volume {
    let (nx, ny, nz) = (10, 12, 14);
    let mut d = Vec::new();
    for z in 0..nz {
        for y in 0..ny {
            for x in 0..nx {
                d.push(f(x, y, z));
            }
        }
    }
    Volume::new([nx, ny, nz], [1.0; 3], d)
}

#[test]
fn layout_orientation_and_colours() {
    // mask: label 2 at (3, 4, 7) (on the axial mid-slice z = 7), label 1 at (5, 6, 2) (on the
    // coronal mid-slice y = 6), label 3 at (5, 9, 11) (on the sagittal mid-slice x = 5)
    let mask = vol(|x, y, z| match (x, y, z) {
        (3, 4, 7) => 2.0,
        (5, 6, 2) => 1.0,
        (5, 9, 11) => 3.0,
        _ => 0.0,
    });
    let image = vol(|x, _, _| x as f32 * 10.0);
    assert_eq!(guess_kind(&mask), Kind::Labels);
    assert_eq!(guess_kind(&vol(|x, _, _| x as f32 * 0.3)), Kind::Intensity);
    let img = render(&[(&mask, Kind::Labels), (&image, Kind::Intensity)]);
    // scale = ⌈128/14⌉ = 10, gap 4: columns 12·10 wide, rows 12·10, 14·10, 14·10 high
    assert_eq!((img.width(), img.height()), (4 + 120 + 4 + 120 + 4, 4 + 120 + 4 + 140 + 4 + 140 + 4));
    let px = |col0: u32, row0: u32, u: u32, w: u32| img.get_pixel(col0 + u * 10 + 5, row0 + w * 10 + 5).0;
    let (c0, c1) = (4, 4 + 120 + 4);
    let (r0, r1, r2) = (4, 4 + 120 + 4, 4 + 120 + 4 + 140 + 4);
    // axial: u = x, w = (ny − 1) − y
    assert_eq!(px(c0, r0, 3, 11 - 4), PALETTE[2]);
    assert_eq!(px(c0, r0, 4, 11 - 4), PALETTE[0]);
    // coronal: u = x, w = (nz − 1) − z
    assert_eq!(px(c0, r1, 5, 13 - 2), PALETTE[1]);
    // sagittal: u = y, w = (nz − 1) − z
    assert_eq!(px(c0, r2, 9, 13 - 11), PALETTE[3]);
    // intensity column: x = 0 black, x = 9 white, on every plane showing x
    assert_eq!(px(c1, r0, 0, 0), [0, 0, 0]);
    assert_eq!(px(c1, r0, 9, 5), [255, 255, 255]);
    assert_eq!(px(c1, r1, 9, 13), [255, 255, 255]);
    // the sagittal plane of the ramp is the constant x = 5: 50/90 of full scale
    let g = (50.0f32 / 90.0 * 255.0).round() as u8;
    assert_eq!(px(c1, r2, 3, 3), [g, g, g]);

    let path = std::env::temp_dir().join(format!("meddpm-preview-{}.png", std::process::id()));
    write_png(&path, &[(&mask, Kind::Labels), (&image, Kind::Intensity)]).unwrap();
    let back = image::open(&path).unwrap().to_rgb8();
    assert_eq!(back, img);
    std::fs::remove_file(&path).ok();

    // cutting through the centroid of label 2 shows it in all three planes
    let pos = label_position(&mask, 2.0).unwrap();
    assert_eq!(pos, [3.5 / 10.0, 4.5 / 12.0, 7.5 / 14.0]);
    let at = render_at(&[(&mask, Kind::Labels)], pos);
    let px = |row0: u32, u: u32, w: u32| at.get_pixel(4 + u * 10 + 5, row0 + w * 10 + 5).0;
    assert_eq!(px(r0, 3, 11 - 4), PALETTE[2], "axial z = 7");
    assert_eq!(px(r1, 3, 13 - 7), PALETTE[2], "coronal y = 4");
    assert_eq!(px(r2, 4, 13 - 7), PALETTE[2], "sagittal x = 3");
    assert!(label_position(&mask, 5.0).is_none());
}

#[test]
fn a_sample_is_written_with_its_preview_and_viewer_page() {
    let dir = std::env::temp_dir().join(format!("meddpm-preview-sample-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let size = [8, 8, 8];
    let ds = demo::dataset_at(size).unwrap();
    let (_, mask) = ds.condition(0).unwrap();
    let (_, real) = ds.load(0).unwrap();
    let tensor: Vec<f32> = (0..512).map(|i| (i as f32 / 256.0) - 1.0).collect();
    let conv = Convention::whole_head();
    let other = image_volumes(&conv, &tensor.iter().map(|v| -v).collect::<Vec<_>>(), 1, size, &mask).unwrap();
    let stem = dir.join("s");
    let beside = Beside { others: &other, others_name: "other model", real: &real };
    let written = write_sample_with_views(&stem, &conv, &tensor, 1, size, &mask, beside).unwrap();
    let names: Vec<String> = written.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["s.nii.gz", "s.png", "s.html"]);
    // the NIfTI holds what image_volumes gives, on the mask's grid
    let generated = image_volumes(&conv, &tensor, 1, size, &mask).unwrap();
    assert_eq!(generated.len(), 1);
    assert_eq!(read_volume(&written[0]).unwrap().dims, mask.dims);
    // the preview: mask | generated | others | real
    let mut panel: Vec<(&Volume, Kind)> =
        vec![(&mask, Kind::Labels), (&generated[0], Kind::Intensity), (&other[0], Kind::Intensity)];
    panel.extend(real.iter().map(|v| (v, Kind::Intensity)));
    let titled = render_titled(&panel, &["mask", "this run", "other model", "real"], [0.5; 3]);
    assert_eq!(image::open(&written[1]).unwrap().to_rgb8(), titled);
    // the titles sit in a strip above the planes of render()
    let body = render(&panel);
    assert_eq!(titled.width(), body.width());
    assert!(titled.height() > body.height());
    let strip = titled.height() - body.height();
    assert_eq!(image::imageops::crop_imm(&titled, 0, strip, body.width(), body.height()).to_image(), body);
    let lit = (0..titled.width())
        .flat_map(|x| (0..strip).map(move |y| (x, y)))
        .filter(|&(x, y)| titled.get_pixel(x, y).0 == [230, 230, 230])
        .count();
    assert!(lit > 100, "title text drawn ({lit} pixels)");
    let html = std::fs::read_to_string(&written[2]).unwrap();
    assert!(html.contains("s.nii.gz") && html.contains("real"), "viewer layers named");
    assert!(html.contains("other model"), "the PNG's columns are the viewer's: the other model's too");
    assert!(image_volumes(&conv, &tensor, 2, size, &mask).is_err(), "channel count checked");
    std::fs::remove_dir_all(&dir).ok();
}
