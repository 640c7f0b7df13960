"""Synthetic (image, label) pairs from meddpm in a MONAI training loop.

`SyntheticPairs` is a `torch.utils.data.Dataset`: item i samples the volume for mask i mod
len(masks) with seed `seed + i` (the same volume every epoch, made on demand), and returns a
MONAI-style dict of channel-first tensors. `main()` trains a small MONAI U-Net on it for a few
steps. Run: `python monai_dataset.py` (the bundled demo model and masks; CPU).
"""

from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import meddpm


class SyntheticPairs(Dataset):
    def __init__(self, model, masks, length, steps=10, sampler="ddpm", seed=0):
        self.model, self.masks, self.length = model, list(masks), length
        self.steps, self.sampler, self.seed = steps, sampler, seed

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        mask = self.masks[i % len(self.masks)]
        labels = np.asarray(mask.get_fdata(), dtype=np.float32)
        image, _affine = self.model.sample(mask, steps=self.steps, sampler=self.sampler, seed=self.seed + i)
        return {
            "image": torch.from_numpy(image[None].copy()),  # (1, X, Y, Z)
            "label": torch.from_numpy(labels[None].astype(np.int64)),
        }


def main(iterations=2, steps=2):
    from monai.losses import DiceCELoss
    from monai.networks.nets import UNet

    demo = Path(__file__).resolve().parents[3] / "testdata" / "demo" / "mask"
    masks = [nib.load(str(p)) for p in sorted(demo.glob("*.nii.gz"))]
    data = SyntheticPairs(meddpm.load(device="cpu"), masks, length=4, steps=steps)
    loader = DataLoader(data, batch_size=2, shuffle=True)
    net = UNet(spatial_dims=3, in_channels=1, out_channels=3, channels=(8, 16), strides=(2,), num_res_units=1)
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    losses = []
    for _ in range(iterations):
        for batch in loader:
            opt.zero_grad()
            loss = loss_fn(net(batch["image"]), batch["label"])
            loss.backward()
            opt.step()
            losses.append(float(loss))
    return losses


if __name__ == "__main__":
    print(main())
