"""A small ResNet-style CNN (He et al. 2016): a stem, residual stages that halve the
resolution and double the channels, global pooling and a classifier.

Its units differ a lot: early blocks hold large activations and few parameters, late
ones the reverse. That is where per-layer decisions (recompute here, not there) beat
any uniform choice. Blocks live in an ``nn.ModuleDict`` so pipeline stages keep names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class CNNConfig:
    """``blocks_per_stage`` residual blocks per stage; stage i has ``width * 2**i``
    channels at resolution ``image_size / 2**i``."""

    in_channels: int = 3
    image_size: int = 32
    width: int = 32
    stages: int = 3
    blocks_per_stage: int = 2
    num_classes: int = 10


class ResBlock(nn.Module):
    """Two 3x3 convolutions with batch norm; a strided 1x1 shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class Stem(nn.Module):
    """3x3 convolution, batch norm, ReLU."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class Head(nn.Module):
    """Global average pooling and a linear classifier."""

    def __init__(self, cin: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


class ResNet(nn.Module):
    """Images ``(batch, in_channels, H, W)`` -> logits ``(batch, num_classes)``."""

    def __init__(self, cfg: CNNConfig):
        super().__init__()
        self.config = cfg
        self.stem: Stem | None = Stem(cfg.in_channels, cfg.width)
        blocks: dict[str, nn.Module] = {}
        cin = cfg.width
        for s in range(cfg.stages):
            cout = cfg.width * 2**s
            for b in range(cfg.blocks_per_stage):
                blocks[str(len(blocks))] = ResBlock(cin, cout, stride=2 if (b == 0 and s > 0) else 1)
                cin = cout
        self.layers = nn.ModuleDict(blocks)
        self.head: Head | None = Head(cin, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x) if self.stem is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h
