"""irgen's generic backend: the layer fusion of a typical NPU, any layout, ``.npy`` files.

A layer is a compute op (convolution or dense) with its bias add and
activation, an element-wise op with its activation, or any other op alone.
"""

from __future__ import annotations

from irgen.plugin import Backend, FusionRule, hookimpl

__version__ = "0.1.0"

ACTIVATIONS = frozenset({"relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh"})
BIAS = frozenset({"relax.add"})
ELEMENTWISE = frozenset({"relax.add", "relax.subtract", "relax.multiply"})

RULES = [
    FusionRule(
        "conv_bias_act",
        frozenset({"relax.nn.conv2d", "relax.nn.conv1d", "relax.nn.conv2d_transpose", "relax.nn.conv3d",
                   "relax.nn.conv3d_transpose", "relax.matmul"}),
        (BIAS, ACTIVATIONS),
    ),
    FusionRule("eltwise_act", ELEMENTWISE, (ACTIVATIONS,)),
    FusionRule("pool", frozenset({"relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.max_pool3d",
                                  "relax.nn.avg_pool3d"}), ()),
]


@hookimpl
def irgen_register_backends(register):
    register(
        Backend(
            name="generic",
            fusion_rules=RULES,
            supported_ops=None,
            layout=None,
            description="conv/dense + bias + activation per layer; the model's own layout; .npy files",
        )
    )
