"""Tiny NIfTI fixtures written by nibabel (an independent writer) for meddpm's reader tests.

Run from this folder: `python3 make_fixtures.py` (needs nibabel + numpy). Writes the .nii/.nii.gz
files and expected.json: for each readable file its shape, zooms, nibabel's affine and
get_fdata() in x-fastest order; for each bad file the fact that it must be refused.
Voxel pattern: base = x + 4y + 20z on a 4x5x6 grid (0..119, unique per voxel).
"""
import json

import nibabel as nib
import numpy as np

shape = (4, 5, 6)
x, y, z = np.meshgrid(range(4), range(5), range(6), indexing="ij")
base = (x + 4 * y + 20 * z).astype(np.float64)

aff = np.array([[1.5, 0, 0, -3.0], [0, 2.0, 0, 4.5], [0, 0, 2.5, -7.25], [0, 0, 0, 1]])
c, s = np.cos(0.3), np.sin(0.3)
rot = np.array([[c, -s, 0, 10.0], [s, c, 0, -20.0], [0, 0, 1, 30.0], [0, 0, 0, 1]]) @ np.diag([1.2, 1.2, 3.0, 1])

expected = {}


def save(name, img):
    nib.save(img, name)
    back = nib.load(name)
    data = back.get_fdata()
    expected[name] = {
        "shape": list(data.shape),
        "zooms": [float(v) for v in back.header.get_zooms()[:3]],
        "affine": back.affine.tolist(),
        "data": data.ravel(order="F").tolist(),
    }


save("u8.nii.gz", nib.Nifti1Image(base.astype(np.uint8), aff))

img = nib.Nifti1Image((base - 60).astype(np.int16), aff)
img.header.set_slope_inter(0.5, 10.0)
save("i16_scaled.nii.gz", img)

save("i32.nii", nib.Nifti1Image((base * 1000 - 5).astype(np.int32), aff))
save("f32.nii.gz", nib.Nifti1Image((base * 0.25 - 3).astype(np.float32), aff))
save("f64.nii.gz", nib.Nifti1Image(base / 3.0, aff))

hdr = nib.Nifti1Header(endianness=">")
save("i16_bigendian.nii.gz", nib.Nifti1Image((base - 60).astype(np.int16), aff, header=hdr))

img = nib.Nifti1Image(base.astype(np.float32), None)
img.set_qform(rot, code=1)
img.set_sform(None, code=0)
save("qform_only.nii.gz", img)

img = nib.Nifti1Image(base.astype(np.float32), None)
img.header.set_zooms((1.5, 2.0, 2.5))
img.set_qform(None, code=0)
img.set_sform(None, code=0)
save("no_xform.nii.gz", img)

save("singleton_4d.nii.gz", nib.Nifti1Image(base.astype(np.float32)[..., None], aff))

# must be refused
bad = {}
nib.save(nib.Nifti1Image(np.zeros((4, 5, 6, 2), np.float32), aff), "four_d.nii.gz")
bad["four_d.nii.gz"] = "3-D"
nib.save(nib.Nifti1Image(np.zeros((4, 5), np.float32), np.eye(4)), "two_d.nii.gz")
bad["two_d.nii.gz"] = "3-D"
a = base.astype(np.float32).copy()
a[1, 2, 3] = np.nan
nib.save(nib.Nifti1Image(a, aff), "nan.nii.gz")
bad["nan.nii.gz"] = "NaN"
a = base.astype(np.float32).copy()
a[3, 0, 5] = np.inf
nib.save(nib.Nifti1Image(a, aff), "inf.nii.gz")
bad["inf.nii.gz"] = "NaN or Inf"
nib.save(nib.Nifti2Image(base.astype(np.float32), aff), "nifti2.nii.gz")
bad["nifti2.nii.gz"] = "NIfTI-2"

with open("expected.json", "w") as f:
    json.dump({"good": expected, "bad": bad}, f, indent=0)
