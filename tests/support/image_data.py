"""Small image data for the trainer tests: folders (train/<class>/*, val/<class>/*), CIFAR-10 files."""
import pickle

import numpy as np
from PIL import Image


def make_image_folder(root, classes=("cat", "dog", "fox"), train_per_class=4, val_per_class=2):
    """JPEG/PNG/GIF/BMP files in every common Pillow mode and in varied sizes."""
    modes = [("RGB", ".jpg"), ("L", ".png"), ("RGBA", ".png"), ("CMYK", ".jpg"), ("P", ".gif"),
             ("LA", ".png"), ("I;16", ".png"), ("1", ".bmp"), ("L", ".jpg")]
    rng = np.random.default_rng(0)
    count = 0
    for split, per_class in (("train", train_per_class), ("val", val_per_class)):
        for label, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                mode, suffix = modes[count % len(modes)]
                count += 1
                height, width = rng.integers(12, 48, size=2)
                pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
                pixels[..., label] = 255  # a colour cue per class
                image = Image.fromarray(pixels)
                if mode == "I;16":
                    image = Image.fromarray(pixels[..., 0].astype(np.uint16) * 257)
                else:
                    image = image.convert(mode)
                image.save(folder / f"{i}{suffix}")
    return root


def make_cifar10(root, images_per_batch=20):
    """The CIFAR-10 python layout: five training batches and a test batch, pickled."""
    rng = np.random.default_rng(0)
    root.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (images_per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, images_per_batch).tolist()}
        with open(root / name, "wb") as handle:
            pickle.dump(batch, handle)
    return root
