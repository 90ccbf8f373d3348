"""Image data sets for the CNN trainer: digits, cifar10, imagefolder, synthetic.

No torchvision: images are read with Pillow and transformed with torch ops.
Random augmentation never touches the global RNG: each sample draws from a
generator seeded by (seed, epoch, sample index), so a sample is augmented the
same way whichever rank, DataLoader worker or resumed run loads
it. That is what makes stop-and-resume bit-exact and the result independent of
how the global batch is split across workers.
"""
import functools
import importlib.util
import math
import pickle
from pathlib import Path

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from hvdtrain.errors import UsageError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
# ImageFolder hands the bytes of a decoded crop to torch without a copy; they are only read.
warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning, __name__)
# Native resolution of each data set; --image-size overrides it.
DEFAULT_IMAGE_SIZE = {"digits": 16, "cifar10": 32, "imagefolder": 224, "synthetic": 32}


def sample_key(seed, epoch, index):
    """A sample's random key: a function of (seed, epoch, index) alone."""
    return ((seed * 1_000_003 + epoch) * 2_000_000_011 + index) % (2**63 - 1)


def sample_generator(seed, epoch, index):
    """A generator that depends only on (seed, epoch, index)."""
    return torch.Generator().manual_seed(sample_key(seed, epoch, index))


class KeyedDataset(Dataset):
    """A data set whose random augmentation is keyed to (seed, epoch, index)."""

    seed = 0
    epoch = 0

    def set_epoch(self, epoch):
        """Call before iterating: DataLoader workers copy the data set at that moment."""
        self.epoch = epoch


class TensorImages(KeyedDataset):
    """Images held in memory as an (N, C, H, W) tensor; optional pad-and-crop and flip."""

    def __init__(self, images, labels, mean, std, size, train, pad=0, flip=False, seed=0):
        self.images, self.labels = images, labels
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)
        self.size, self.train, self.pad, self.flip, self.seed = size, train, pad, flip, seed

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index].float()
        if image.shape[-1] != self.size or image.shape[-2] != self.size:
            image = F.interpolate(image[None], size=(self.size, self.size), mode="bilinear",
                                  align_corners=False)[0]
        if self.train and (self.pad or self.flip):
            generator = sample_generator(self.seed, self.epoch, index)
            image = _pad_crop_flip(image, self.pad, self.flip, generator)
        return (image - self.mean) / self.std, int(self.labels[index])


def _pad_crop_flip(image, pad, flip, generator):
    """Random translation by up to ``pad`` pixels (zero fill), then maybe a mirror."""
    dy, dx, mirror = torch.randint(0, 2 * pad + 1, (2,), generator=generator).tolist() + \
        [bool(torch.rand(1, generator=generator) < 0.5)]
    if pad:
        height, width = image.shape[-2:]
        image = F.pad(image, (pad, pad, pad, pad))[:, dy:dy + height, dx:dx + width]
    if flip and mirror:
        image = image.flip(-1)
    return image


def digits(size, seed, val_fraction=0.2):
    """scikit-learn's 1,797 handwritten 8x8 digits, upscaled; a fixed validation split.

    The split uses its own fixed seed, so --seed changes training, not what is measured.
    """
    pixels, targets = _digits_arrays()
    images = torch.tensor(pixels, dtype=torch.float32)[:, None] / 16.0
    images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    labels = torch.tensor(targets, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(12345))
    n_val = int(round(len(labels) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    mean, std = (float(images[train].mean()),), (float(images[train].std()),)
    # One 8x8 pixel of translation; no mirroring (a mirrored digit is another symbol).
    pad = max(1, size // 8)
    return (TensorImages(images[train], labels[train], mean, std, size, True, pad, False, seed),
            TensorImages(images[val], labels[val], mean, std, size, False), 10, 1)


def _digits_arrays():
    """(N x 8 x 8 pixels in 0..16, labels), as sklearn.datasets.load_digits returns them."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec else None
    if path is not None and path.is_file():
        # The file load_digits reads; importing sklearn.datasets costs each rank
        # seconds of SciPy imports, on every launch.
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits
    bunch = load_digits()
    return bunch.images, bunch.target


def cifar10(directory, size, seed):
    """The CIFAR-10 "python version" directory (data_batch_1..5, test_batch)."""
    directory = Path(directory)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise UsageError(f"{directory} is not a CIFAR-10 python batches directory: "
                         f"missing {', '.join(missing)}")
    batches = [_read_cifar_batch(directory / n) for n in names]
    train_x = torch.cat([b[0] for b in batches[:5]])
    train_y = torch.cat([b[1] for b in batches[:5]])
    val_x, val_y = batches[5]
    return (TensorImages(train_x, train_y, CIFAR_MEAN, CIFAR_STD, size, True, size // 8, True, seed),
            TensorImages(val_x, val_y, CIFAR_MEAN, CIFAR_STD, size, False), 10, 3)


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles only what CIFAR-10's batches hold: plain values and NumPy arrays.

    ``pickle.load`` would call any function a crafted file names (e.g.
    ``os.system``) before a format check could look at the result.
    """
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
               ("numpy", "ndarray"), ("numpy", "dtype"),
               ("_codecs", "encode")}  # bytes in a protocol-2 pickle written by Python 3

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR-10 batch never holds")


def _read_cifar_batch(path):
    try:
        with open(path, "rb") as handle:
            batch = _CifarUnpickler(handle, encoding="bytes").load()  # the data set's own format
    except pickle.UnpicklingError as error:
        raise UsageError(f"refusing CIFAR-10 batch {path}: {error}") from None
    except Exception as error:
        raise UsageError(f"cannot read CIFAR-10 batch {path}: {error.__class__.__name__}") from None
    try:
        data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except Exception as error:
        raise UsageError(f"cannot read CIFAR-10 batch {path}: {error.__class__.__name__}") from None
    return torch.from_numpy(data.copy()), torch.from_numpy(labels)


class SyntheticImages(KeyedDataset):
    """Random images and labels for benchmarks: a fixed pool, repeated to ``length``."""

    def __init__(self, length, size, num_classes, seed, pool=64):
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randn(pool, 3, size, size, generator=generator)
        self.labels = torch.randint(0, num_classes, (pool,), generator=generator)
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        slot = index % len(self.labels)
        return self.images[slot], int(self.labels[slot])


def synthetic(size, seed, train_samples, val_samples=256, num_classes=1000):
    return (SyntheticImages(train_samples, size, num_classes, seed),
            SyntheticImages(val_samples, size, num_classes, seed + 1), num_classes, 3)


# ---- imagefolder: train/<class>/<image>, val/<class>/<image> ----

def scan_image_folder(root):
    """(class names, [(path, class index)] for train, same for val); clear errors."""
    root = Path(root)
    if not root.is_dir():
        raise UsageError(f"data directory not found: {root}")
    if not any(root.iterdir()):
        raise UsageError(f"data directory is empty: {root} (expected train/<class>/<image> "
                         f"and val/<class>/<image>)")
    train_dir, val_dir = root / "train", root / "val"
    if not train_dir.is_dir() or not val_dir.is_dir():
        raise UsageError(f"data directory {root} is incomplete: expected "
                         f"train/<class>/<image> and val/<class>/<image>")
    classes = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
    if not classes:
        raise UsageError(f"no class folders in {train_dir} (expected train/<class>/<image>)")
    train = _list_images(train_dir, classes, require_all=True)
    val_classes = [p.name for p in val_dir.iterdir() if p.is_dir()]
    unknown = sorted(set(val_classes) - set(classes))
    if unknown:
        raise UsageError(f"{val_dir} has classes not in {train_dir}: {', '.join(unknown)}")
    val = _list_images(val_dir, classes, require_all=False)
    if not val:
        raise UsageError(f"no images in {val_dir}")
    return classes, train, val


def _list_images(split_dir, classes, require_all):
    samples = []
    for label, name in enumerate(classes):
        folder = split_dir / name
        files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES
                       and p.is_file()) if folder.is_dir() else []
        if not files and require_all:
            raise UsageError(f"class folder {folder} has no images "
                             f"({', '.join(IMAGE_SUFFIXES)})")
        samples.extend((str(path), label) for path in files)
    return samples


def verify_images(paths, on_file=None):
    """Open and fully decode each file; UsageError naming the first bad one.

    ``on_file`` is called after each file (e.g. a stall watchdog's beat)."""
    from PIL import Image
    for path in paths:
        try:
            with Image.open(path) as image:
                image.verify()  # structure and checksums (PNG CRCs)
            with Image.open(path) as image:
                image.load()  # the pixel data itself: catches truncated files
        except Exception as error:
            raise UsageError(f"cannot read image {path}: {error}") from None
        if on_file is not None:
            on_file()


def load_rgb(path):
    """Any Pillow mode (L, P, RGBA, CMYK, I;16, ...) as 8-bit RGB."""
    from PIL import Image
    with Image.open(path) as image:
        return as_rgb(image)


def as_rgb(image):
    """An opened image, decoded, as 8-bit RGB (the image itself when it is RGB already)."""
    from PIL import Image
    image.load()
    if image.mode == "RGB":
        return image
    if image.mode == "P" or image.mode == "LA":
        image = image.convert("RGBA")  # palette transparency without a warning
    if image.mode.startswith("I"):  # 16/32-bit grey: scale to 8 bits
        array = np.asarray(image, dtype=np.float64)
        peak = 65535.0 if array.max() > 255 else 255.0
        image = Image.fromarray((array * (255.0 / peak)).clip(0, 255).astype(np.uint8))
    return image.convert("RGB")


def normalize_pixels(batch):
    """ImageFolder's uint8 batch as floats, ImageNet-normalised, on the batch's device."""
    multiplier, offset = _normalization(batch.device)
    return torch.addcmul(offset, batch.float(), multiplier)


@functools.lru_cache(maxsize=None)
def _normalization(device):
    """(x / 255 - mean) / std as one multiply-add: the multiplier and the offset."""
    mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
    return (1.0 / (255.0 * std)).view(3, 1, 1).to(device), (-mean / std).view(3, 1, 1).to(device)


def reduced_decode(image, box, size):
    """Have a JPEG decoded at 1/2, 1/4 or 1/8 scale where the crop ``box`` keeps at
    least ``size`` pixels a side, and return the box in the reduced image.

    libjpeg scales in the DCT domain while it decodes (Pillow's ``draft``): a crop
    that is downscaled anyway costs a fraction of the full decode. The crop stays
    the same region of the picture, so the augmentation is unchanged; the pixels
    differ by resampling only (tests/test_images.py compares them). Other formats,
    and crops smaller than twice ``size``, decode at full size."""
    crop_side = min(box[2] - box[0], box[3] - box[1])
    factor = next((f for f in (8, 4, 2) if crop_side >= f * size), 1)
    if factor == 1:
        return box
    width, height = image.size
    drafted = image.draft(None, (width // factor, height // factor))
    if drafted is None:  # not a JPEG (or already configured)
        return box
    scale = width / drafted[1][2]
    return tuple(x / scale for x in box)


def decode_rows(image, bottom):
    """Decode an opened image's rows above ``bottom``; True when they are all there.

    libjpeg decodes a JPEG from the top down, and the rows below a crop are never
    looked at: told that the image ends at ``bottom``, Pillow's decoder stops there
    (the rows above are bit for bit those of a whole decode). libjpeg then reports
    the rows it was not asked for as an error that a broken file raises too; a
    broken file writes no rows into the new image, which Pillow fills with zeros, so
    a last row of zeros answers False: decode the file whole (a photo whose row
    happens to be black costs that second decode, never a wrong pixel)."""
    width, height = image.size
    tile = image.tile[0] if len(image.tile) == 1 else None
    if image.format != "JPEG" or tile is None or tile[0] != "jpeg" or bottom >= height:
        image.load()
        return True
    image.tile = [tile._replace(extents=(0, 0, width, bottom))]
    try:
        image.load()
    except OSError:  # "broken data stream": the rows below bottom, or a broken file
        pass
    return any(image.crop((0, bottom - 1, width, bottom)).tobytes())


class ImageFolder(KeyedDataset):
    """Files decoded with Pillow. Training: random-resized-crop + flip; validation:
    centre crop of 87.5% of the short side (the usual resize-256, crop-224).

    A sample is 3 x size x size uint8 pixels: the trainer normalises whole batches on
    its device (``normalize_pixels``), and a worker hands it a quarter of the bytes
    that floats would take. The crop is drawn from the file's header before anything
    is decoded, so that a JPEG is decoded only as far as the crop needs: at the
    smallest scale the crop allows (``reduced_decode``) and down to the crop's last
    row (``partial_rows``). Both False decode every file whole, at full size: the
    reference of the tests and of tools/measure_image_pipeline.py."""

    def __init__(self, samples, size, train, seed=0, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                 reduced_decode=True, partial_rows=True):
        self.samples, self.size, self.train, self.seed = samples, size, train, seed
        self.scale, self.ratio = scale, ratio
        self.reduced_decode, self.partial_rows = reduced_decode, partial_rows

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, label = self.samples[index]
        crop, mirror = (self._decoded_crop(path, index, self.partial_rows)
                        or self._decoded_crop(path, index, partial_rows=False))
        # Pillow's own 4-byte pixels (RGBX) are the channels-last layout of torch's vectorised
        # uint8 resize: the bilinear filter with antialiasing of Pillow's resize, 4x faster here.
        width, height = crop.size
        pixels = torch.frombuffer(crop.tobytes("raw", "RGBX"), dtype=torch.uint8)  # read only: a new tensor below
        pixels = pixels.view(1, height, width, 4).permute(0, 3, 1, 2)
        pixels = F.interpolate(pixels, size=(self.size, self.size), mode="bilinear", antialias=True)
        if mirror:  # on the whole channels-last result: 8x cheaper than on its 3-channel view
            pixels = pixels.flip(-1)
        return pixels[0, :3], label

    def _decoded_crop(self, path, index, partial_rows):
        """(the crop as an RGB image, whether to mirror it); None where the rows that a
        partial decode left cannot be vouched for (``decode_rows``)."""
        from PIL import Image
        with Image.open(path) as image:
            if self.train:
                generator = sample_generator(self.seed, self.epoch, index)
                box = self._random_box(image.size, generator)
                mirror = bool(torch.rand(1, generator=generator) < 0.5)
            else:
                box, mirror = _centre_box(image.size, 0.875), False
            if self.reduced_decode:
                box = reduced_decode(image, box, self.size)
            if partial_rows and not decode_rows(image, min(image.size[1], math.ceil(box[3]))):
                return None
            return as_rgb(image).crop(box), mirror  # a reduced box rounds to whole pixels of the reduced image

    def _random_box(self, image_size, generator):
        """RandomResizedCrop's box: random area fraction and log-uniform aspect ratio."""
        width, height = image_size
        area = width * height
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            u = torch.rand(4, generator=generator).tolist()
            target = area * (self.scale[0] + u[0] * (self.scale[1] - self.scale[0]))
            aspect = math.exp(log_lo + u[1] * (log_hi - log_lo))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                left = int(u[2] * (width - w + 1))
                top = int(u[3] * (height - h + 1))
                return (left, top, left + w, top + h)
        return _centre_box(image_size, 1.0)


def _centre_box(image_size, fraction):
    width, height = image_size
    side = max(1, int(min(width, height) * fraction))
    left, top = (width - side) // 2, (height - side) // 2
    return (left, top, left + side, top + side)


def image_folder(root, size, seed, verify_share=None, on_file=None):
    """``verify_share=(rank, size)``: decode every size-th file from rank first."""
    classes, train, val = scan_image_folder(root)
    if verify_share is not None:
        rank, size_ = verify_share
        verify_images([path for path, _ in train + val][rank::size_], on_file)
    return (ImageFolder(train, size, True, seed), ImageFolder(val, size, False), len(classes), 3)


def load(dataset, data_dir, image_size, seed, synthetic_samples=4096, verify_share=None,
         on_file=None):
    """(train set, val set, number of classes, channels) for a data set name; UsageError
    for bad input. ``image_size`` None means the data set's native size."""
    size = image_size or DEFAULT_IMAGE_SIZE[dataset]
    if dataset == "digits":
        return digits(size, seed)
    if dataset == "synthetic":
        return synthetic(size, seed, synthetic_samples)
    if not data_dir:
        raise UsageError(f"--dataset {dataset} needs --data DIR")
    if not Path(data_dir).is_dir():
        raise UsageError(f"data directory not found: {data_dir}")
    if dataset == "cifar10":
        return cifar10(data_dir, size, seed)
    return image_folder(data_dir, size, seed, verify_share, on_file)
