"""TFLite's 16x8 kernels (int16 activations, int8 weights) that differ from their int8 forms.

The converter's ``EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8`` mode gives every
activation an int16 tensor with zero point 0. CONV_2D, DEPTHWISE_CONV_2D, FULLY_CONNECTED, ADD,
SUB, MEAN, AVERAGE_POOL_2D, MAX_POOL_2D and CONCATENATION are the scheme's int8 realizations with
their 16x8 parameters (int64 accumulation and bias, the 15-bit ADD headroom); the kernels here
are TFLite's own int16 algorithms, each realization beside its numpy recompute.
"""

from __future__ import annotations

from typing import Callable

#: the float Relax op between dequantize and quantize -> its int16 realization
SPANS: dict[str, Callable] = {}

#: TFLite ops the scheme realizes on int16 activations (for the error that names the others)
SUPPORTED = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "ADD", "SUB", "MEAN", "AVERAGE_POOL_2D",
             "MAX_POOL_2D", "CONCATENATION", "QUANTIZE", "DEQUANTIZE")

#: quant kind -> numpy recompute (registered by the scheme)
RECOMPUTE: dict[str, Callable] = {}
