"""The image-folder transform: JPEGs decoded at a reduced scale give the same crops,
and a sample is a function of (seed, epoch, index) alone (what makes resume bit-exact)."""
import pytest
import torch

from hvdtrain.data import images
from support.image_data import make_photo_folder

SIZE = 64  # crops of 128 px and more decode at 1/2, of 256 px at 1/4


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = make_photo_folder(tmp_path_factory.mktemp("photos"), 40)
    _, train, val = images.scan_image_folder(root)
    return train, val


def both_paths(samples, train):
    """Every sample's pixels through the reduced decode and through the full-size reference."""
    reduced = images.ImageFolder(samples, SIZE, train, seed=3)
    full = images.ImageFolder(samples, SIZE, train, seed=3, reduced_decode=False)
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
