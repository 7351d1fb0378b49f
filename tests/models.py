"""Torch models exported to ONNX for the end-to-end tests.

Every builder seeds torch, so weights (and thus golden data) are deterministic.
Exports use the TorchScript exporter (``dynamo=False``, opset 13) without
constant folding, so BatchNormalization stays a real ONNX node (irgen folds
it itself).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn


class SmallCNN(nn.Module):
    """conv+BN+relu, residual add, maxpool, avgpool, concat, transpose, flatten, gemm, softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.avg = nn.AvgPool2d(3, stride=1, padding=1)
        self.c3 = nn.Conv2d(16, 8, 1, stride=2)
        self.c4 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.bn1(self.c1(x)))           # 8x16x16
        b = torch.relu(self.bn2(self.c2(a)) + a)        # residual add
        p = self.pool(b)                                # 8x8x8
        q = self.avg(p)                                 # 8x8x8
        c = torch.cat([p, q], dim=1)                    # 16x8x8
        d = torch.relu(self.c3(c))                      # 8x4x4
        e = d.permute(0, 1, 3, 2)                       # transpose
        f = torch.relu(self.c4(e))
        g = torch.flatten(f, 1)
        return torch.softmax(self.fc(g), dim=1)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(32, 64)
        self.l2 = nn.Linear(64, 48)
        self.l3 = nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.l1(x))
        x = torch.sigmoid(self.l2(x))
        return self.l3(x)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """ResNet-18 layout (BasicBlocks [2, 2, 2, 2], 64..512 channels), written by hand."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], 64
        for i, cout in enumerate([64, 128, 256, 512]):
            for j in range(2):
                blocks.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
        x = self.blocks(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


class InvertedResidual(nn.Module):
    """MobileNetV3-style block: 1x1 expand + ReLU6, depthwise 3x3 + Hardswish,
    squeeze-excite (mean, 1x1, ReLU, 1x1, sigmoid, multiply), 1x1 project, residual add."""

    def __init__(self, c: int, expand: int) -> None:
        super().__init__()
        e = c * expand
        self.pw = nn.Sequential(nn.Conv2d(c, e, 1), nn.BatchNorm2d(e), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(e, e, 3, padding=1, groups=e), nn.BatchNorm2d(e), nn.Hardswish())
        self.se1, self.se2 = nn.Conv2d(e, 8, 1), nn.Conv2d(8, e, 1)
        self.pj = nn.Sequential(nn.Conv2d(e, c, 1), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(self.pw(x))
        w = torch.sigmoid(self.se2(torch.relu(self.se1(y.mean((2, 3), keepdim=True)))))
        return x + self.pj(y * w)


class MobileNet(nn.Module):
    """A small MobileNetV3-like classifier ending in softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.b1, self.b2 = InvertedResidual(16, 4), InvertedResidual(16, 3)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b2(self.b1(self.stem(x)))
        return torch.softmax(self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)), -1)


def _randomize_bn(model: nn.Module) -> None:
    """Non-trivial BN statistics, so folding them is actually tested."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)


BUILDERS = {
    "small_cnn": (SmallCNN, (1, 3, 16, 16)),
    "mlp": (MLP, (4, 32)),
    "resnet18": (ResNet18, (1, 3, 224, 224)),
    "mobilenet": (MobileNet, (1, 3, 32, 32)),
}


def export(name: str, directory: Path, seed: int = 0) -> tuple[Path, np.ndarray]:
    """Build model ``name``, export it to ``directory/name.onnx``; return (path, input array)."""
    cls, shape = BUILDERS[name]
    torch.manual_seed(seed)
    model = cls()
    _randomize_bn(model)
    model.eval()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed + 1))
    path = Path(directory) / f"{name}.onnx"
    torch.onnx.export(
        model,
        (x,),
        str(path),
        dynamo=False,
        opset_version=13,
        input_names=["x"],
        output_names=["y"],
        training=torch.onnx.TrainingMode.PRESERVE,
        do_constant_folding=False,
    )
    return path, x.numpy()
