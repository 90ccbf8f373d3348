"""The image-folder transform: JPEGs decoded at a reduced scale give the same crops,
JPEGs decoded down to the crop's last row give the very same pixels, and a sample is
a function of (seed, epoch, index) alone (what makes resume bit-exact)."""
import numpy as np
import pytest
import torch
from PIL import Image

from hvdtrain.data import images
from support.image_data import make_photo, make_photo_folder

SIZE = 64  # crops of 128 px and more decode at 1/2, of 256 px at 1/4


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = make_photo_folder(tmp_path_factory.mktemp("photos"), 40)
    _, train, val = images.scan_image_folder(root)
    return train, val


def both_paths(samples, train):
    """Every sample's pixels through the reduced decode and through the full-size reference."""
    reduced = images.ImageFolder(samples, SIZE, train, seed=3)
    full = images.ImageFolder(samples, SIZE, train, seed=3, reduced_decode=False, partial_rows=False)
    return (torch.stack([reduced[i][0] for i in range(len(samples))]).float(),
            torch.stack([full[i][0] for i in range(len(samples))]).float())


@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_a_reduced_decode_gives_the_full_decode_s_crop(photos, train):
    """The same region of the same picture, resampled another way: per image and per
    channel the means agree within a grey level and the spreads within 2 %, and the
    pixels themselves differ by under 3 levels on average (edges and grain, resampled;
    the reduced box rounds to whole pixels, at SIZE up to 1/8 of a crop's width)."""
    samples = photos[0] if train else photos[1]
    reduced, full = both_paths(samples, train)
    difference = (reduced - full).abs()
    changed = (difference.flatten(1).max(1).values > 1).sum().item()
    assert changed >= len(samples) // 4, f"only {changed} of {len(samples)} crops decoded at a reduced scale"
    assert difference.mean() < 3, f"mean difference of {difference.mean():.2f} grey levels"
    mean_gap = (reduced.mean((2, 3)) - full.mean((2, 3))).abs()
    assert mean_gap.max() < 1, f"an image's channel mean moved {mean_gap.max():.2f} levels"
    spread = reduced.std((2, 3)) / full.std((2, 3))
    assert 0.98 < spread.min() and spread.max() < 1.02, (spread.min(), spread.max())


@pytest.fixture(scope="module")
def jpeg_kinds(tmp_path_factory):
    """Photos as libjpeg meets them: 4:2:0, 4:4:4, progressive, grey, CMYK, and with a
    black lower half (where a crop's last row is all zeros)."""
    root = tmp_path_factory.mktemp("kinds")
    rng = np.random.default_rng(4)
    for i in range(4):
        make_photo(rng, root / f"{i}.jpg")
        photo = Image.open(root / f"{i}.jpg")
        photo.save(root / f"{i}-444.jpg", subsampling=0, quality=95)
        photo.save(root / f"{i}-progressive.jpg", progressive=True, quality=85)
        photo.convert("L").save(root / f"{i}-grey.jpg")
        photo.convert("CMYK").save(root / f"{i}-cmyk.jpg")
        pixels = np.asarray(photo).copy()
        pixels[len(pixels) // 2:] = 0
        Image.fromarray(pixels).save(root / f"{i}-black-below.jpg", quality=90)
    return [(str(path), 0) for path in sorted(root.iterdir())]


def test_a_jpeg_decoded_down_to_the_crop_s_last_row_gives_the_whole_decode_s_pixels(jpeg_kinds, monkeypatch):
    """Bit for bit, at a size that needs every kind of crop, for two epochs of crops;
    crops that end in a black row decode the file whole a second time, and do."""
    answers = []  # (whether the crop ends above the last row, whether decode_rows vouched for its rows)
    decode_rows = images.decode_rows

    def recording_decode_rows(image, bottom):
        answers.append((bottom < image.size[1], decode_rows(image, bottom)))
        return answers[-1][1]
    monkeypatch.setattr(images, "decode_rows", recording_decode_rows)
    for train in (True, False):
        partial = images.ImageFolder(jpeg_kinds, 48, train, seed=1, reduced_decode=False)
        whole = images.ImageFolder(jpeg_kinds, 48, train, seed=1, reduced_decode=False, partial_rows=False)
        for epoch in (0, 1):
            partial.set_epoch(epoch)
            whole.set_epoch(epoch)
            for i, (path, _) in enumerate(jpeg_kinds):
                assert torch.equal(partial[i][0], whole[i][0]), f"{path}, epoch {epoch}"
    assert answers.count((True, True)) >= len(jpeg_kinds), "too few crops decoded partially"
    assert (True, False) in answers, "no crop ended in a black row: the second decode went untested"


def test_a_broken_jpeg_raises_as_a_whole_decode_does(tmp_path):
    """A corrupt Huffman table breaks the decode before any row: that error, not a black crop."""
    make_photo(np.random.default_rng(0), tmp_path / "photo.jpg")
    data = bytearray((tmp_path / "photo.jpg").read_bytes())
    table = data.find(b"\xff\xc4")
    data[table + 5:table + 25] = b"\xff" * 20
    (tmp_path / "broken.jpg").write_bytes(data)
    for partial_rows in (True, False):
        dataset = images.ImageFolder([(str(tmp_path / "broken.jpg"), 0)], 64, True, partial_rows=partial_rows)
        with pytest.raises(OSError, match="broken data stream"):
            dataset[0]


def test_pixels_are_normalised_as_imagenet_s_mean_and_spread():
    """The trainer's batch normalisation: (x / 255 - mean) / std, per channel."""
    pixels = torch.tensor([0, 128, 255], dtype=torch.uint8).view(1, 1, 1, 3).expand(2, 3, 4, 3)
    mean = torch.tensor(images.IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(images.IMAGENET_STD).view(3, 1, 1)
    expected = (pixels.float() / 255 - mean) / std
    assert torch.allclose(images.normalize_pixels(pixels), expected, atol=1e-6)


def test_a_sample_depends_on_seed_epoch_and_index_only(photos):
    """Loaded in another order, by another instance (another worker or a resumed run):
    the same tensors. Another epoch or seed draws other crops."""
    train, _ = photos
    first = images.ImageFolder(train, SIZE, True, seed=5)
    second = images.ImageFolder(train, SIZE, True, seed=5)
    first.set_epoch(2)
    second.set_epoch(2)
    order = [7, 0, 31, 7, 12]
    forward = [first[i][0] for i in order]
    backward = [second[i][0] for i in reversed(order)][::-1]
    assert all(torch.equal(a, b) for a, b in zip(forward, backward))
    second.set_epoch(3)
    assert not torch.equal(second[7][0], forward[0])
    other_seed = images.ImageFolder(train, SIZE, True, seed=6)
    other_seed.set_epoch(2)
    assert not torch.equal(other_seed[7][0], forward[0])
