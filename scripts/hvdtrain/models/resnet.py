"""ResNets for image classification, plain PyTorch (no Horovod, no torchvision).

* CIFAR-style ResNet-20/56 (He et al. 2016, section 4.2): a 3x3 stem, three
  stages of 16/32/64 channels, parameter-free (zero-padding) shortcuts.
* ImageNet-style ResNet-18/50 (He et al. 2016, table 1): a 7x7 stem with max
  pooling, four stages, basic or bottleneck blocks, projection shortcuts.
* ``convnet``: a small CNN without normalisation layers, whose result does not
  depend on how a batch is split across workers (used by the np-invariance test).

Every residual block's last BatchNorm starts at zero (Goyal et al. 2017): each
block begins as the identity, which keeps large-batch training with warmup stable.
"""
import torch.nn as nn
import torch.nn.functional as F


def _bn(channels, zero=False):
    norm = nn.BatchNorm2d(channels)
    if zero:
        nn.init.zeros_(norm.weight)
    return norm


class CifarBlock(nn.Module):
    """Two 3x3 convolutions; the shortcut subsamples and zero-pads ("option A")."""

    def __init__(self, in_channels, channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = _bn(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = _bn(channels, zero=True)
        self.stride = stride
        self.extra_channels = channels - in_channels

    def shortcut(self, x):
        if self.stride > 1:
            x = x[:, :, ::self.stride, ::self.stride]
        if self.extra_channels:
            x = F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))
        return x

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for small images (CIFAR: 32x32; works from 8x8 up)."""

    def __init__(self, blocks_per_stage, num_classes=10, in_channels=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False),
                                  _bn(16), nn.ReLU(inplace=True))
        layers, channels = [], 16
        for stage, width in enumerate((16, 32, 64)):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(CifarBlock(channels, width, stride))
                channels = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        _init_convs(self)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_channels, channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = _bn(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = _bn(channels, zero=True)
        self.shortcut = _projection(in_channels, channels, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, as in the "v1.5" ResNet-50), 1x1 expand."""
    expansion = 4

    def __init__(self, in_channels, channels, stride):
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = _bn(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride, 1, bias=False)
        self.bn2 = _bn(channels)
        self.conv3 = nn.Conv2d(channels, out_channels, 1, bias=False)
        self.bn3 = _bn(out_channels, zero=True)
        self.shortcut = _projection(in_channels, out_channels, stride)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


def _projection(in_channels, out_channels, stride):
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                         _bn(out_channels))


class ImageNetResNet(nn.Module):
    def __init__(self, block, blocks_per_stage, num_classes=1000, in_channels=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False), _bn(64),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        layers, channels = [], 64
        for stage, count in enumerate(blocks_per_stage):
            width = 64 * 2 ** stage
            for index in range(count):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(block(channels, width, stride))
                channels = width * block.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(channels, num_classes)
        _init_convs(self)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class ConvNet(nn.Module):
    """Two convolutions and a linear layer; no normalisation, so no batch statistics."""

    def __init__(self, num_classes=10, in_channels=3):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 3, 1, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1, 1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _init_convs(model):
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")


MODELS = {
    "resnet20": lambda **kw: CifarResNet(3, **kw),
    "resnet56": lambda **kw: CifarResNet(9, **kw),
    "resnet18": lambda **kw: ImageNetResNet(BasicBlock, (2, 2, 2, 2), **kw),
    "resnet50": lambda **kw: ImageNetResNet(Bottleneck, (3, 4, 6, 3), **kw),
    "convnet": lambda **kw: ConvNet(**kw),
}


def build(name, num_classes, in_channels=3):
    """A freshly initialised model by name (see ``MODELS``)."""
    return MODELS[name](num_classes=num_classes, in_channels=in_channels)
