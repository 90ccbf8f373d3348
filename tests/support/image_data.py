"""Small image data for the trainer tests: folders (train/<class>/*, val/<class>/*), CIFAR-10 files."""
import pickle

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


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


def make_photo_folder(root, count, classes=10, seed=0, quality=90):
    """ImageNet-like JPEGs (sides of 300-500 px, quality 90): ``count`` for train, a tenth for val."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", count), ("val", max(classes, count // 10))):
        for i in range(n):
            folder = root / split / f"class{i % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            make_photo(rng, folder / f"{i}.jpg", quality)
    return root


def make_photo(rng, path, quality=90):
    """A photo-like JPEG: smooth colour fields, shapes with edges, a blur, luminance grain.
    It compresses like a photograph (about 2-3 bits a pixel at quality 90), where noise would
    not compress at all and flat colour would decode faster than any photograph."""
    width, height = (int(x) for x in rng.integers(300, 501, size=2))
    field = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    image = Image.fromarray(field).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        x1, y1 = x0 + int(rng.integers(20, width // 2)), y0 + int(rng.integers(20, height // 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    image = image.filter(ImageFilter.GaussianBlur(1.2))
    pixels = np.asarray(image, dtype=np.int16) + rng.normal(0, 7, (height, width, 1)).astype(np.int16)
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=quality)


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
