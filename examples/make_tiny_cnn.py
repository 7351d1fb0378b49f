"""Make ``examples/tiny_cnn.onnx``: a small float CNN (conv+bn+relu, pools, concat, dense).

    python examples/make_tiny_cnn.py [OUT.onnx]

Needs torch and onnx; the committed ``tiny_cnn.onnx`` is what this writes
(random weights, seed 0, opset 13, input ``x`` 1x3x32x32).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch import nn


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.left = nn.Conv2d(8, 8, 3, padding=1)
        self.right = nn.Conv2d(8, 8, 1)
        self.conv3 = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = torch.cat([torch.relu(self.left(x)), self.right(x)], dim=1)
        x = torch.relu(self.conv3(x) + 0.5)
        return self.fc(torch.flatten(self.avg(x), 1))


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("tiny_cnn.onnx")
    torch.manual_seed(0)
    net = TinyCNN().eval()
    with torch.no_grad():
        net.bn1.running_mean.uniform_(-0.1, 0.1)
        net.bn1.running_var.uniform_(0.5, 1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(net, (torch.rand(1, 3, 32, 32),), str(out), input_names=["x"],
                          output_names=["logits"], opset_version=13, dynamo=False)
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
