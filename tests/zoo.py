"""The model zoo: public architectures, random seeded weights, small inputs, built by code.

Nothing is downloaded: every model is built from its library's own class
(torchvision, transformers, keras.applications) with seeded random weights, and
quantized the ways users quantize:

* torch models: exported to ONNX (``onnx``), to ``.pt2`` (``pt2``), and (the
  models of ``QUANTIZED_TORCH_MODELS``) ONNX quantized by onnxruntime's ``quantize_static`` with default options
  (``qdq``), with ``per_channel=True`` (``qdq-pc``), after
  ``quant_pre_process`` (``qdq-pre``), at the MatMuls only (``qdq-mm``), with
  16-bit activations (``qdq-a16``), and with 4-bit weights per channel (``qdq-w4``); the models of
  ``LOWBIT_MODELS`` also with onnxruntime's ``MatMulNBitsQuantizer`` (``nbits``: 4-bit weights in blocks of
  32 with zero points, float32 compute) and with ``quantize_static``'s float8 (``qdq-fp8``: E4M3FN
  activations and weights, Distribution calibration); the models of ``TORCH_PTQ_MODELS`` also
  quantized by torch's own FX post-training quantization with its default
  mapping, exported as ``.pt2`` (``ptq``); the models of ``TORCH_PT2E_MODELS`` by
  torchao's PT2E flow with the x86 quantizer (``pt2e``) and the Arm one (``pt2e-arm``);
* Keras models: ``.keras`` (``keras``) and the TFLite converter's ``.tflite``
  (``tflite``), float; the ``.keras`` file with irgen's
  ``--calibration`` (``keras-int8``), and the TFLite converter's full-int8
  ``.tflite`` with a representative dataset, int8 input and output
  (``tflite-int8``) or the converter's default float input and output
  (``tflite-int8-fio``: a QUANTIZE first, a DEQUANTIZE last); the converter's 16x8 mode
  (``tflite-16x8``: int16 activations, int8 weights, int64 biases, float interface); and its
  dynamic-range quantization (``tflite-dr``: int8 weights, float activations,
  TFLite's hybrid kernels).

``python tests/zoo.py --table [CASE ...]`` runs every case (or the given ones)
through ``irgen run`` + ``irgen verify`` and prints the table of what works;
``--update`` merges those rows into the committed results, ``docs/models.json``
(one row per case and opt level), and writes the table of ``docs/models.md``
from it. ``--render`` writes that table from ``docs/models.json`` alone, running
nothing; ``tests/test_docs.py`` checks that the committed page is what it writes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

QUANTIZED_FORMATS = ("qdq", "qdq-pc", "qdq-pre", "qdq-mm", "qdq-a16", "qdq-w4", "nbits", "qdq-fp8", "ptq", "pt2e",
                     "pt2e-arm", "tflite-int8",
                     "tflite-int8-fio",
                     "tflite-16x8", "keras-int8")
TORCH_FORMATS = ("onnx", "pt2", "qdq", "qdq-pc", "qdq-pre", "qdq-mm", "qdq-a16", "qdq-w4", "nbits", "qdq-fp8", "ptq",
                 "pt2e", "pt2e-arm", "fp16", "bf16", "dyn")
#: ``dyn``: onnxruntime's ``quantize_dynamic`` of a recurrent model's LSTMs
#: (``op_types_to_quantize=["LSTM"]``: ``DynamicQuantizeLSTM``, int8 weights, its input quantized
#: as it runs; float layers with int8 weights, so not in QUANTIZED_FORMATS); a GRU it leaves float
#: the reduced-precision float formats: fp16, the float ONNX model through onnxruntime's
#: ``convert_float_to_float16`` (float32 inputs and outputs); bf16, the torch model in bfloat16
#: exported to .pt2 (bfloat16 inputs); built for these models
REDUCED_FORMATS = ("fp16", "bf16")
REDUCED_MODELS = ("resnet18", "mobilenet_v2", "vit", "bert")
#: the low-bit formats (4-bit blocks, float8), built for these transformer models only
LOWBIT_FORMATS = ("nbits", "qdq-fp8")
LOWBIT_MODELS = ("bert", "vit", "hf_llama")
#: torchao's PT2E quantizers (``prepare_pt2e``/``convert_pt2e``; torch 2.13 has no PT2E of its own):
#: pt2e, X86InductorQuantizer (uint8 activations, per-channel int8 weights); pt2e-arm,
#: ArmInductorQuantizer (int8 activations, per-tensor symmetric int8 weights)
PT2E_QUANTIZERS = {
    "pt2e": ("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer", "X86InductorQuantizer",
             "get_default_x86_inductor_quantization_config"),
    "pt2e-arm": ("torchao.quantization.pt2e.quantizer.arm_inductor_quantizer", "ArmInductorQuantizer",
                 "get_default_arm_inductor_quantization_config"),
}
#: quantize_static's options for each ORT QDQ format (qdq-pre: after quant_pre_process)
QDQ_OPTIONS = {
    "qdq-pc": {"per_channel": True},
    "qdq-mm": {"op_types_to_quantize": ["MatMul"]},  # a transformer recipe: the rest stays float
    "qdq-a16": {"activation_type": "QInt16"},  # 16-bit activations, int8 weights: ORT runs them in float
    "qdq-w4": {"weight_type": "QInt4", "per_channel": True},  # 4-bit weights: ORT runs their ops in float
    # float8 activations and weights (quantize_static takes only its Distribution calibration for them)
    # (its MatMuls: with every op quantized the Distribution calibrator fails on these models,
    # "Attributes 'avg' and/or 'std' missing")
    "qdq-fp8": {"activation_type": "QFLOAT8E4M3FN", "weight_type": "QFLOAT8E4M3FN", "calibrate_method": "Distribution",
                "op_types_to_quantize": ["MatMul"]},
}
KERAS_FORMATS = ("keras", "tflite", "keras-int8", "tflite-int8", "tflite-int8-fio", "tflite-16x8", "tflite-dr")
CALIBRATION_SAMPLES = 8


def import_torchvision():
    """``import torchvision`` with the package index's wheel: it links CUDA libraries and
    registers its C++ ops only there, so its Python side fails ("operator torchvision::nms
    does not exist") unless the two schemas are declared first. No zoo model uses nms."""
    import torch

    try:
        import torchvision  # noqa: F401
    except RuntimeError as err:
        if "torchvision::nms" not in str(err):
            raise
        for mod in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[mod]
        global _TV_LIB
        _TV_LIB = torch.library.Library("torchvision", "DEF")
        _TV_LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _TV_LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import torchvision  # noqa: F401
    import torchvision

    return torchvision


_TV_LIB = None


# ------------------------------------------------------------------ torch models


def _randomize_bn(model) -> None:
    import torch
    from torch import nn

    for m in model.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.BatchNorm1d)):
            with torch.no_grad():
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)


def _tv(name: str, size: int = 64, **kwargs) -> Callable:
    def build():
        tv = import_torchvision()
        model = getattr(tv.models, name)(weights=None, num_classes=10, **kwargs)
        _randomize_bn(model)
        return model, {"x": (1, 3, size, size)}

    return build


def _vit():
    """timm's VisionTransformer, 2 blocks (its attention is explicit matmul/softmax or
    ``scaled_dot_product_attention``; torchvision's ``nn.MultiheadAttention`` fast path
    exports as ``_native_multi_head_attention``, which the ONNX exporter refuses)."""
    import_torchvision()  # timm imports it
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0,
                              num_classes=10)
    return model, {"x": (1, 3, 32, 32)}


def _timm(name: str, size: int = 64) -> Callable:
    """A timm model (``timm.create_model``, random weights, batch norms randomized)."""
    def build():
        import_torchvision()  # timm imports it
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=10)
        _randomize_bn(model)
        return model, {"x": (1, 3, size, size)}

    return build


def _tv_vit_b_16():
    """torchvision's ViT-B/16 (86 M parameters) on a 32x32 image (2x2 patches)."""
    tv = import_torchvision()
    return tv.models.vit_b_16(weights=None, image_size=32, num_classes=10), {"x": (1, 3, 32, 32)}


def _gpt2():
    """A 2-layer GPT-2 (transformers ``GPT2Model``) over token ids; returns the last hidden state."""
    import torch

    import_torchvision()  # transformers imports it
    import transformers

    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    gpt2 = transformers.GPT2Model(cfg).eval()

    class GPT2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, input_ids):
            return self.gpt2(input_ids=input_ids, use_cache=False).last_hidden_state

    return GPT2(), {"input_ids": (1, 16)}


class _BertEncoder:
    """A 2-layer BERT (transformers ``BertModel``) over token ids; returns the last hidden state."""

    @staticmethod
    def build():
        import torch

        import_torchvision()  # transformers imports it
        import transformers

        cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=32, type_vocab_size=2)
        bert = transformers.BertModel(cfg, add_pooling_layer=False).eval()

        class Bert(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.bert = bert

            def forward(self, input_ids):
                return self.bert(input_ids=input_ids).last_hidden_state

        return Bert(), {"input_ids": (1, 16)}


def _hf(cls_name: str, cfg_name: str, inputs: dict[str, tuple[int, ...]], **cfg) -> Callable:
    """A transformers model (2 layers, width 32, random weights) returning its last hidden
    state: token ids (``input_ids``) or pixels/samples (``x``, the model's first argument)."""
    def build():
        import torch

        import_torchvision()  # transformers imports it
        import transformers

        # token models with eager attention: the TorchScript ONNX exporter refuses grouped-query SDPA
        config = getattr(transformers, cfg_name)(**cfg, **({"attn_implementation": "eager"} if "input_ids" in inputs
                                                           else {}))
        model = getattr(transformers, cls_name)(config).eval()
        _randomize_bn(model)

        class Text(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, input_ids):
                return self.m(input_ids=input_ids)[0]

        class Signal(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, x):
                return self.m(x)[0]

        return (Text() if "input_ids" in inputs else Signal()), inputs

    return build


def _tv_video(name: str, frames: int = 4, size: int = 32) -> Callable:
    """A torchvision video classifier (``torchvision.models.video``: 3-D convolutions, 3-D
    pooling; random weights) over a clip of ``frames`` RGB frames."""
    def build():
        tv = import_torchvision()
        model = getattr(tv.models.video, name)(weights=None, num_classes=10)
        _randomize_bn(model)
        return model, {"x": (1, 3, frames, size, size)}

    return build


def _word_lm():
    """PyTorch's word-language-model example (``examples/word_language_model``'s ``RNNModel``,
    LSTM): token embedding, a 2-layer LSTM, a decoder to the vocabulary; its logits."""
    import torch
    from torch import nn

    class RNNModel(nn.Module):
        def __init__(self, ntoken: int = 128, ninp: int = 32, nhid: int = 32, nlayers: int = 2):
            super().__init__()
            self.encoder = nn.Embedding(ntoken, ninp)
            self.rnn = nn.LSTM(ninp, nhid, nlayers)
            self.decoder = nn.Linear(nhid, ntoken)

        def forward(self, input_ids):
            emb = self.encoder(input_ids.transpose(0, 1))  # (sequence, batch, features), as the example
            return self.decoder(self.rnn(emb)[0])

    torch.manual_seed(0)
    return RNNModel(), {"input_ids": (1, 16)}


def _gru_kws():
    """A keyword spotter as the KWS literature builds them (a CRNN): a 1-D convolution over
    40 log-mel features, a 2-layer bidirectional GRU (batch first), the last step classified."""
    import torch
    from torch import nn

    class CRNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Sequential(nn.Conv1d(40, 32, 3, padding=1), nn.BatchNorm1d(32), nn.ReLU())
            self.gru = nn.GRU(32, 24, num_layers=2, batch_first=True, bidirectional=True)
            self.fc = nn.Linear(48, 12)

        def forward(self, x):  # x: (batch, time, 40)
            h = self.conv(x.transpose(1, 2)).transpose(1, 2)
            return self.fc(self.gru(h)[0][:, -1])

    torch.manual_seed(0)
    model = CRNN()
    _randomize_bn(model)
    return model, {"x": (1, 20, 40)}


_TEXT = {"input_ids": (1, 16)}
_HF_TEXT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=40)
_HF_VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=8)


TORCH_MODELS: dict[str, Callable] = {
    "resnet18": _tv("resnet18"),
    "mobilenet_v2": _tv("mobilenet_v2"),
    "mobilenet_v3_small": _tv("mobilenet_v3_small"),
    "efficientnet_b0": _tv("efficientnet_b0"),
    "squeezenet1_1": _tv("squeezenet1_1"),
    "shufflenet_v2_x0_5": _tv("shufflenet_v2_x0_5"),
    "googlenet": _tv("googlenet", aux_logits=False, init_weights=True),
    "densenet121": _tv("densenet121"),
    "convnext_tiny": _tv("convnext_tiny"),
    "vit": _vit,
    "bert": _BertEncoder.build,
    "vit_b_16": _tv_vit_b_16,
    "swin_t": _tv("swin_t"),
    # continuous position bias: an MLP over a quantized constant table (a MatMul of two constants)
    "swin_v2_t": _tv("swin_v2_t"),
    "gpt2": _gpt2,
    "resnet50d": _timm("resnet50d"),  # ResNet-D shortcut: AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
    "poolformer_s12": _timm("poolformer_s12"),  # GroupNorm(1) as InstanceNormalization, pool token mixer
    "mobilevit_xxs": _timm("mobilevit_xxs"),  # attention over one patch per position (softmax over 1)
    # TF "same" padding computed in the graph (quantized by quantize_static), requantizing slices, 0/0 before
    # a quantize, torch.autocast(enabled=False) in the .pt2
    "efficientvit_b0": _timm("efficientvit_b0"),
    # transformers: position ids computed from the token ids (gathers after index arithmetic)
    "hf_roberta": _hf("RobertaModel", "RobertaConfig", _TEXT, **_HF_TEXT),
    # layers sharing one set of weights (the exporter's Identity, quantized again by quantize_static)
    "hf_albert": _hf("AlbertModel", "AlbertConfig", _TEXT, embedding_size=16, **_HF_TEXT),
    # a decoder: RMSNorm, rotary positions, grouped-query attention, its key/value cache's empty cat (.pt2)
    "hf_llama": _hf("LlamaModel", "LlamaConfig", _TEXT, num_key_value_heads=1, **_HF_TEXT),
    # relative position bias from a table gathered by an index built with ScatterND
    "hf_beit": _hf("BeitModel", "BeitConfig", {"x": (1, 3, 32, 32)}, use_relative_position_bias=True, **_HF_VISION),
    # the pixels cast to the weights' type before the first QuantizeLinear
    "hf_dinov2": _hf("Dinov2Model", "Dinov2Config", {"x": (1, 3, 32, 32)}, **_HF_VISION),
    # audio: strided 1-D convolutions over the waveform's Unsqueeze, a weight-normed positional conv
    "hf_wav2vec2": _hf("Wav2Vec2Model", "Wav2Vec2Config", {"x": (1, 1600)}, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                       conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2),
    # video: 3-D convolutions and pooling (R3D), mixed 3-D/2-D (MC3), (2+1)-D factorized (R(2+1)D)
    "r3d_18": _tv_video("r3d_18"),
    "mc3_18": _tv_video("mc3_18"),
    "r2plus1d_18": _tv_video("r2plus1d_18"),
    # recurrent: an LSTM language model (each time step a layer), a bidirectional GRU keyword spotter
    "word_lm": _word_lm,
    "gru_kws": _gru_kws,
}
#: the models with an LSTM (their ``dyn`` format: ORT's quantize_dynamic of the LSTMs alone)
LSTM_MODELS = ("word_lm",)
#: the torch models also quantized by torch itself (``ptq``: FX post-training quantization with
#: torch's default mapping, ``get_default_qconfig_mapping()``: x86, per-channel int8 weights,
#: reduce_range uint8 activations; ``_convert_to_reference_decomposed_fx``, then a ``.pt2``)
TORCH_PTQ_MODELS = ("resnet18", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "squeezenet1_1",
                    "shufflenet_v2_x0_5", "googlenet", "densenet121", "convnext_tiny", "swin_t", "swin_v2_t",
                    "resnet50d")
#: the torch models also quantized by torchao's PT2E (``pt2e``, ``pt2e-arm``): the FX ones, and the
#: transformers that torch.export takes and FX cannot trace (torchao's quantizers stop on RoBERTa:
#: "list index out of range" in their linear annotation)
TORCH_PT2E_MODELS = (*TORCH_PTQ_MODELS, "vit", "bert", "hf_llama", "hf_wav2vec2", "mobilevit_xxs", "efficientvit_b0",
                     "poolformer_s12")
#: the TFLite converter crashes (a segmentation fault in its calibration) on every recurrent loop
_LOOP_CALIBRATION = "the TFLite converter: a segmentation fault calibrating a WHILE loop (TF 2.21)"
#: cases the tools before irgen cannot build (not irgen's failures), left out of the zoo
NOT_BUILT = {
    "hf_beit-qdq-pre": "onnxruntime's quant_pre_process: 'Incomplete symbolic shape inference'",
    "swin_v2_t-qdq-pre": "onnxruntime's quant_pre_process: 'Incomplete symbolic shape inference'",
    "resnet18-pt2e": "torchao's X86InductorQuantizer: 'Input partition has more than one output node'",
    "MobileNetV3Small-tflite-16x8": "the TFLite converter: 'Quantization to 16x8-bit not yet supported for op: HARD_SWISH'",
    "ConvNeXtTiny-tflite-16x8": "the TFLite converter: 'Quantization to 16x8-bit not yet supported for op: NEG'",
    # the random-weight model's activations vanish in block 4 (calibrated scale 8e-10), so RELU6's bound
    # overflows int32: the interpreter fails to prepare it (irgen refuses it too, with the same reason)
    "MobileNetV2-tflite-16x8": "the TFLite interpreter: 'no_integer_overflow_from_quantization was not true' (DEPTHWISE_CONV_2D)",
    **{f"{m}-{f}": _LOOP_CALIBRATION for m in ("KerasLSTM", "KerasGRU")
       for f in ("keras-int8", "tflite-int8", "tflite-int8-fio", "tflite-16x8")},
}
#: quantized models without a MatMul: qdq-mm would leave them float (nothing to check as quantized)
NO_MATMUL = ("resnet18", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "squeezenet1_1",
             "shufflenet_v2_x0_5", "googlenet", "densenet121", "poolformer_s12", "resnet50d", "r3d_18", "mc3_18",
             "r2plus1d_18")
#: the torch models that are also quantized (the others are float only)
QUANTIZED_TORCH_MODELS = ("resnet18", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "squeezenet1_1",
                          "shufflenet_v2_x0_5", "googlenet", "densenet121", "convnext_tiny", "vit", "bert", "swin_v2_t",
                          "resnet50d",
                          "poolformer_s12", "mobilevit_xxs", "efficientvit_b0", "hf_roberta", "hf_albert", "hf_llama",
                          "hf_beit", "hf_dinov2", "hf_wav2vec2", "r3d_18", "mc3_18", "r2plus1d_18", "word_lm",
                          "gru_kws")

# ------------------------------------------------------------------ keras models

KERAS_MODELS: dict[str, tuple[str, int]] = {
    "MobileNetV2": ("MobileNetV2", 64),
    "MobileNetV3Small": ("MobileNetV3Small", 64),
    "EfficientNetB0": ("EfficientNetB0", 64),
    "ResNet50": ("ResNet50", 64),
    "DenseNet121": ("DenseNet121", 64),
    "EfficientNetV2B0": ("EfficientNetV2B0", 64),  # Normalization (int8 SUB)
    "ConvNeXtTiny": ("ConvNeXtTiny", 64),  # LayerNormalization, GELU (int8: tables, SQUARED_DIFFERENCE, RSQRT)
    # recurrent (Keras layers, not applications): the TFLite converter writes each as a WHILE loop
    "KerasLSTM": ("recurrent:LSTM", 12),
    "KerasGRU": ("recurrent:GRU", 12),
}


def _keras_recurrent(layer: str, features: int):
    """A sequence classifier as Keras' examples build them: two stacked ``layer`` (``LSTM`` or
    ``GRU``) layers of 16 units over 8 steps of ``features`` features, a Dense head."""
    import tensorflow as tf

    rnn = getattr(tf.keras.layers, layer)
    return tf.keras.Sequential([tf.keras.Input((8, features)), rnn(16, return_sequences=True), rnn(16),
                                tf.keras.layers.Dense(10)]), (1, 8, features)


@dataclass
class Case:
    model: str
    fmt: str

    @property
    def id(self) -> str:
        return f"{self.model}-{self.fmt}"

    @property
    def quantized(self) -> bool:
        return self.fmt in QUANTIZED_FORMATS


def cases(formats=None) -> list[Case]:
    out = [Case(m, f) for m in TORCH_MODELS for f in TORCH_FORMATS
           if (f in ("onnx", "pt2") or (m in TORCH_PTQ_MODELS if f == "ptq" else m in TORCH_PT2E_MODELS
                                        if f in PT2E_QUANTIZERS else m in QUANTIZED_TORCH_MODELS))
           and f"{m}-{f}" not in NOT_BUILT and not (f == "qdq-mm" and m in NO_MATMUL)
           and (f not in LOWBIT_FORMATS or m in LOWBIT_MODELS) and (f not in REDUCED_FORMATS or m in REDUCED_MODELS)
           and (f != "dyn" or m in LSTM_MODELS)]
    out += [Case(m, f) for m in KERAS_MODELS for f in KERAS_FORMATS if f"{m}-{f}" not in NOT_BUILT]
    return [c for c in out if formats is None or c.fmt in formats]


def _sample(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "i":
        return rng.integers(0, 128, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


#: models whose ONNX export needs the dynamo exporter (``torch.onnx.export(dynamo=True)``, with
#: onnxscript): the TorchScript exporter has no symbolic for an op they use (GPT-2's ``aten::diff``)
DYNAMO_ONNX = ("gpt2",)


def _torch_base(model_name: str, folder: Path):
    """(float ONNX path, .pt2 path, {input: array}); built once per folder. Each format is
    exported on its own: a failing exporter is that format's error (raised when it is asked for)."""
    import torch

    onnx_path, pt2_path = folder / f"{model_name}.onnx", folder / f"{model_name}.pt2"
    inputs_path = folder / f"{model_name}.inputs.npz"
    if onnx_path.exists() and pt2_path.exists() and inputs_path.exists():
        return onnx_path, pt2_path, dict(np.load(inputs_path))
    torch.manual_seed(0)
    model, shapes = TORCH_MODELS[model_name]()
    model.eval()
    dtypes = {name: (np.int64 if name == "input_ids" else np.float32) for name in shapes}
    feeds = {name: _sample(shape, dtypes[name], 1) for name, shape in shapes.items()}
    args = tuple(torch.from_numpy(feeds[n]) for n in shapes)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # nn.MultiheadAttention as matmul/softmax, exportable
    errors = {}
    try:
        with torch.no_grad():
            if not pt2_path.exists():
                try:
                    torch.export.save(torch.export.export(model, args), str(pt2_path))
                except Exception as err:  # noqa: BLE001
                    errors["pt2"] = err
            if not onnx_path.exists():
                try:
                    if model_name in DYNAMO_ONNX:
                        with contextlib.redirect_stdout(io.StringIO()):
                            torch.onnx.export(model, args, str(onnx_path), input_names=list(shapes),
                                              output_names=["y"], dynamo=True, opset_version=18,
                                              external_data=False)
                    else:
                        torch.onnx.export(model, args, str(onnx_path), input_names=list(shapes),
                                          output_names=["y"], dynamo=False, opset_version=17)
                except Exception as err:  # noqa: BLE001
                    errors["onnx"] = err
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    np.savez(inputs_path, **feeds)
    for fmt, err in errors.items():
        (folder / f"{model_name}.{fmt}.error").write_text(f"{type(err).__name__}: {err}")
    return onnx_path, pt2_path, feeds


def _calibration_reader(feeds: dict[str, np.ndarray]):
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter([{n: _sample(a.shape, a.dtype, 100 + k) for n, a in feeds.items()}
                            for k in range(CALIBRATION_SAMPLES)])

        def get_next(self):
            return next(self.it, None)

    return Reader()


def _quantize_onnx(model_name: str, fmt: str, folder: Path, onnx_path: Path, feeds) -> Path:
    from onnxruntime.quantization import quantize_static

    out = folder / f"{model_name}.{fmt}.onnx"
    if out.exists():
        return out
    src = onnx_path
    if fmt == "qdq-pre":
        from onnxruntime.quantization.shape_inference import quant_pre_process

        src = (folder / f"{model_name}.pre.onnx").resolve()
        # in the model's folder: ORT's symbolic shape inference leaves its temporary files in the current one
        with contextlib.redirect_stdout(io.StringIO()), contextlib.chdir(folder):
            quant_pre_process(str(Path(onnx_path).resolve()), str(src))
    from onnxruntime.quantization import CalibrationMethod, QuantType

    if fmt == "nbits":
        return _matmul_nbits(src, out)
    if fmt == "dyn":
        from onnxruntime.quantization import quantize_dynamic

        quantize_dynamic(str(src), str(out), op_types_to_quantize=["LSTM"], per_channel=True)
        return out
    options = dict(QDQ_OPTIONS.get(fmt, {}))
    for key in ("activation_type", "weight_type"):
        if key in options:
            options[key] = getattr(QuantType, options[key])
    if "calibrate_method" in options:
        options["calibrate_method"] = getattr(CalibrationMethod, options["calibrate_method"])
    with contextlib.redirect_stdout(io.StringIO()):
        quantize_static(str(src), str(out), _calibration_reader(feeds), **options)
    return out


def _float16_onnx(model_name: str, folder: Path, onnx_path: Path) -> Path:
    """The float ONNX model in float16 as onnxruntime's ``convert_float_to_float16`` writes it
    (weights and every op float16; the model's inputs and outputs float32)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    out = folder / f"{model_name}.fp16.onnx"
    if not out.exists():
        onnx.save(convert_float_to_float16(onnx.load(str(onnx_path)), keep_io_types=True), str(out))
    return out


def _bfloat16_pt2(model_name: str, folder: Path, feeds: dict[str, np.ndarray]) -> tuple[Path, list[str]]:
    """The torch model in bfloat16 (``model.to(torch.bfloat16)``) exported to .pt2, and its
    ``--input`` arguments (the float inputs in bfloat16, as ml_dtypes writes them)."""
    import ml_dtypes
    import torch

    out = folder / f"{model_name}.bf16.pt2"
    cast = {n: a.astype(ml_dtypes.bfloat16) if a.dtype == np.float32 else a for n, a in feeds.items()}
    if not out.exists():
        torch.manual_seed(0)
        model, shapes = TORCH_MODELS[model_name]()
        model = model.eval().to(torch.bfloat16)
        args = tuple(torch.from_numpy(cast[n].view(np.int16)).view(torch.bfloat16) if cast[n].dtype != feeds[n].dtype
                     else torch.from_numpy(cast[n]) for n in shapes)
        with torch.no_grad():
            torch.export.save(torch.export.export(model, args), str(out))
    args = []
    for name, a in cast.items():
        f = folder / f"{model_name}.{name}.bf16.npy"
        np.save(f, a)
        args += ["--input", f"{name}={f}"]
    return out, args


def _matmul_nbits(src: Path, out: Path) -> Path:
    """onnxruntime's ``MatMulNBitsQuantizer``: every MatMul's weight 4-bit, blocks of 32, zero
    points, accuracy level 0 (float32 compute)."""
    import logging

    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    q = MatMulNBitsQuantizer(onnx.load(str(src)), block_size=32, is_symmetric=False, accuracy_level=0)
    q.process()
    q.model.save_model_to_file(str(out))
    return out


def _quantize_torch(model_name: str, fmt: str, folder: Path, feeds) -> Path:
    """The model quantized by torch itself, calibrated on the samples ORT's calibration reads, as a
    ``.pt2``: ``ptq``, FX post-training quantization (``TORCH_PTQ_MODELS``) with torch's default
    mapping; ``pt2e``/``pt2e-arm``, torchao's PT2E flow (``torch.export``, ``prepare_pt2e``,
    ``convert_pt2e``) with the quantizer of ``PT2E_QUANTIZERS``."""
    import importlib
    import warnings

    import torch

    out = folder / f"{model_name}.{fmt}.pt2"
    if out.exists():
        return out
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")  # torchao: "Failed to load ... _C_cutlass_90a" (CUDA kernels), Enum notes
        torch.manual_seed(0)
        model, shapes = TORCH_MODELS[model_name]()  # the weights _torch_base exported (the same seed)
        args = tuple(torch.from_numpy(feeds[n]) for n in shapes)
        if fmt == "ptq":
            from torch.ao.quantization import get_default_qconfig_mapping
            from torch.ao.quantization.quantize_fx import _convert_to_reference_decomposed_fx, prepare_fx

            prepared = prepare_fx(model.eval(), get_default_qconfig_mapping(), args)
            convert = _convert_to_reference_decomposed_fx
        else:
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

            where, cls, config = PT2E_QUANTIZERS[fmt]
            mod = importlib.import_module(where)
            quantizer = getattr(mod, cls)().set_global(getattr(mod, config)())
            prepared = prepare_pt2e(torch.export.export(model.eval(), args).module(), quantizer)
            convert = convert_pt2e
        with torch.no_grad():
            for k in range(CALIBRATION_SAMPLES):
                prepared(*(torch.from_numpy(_sample(feeds[n].shape, feeds[n].dtype, 100 + k)) for n in shapes))
            program = torch.export.export(convert(prepared), args)
    torch.export.save(program, str(out))
    return out


def _tflite_converter(tf, model):
    """The TFLite converter of a Keras model, as its TFLite guide has users convert one with a
    recurrent layer: at batch 1 (the converter lowers the layer's loop only with a static
    element shape; an open batch fails with "TensorListReserve ... element_shape to be static")."""
    if model.inputs[0].shape[0] is None and any(type(l).__name__ in ("LSTM", "GRU", "SimpleRNN", "Bidirectional")
                                                for l in model.layers):
        inputs = tf.keras.Input(batch_shape=(1, *model.inputs[0].shape[1:]))
        model = tf.keras.Model(inputs, model(inputs))
    return tf.lite.TFLiteConverter.from_keras_model(model)


def _keras(model_name: str, fmt: str, folder: Path):
    import tensorflow as tf

    app, size = KERAS_MODELS[model_name]
    keras_path = folder / f"{model_name}.keras"
    recurrent = app.startswith("recurrent:")
    shape = (1, 8, size) if recurrent else (1, size, size, 3)
    x = _sample(shape, np.float32, 1)
    calib = folder / f"{model_name}.calibration"
    if not keras_path.exists():
        tf.keras.utils.set_random_seed(0)
        model = (_keras_recurrent(app.removeprefix("recurrent:"), size)[0] if recurrent
                 else getattr(tf.keras.applications, app)(weights=None, input_shape=(size, size, 3), classes=10))
        model.save(keras_path)
    if not calib.exists():
        calib.mkdir()
        for k in range(CALIBRATION_SAMPLES):
            np.save(calib / f"{k:02d}.npy", _sample(shape, np.float32, 100 + k))
    if fmt == "tflite":
        path = folder / f"{model_name}.float.tflite"
        if not path.exists():
            model = tf.keras.models.load_model(keras_path)
            path.write_bytes(_tflite_converter(tf, model).convert())
        return path, x, []
    if fmt == "tflite-dr":
        path = folder / f"{model_name}.dr.tflite"
        if not path.exists():
            model = tf.keras.models.load_model(keras_path)
            conv = _tflite_converter(tf, model)
            conv.optimizations = [tf.lite.Optimize.DEFAULT]  # no representative dataset: dynamic range
            path.write_bytes(conv.convert())
        return path, x, []
    if fmt in ("tflite-int8", "tflite-int8-fio", "tflite-16x8"):
        path = folder / f"{model_name}.{fmt.removeprefix('tflite-')}.tflite"
        if not path.exists():
            model = tf.keras.models.load_model(keras_path)
            conv = _tflite_converter(tf, model)
            conv.optimizations = [tf.lite.Optimize.DEFAULT]
            samples = [np.load(f) for f in sorted(calib.glob("*.npy"))]
            conv.representative_dataset = lambda: ([s] for s in samples)
            conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
            if fmt == "tflite-16x8":
                conv.target_spec.supported_ops = [
                    tf.lite.OpsSet.EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8]
            if fmt == "tflite-int8":
                conv.inference_input_type = tf.int8
                conv.inference_output_type = tf.int8
            path.write_bytes(conv.convert())
        if fmt != "tflite-int8":  # a float interface
            return path, x, []
        detail = tf.lite.Interpreter(model_path=str(path)).get_input_details()[0]
        scale, zp = detail["quantization"]
        x = np.clip(np.round(x / scale) + zp, -128, 127).astype(np.int8)
        return path, x, []
    extra = ["--calibration", str(calib)] if fmt == "keras-int8" else []
    return keras_path, x, extra


def build(case: Case, folder: Path) -> tuple[Path, list[str]]:
    """Build ``case`` under ``folder`` (cached there); return (model path, extra ``irgen run`` args,
    including ``--input`` files)."""
    folder.mkdir(parents=True, exist_ok=True)
    if case.model in TORCH_MODELS:
        onnx_path, pt2_path, feeds = _torch_base(case.model, folder)
        args = []
        for name, a in feeds.items():
            f = folder / f"{case.model}.{name}.npy"
            np.save(f, a)
            args += ["--input", f"{name}={f}"]
        want = pt2_path if case.fmt == "pt2" else onnx_path
        if not want.exists():
            err = folder / f"{case.model}.{'pt2' if case.fmt == 'pt2' else 'onnx'}.error"
            raise RuntimeError(f"export failed: {err.read_text()[:300] if err.exists() else '?'}")
        if case.fmt == "onnx":
            return onnx_path, args
        if case.fmt == "pt2":
            return pt2_path, args
        if case.fmt in ("ptq", *PT2E_QUANTIZERS):
            return _quantize_torch(case.model, case.fmt, folder, feeds), args
        if case.fmt == "fp16":
            return _float16_onnx(case.model, folder, onnx_path), args
        if case.fmt == "bf16":
            return _bfloat16_pt2(case.model, folder, feeds)
        return _quantize_onnx(case.model, case.fmt, folder, onnx_path, feeds), args
    path, x, extra = _keras(case.model, case.fmt, folder)
    f = folder / f"{case.model}.x.npy"
    np.save(f, x)
    return path, [*extra, "--input", str(f)]


# ------------------------------------------------------------------ run + verify, and the table


def run_case(case: Case, folder: Path, runner=None, opt_level: int | None = None) -> dict:
    """``irgen run`` then ``irgen verify --json`` (all modes) on ``case``; returns a summary:
    ``passed``, ``source_ran``, ``layers``, ``exact_share`` (of the layers compared with the source
    runtime, those equal to it), ``worst_local_lsb`` (quantized), ``worst_rel`` (float),
    ``worst_cosine`` (float), ``drift`` (end-to-end, quantized), ``problems``, ``seconds`` (run +
    verify), ``run_seconds`` (``irgen run`` alone), ``source_seconds`` (the source runtime's
    ``load`` and ``run``, as verify measured them), and ``verify`` (the whole JSON).
    ``runner(argv) -> (exit code, stdout, stderr)`` runs the CLI (default: in this process)."""
    runner = runner or _in_process
    model, args = build(case, folder / "models")
    out = folder / "out" / (case.id if opt_level is None else f"{case.id}-O{opt_level}")
    if opt_level is not None:
        args = [*args, "--opt-level", str(opt_level)]
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    code, _, err = runner(["run", str(model), "-o", str(out), "--force", "--no-progress", *args])
    summary = {"case": case.id, "model": case.model, "format": case.fmt, "opt_level": opt_level,
               "run_exit": code, "passed": False, "run_seconds": round(time.perf_counter() - t0, 2),
               "source_ran": False, "seconds": None, "error": err.strip().splitlines()[-1:] if code else []}
    if code != 0:
        return summary
    code, stdout, err = runner(["verify", str(out), "--json", "--no-report", "--no-progress"])
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    try:
        r = json.loads(stdout)
    except json.JSONDecodeError:
        summary["error"] = err.strip().splitlines()[-1:]
        return summary
    src = r.get("source") or {}
    rows = [row for row in r["layers"] if "source" in row["checks"]]
    compared = [row["checks"]["source"] for row in rows if row["checks"]["source"].get("status") in ("pass", "fail")]
    lsbs = [m.get("local", m).get("max_lsb") for m in compared]
    rels = [m.get("max_rel") for m in compared if m.get("max_lsb") is None]
    cosines = [m.get("cosine") for m in compared if m.get("max_lsb") is None and m.get("cosine") is not None]
    drift = src.get("end_to_end") or {}
    summary.update(
        passed=bool(r["passed"]) and code == 0, verify_exit=code, source_ran=bool(src.get("ran")),
        runtime=src.get("runtime"), skipped=src.get("skipped"), layers=len(r["layers"]), compared=len(compared),
        exact_share=(sum(bool(m.get("exact")) for m in compared) / len(compared)) if compared else None,
        worst_local_lsb=max((v for v in lsbs if v is not None), default=None),
        worst_rel=max((v for v in rels if v is not None), default=None),
        worst_cosine=min(cosines, default=None), source_seconds=src.get("seconds"),
        drift_lsb=drift.get("max_lsb"), drift_first=(drift.get("first") or {}).get("layer"),
        problems=[f"{p.get('layer')}: {p.get('check')}: {p.get('message')}" for p in r.get("problems", [])][:5],
        verify=r,
    )
    return summary


def _in_process(argv: list[str]) -> tuple[int, str, str]:
    from irgen.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _subprocess(argv: list[str]) -> tuple[int, str, str]:
    import subprocess

    p = subprocess.run([sys.executable, "-m", "irgen", *argv], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


FORMAT_TITLES = {
    "onnx": "ONNX float", "pt2": "`.pt2` float", "qdq": "ORT QDQ", "qdq-pc": "ORT QDQ per-channel",
    "qdq-pre": "ORT QDQ after `quant_pre_process`", "qdq-mm": "ORT QDQ, MatMuls only",
    "qdq-a16": "ORT QDQ, 16-bit activations", "qdq-w4": "ORT QDQ, 4-bit weights",
    "nbits": "4-bit block (`MatMulNBits`)", "qdq-fp8": "fp8 (ORT QDQ, E4M3FN)", "fp16": "float16 ONNX (ORT `convert_float_to_float16`)", "bf16": "bfloat16 `.pt2`", "ptq": "torch FX PTQ `.pt2`",
    "pt2e": "torchao PT2E, x86 quantizer, `.pt2`", "pt2e-arm": "torchao PT2E, Arm quantizer, `.pt2`", "keras": "`.keras` float",
    "tflite": "TFLite float",
    "keras-int8": "`.keras` + `--calibration`", "tflite-int8": "TFLite full-int8",
    "tflite-int8-fio": "TFLite full-int8, float input/output", "tflite-16x8": "TFLite 16x8 (int16 activations)",
    "tflite-dr": "TFLite dynamic range", "dyn": "ORT `quantize_dynamic` of the LSTMs",
}


def _format_title(s: dict) -> str:
    title = FORMAT_TITLES[s["format"]]
    return title if s.get("opt_level") is None else f"{title}, `--opt-level {s['opt_level']}`"


def _times(row: dict) -> str:
    """``irgen run`` against the source runtime's load + run of every compared tensor."""
    run, src = row.get("run_seconds"), row.get("source_seconds")
    if run is None or src is None:
        return ""
    return f"{run:.1f} s / {src:.1f} s ({run / src:.0f}×)" if src else f"{run:.1f} s / 0 s"


def _round(x: float | None, digits: int) -> float | None:
    """``x`` to ``digits`` significant digits (the results file holds what the table shows, a little more)."""
    return None if x is None else float(f"{x:.{digits}g}")


#: the fields of a row of docs/models.json, in the order they are written
RESULT_FIELDS = ("case", "model", "format", "opt_level", "status", "layers", "compared", "exact_share", "worst_lsb",
                 "worst_rel", "worst_cosine_gap", "drift_lsb", "run_seconds", "source_seconds", "error")


def result_row(s: dict) -> dict:
    """A row of docs/models.json from a :func:`run_case` summary: ``status`` is ``pass`` (verify
    passed with the source check), ``pass-no-source``, ``fail`` (verify failed) or ``error``
    (``irgen run`` failed: ``error`` holds its message); ``exact_share`` of the ``compared`` layers
    equal to the source runtime bit for bit; ``worst_lsb`` (quantized formats: a layer recomputed
    from the runtime's own inputs) or ``worst_rel`` (float); ``worst_cosine_gap``, 1 - the worst
    cosine of a float layer; ``drift_lsb`` (end to end, quantized); ``run_seconds`` (``irgen run``)
    and ``source_seconds`` (the source runtime's load and run, as verify timed it)."""
    row = {"case": s["case"], "model": s["model"], "format": s["format"], "opt_level": s.get("opt_level")}
    if not s.get("layers"):
        return {**row, "status": "error", "error": " ".join(s.get("error") or ["?"])}
    quantized = s["format"] in QUANTIZED_FORMATS
    src = s.get("source_seconds")
    cosine = s.get("worst_cosine")
    gap = None if cosine is None else (0.0 if 1 - cosine < 1e-15 else _round(1 - cosine, 2))
    row.update(
        status=("pass" if s["source_ran"] else "pass-no-source") if s["passed"] else "fail",
        layers=s["layers"], compared=s.get("compared") if s.get("exact_share") is not None else None,
        exact_share=_round(s.get("exact_share"), 4),
        worst_lsb=s.get("worst_local_lsb") if quantized else None,
        worst_rel=None if quantized and s.get("worst_local_lsb") is not None else _round(s.get("worst_rel"), 2),
        worst_cosine_gap=gap, drift_lsb=s.get("drift_lsb") if quantized else None,
        run_seconds=round(s["run_seconds"], 1), source_seconds=round(src["load"] + src["run"], 2) if src else None,
    )
    if not s["passed"]:
        row["error"] = "; ".join(s.get("problems") or s.get("error") or [])
    return row


def table(rows: list[dict]) -> str:
    """Markdown: one row per case (model × format → layers, exact share vs the source runtime,
    worst local LSB or relative error, worst cosine of a float layer, end-to-end drift, the
    time of ``irgen run`` against the source runtime's, verify verdict). ``rows``: rows of
    docs/models.json, or :func:`run_case` summaries."""
    lines = ["| model | format | layers | equal to the source runtime | worst layer | worst cosine | end-to-end drift "
             "| irgen run / source runtime | verify |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in (r if "status" in r else result_row(r) for r in rows):
        if r["status"] == "error":
            why = r.get("error", "?").replace("|", "\\|")
            lines.append(f"| {r['model']} | {_format_title(r)} | | | | | | | fails: {why} |")
            continue
        quantized = r["format"] in QUANTIZED_FORMATS
        share = r.get("exact_share")
        if share is None:
            share_text = ""
        elif quantized or share == 1:
            share_text = f"{share:.0%} of {r['compared']}"
        else:  # float layers: another accumulation order, compared within the float tolerance
            share_text = f"{r['compared']} compared, {share:.0%} bit-equal"
        if r.get("worst_lsb") is not None:
            worst = f"{r['worst_lsb']} LSB"
        elif r.get("worst_rel") is not None:
            worst = f"rel {r['worst_rel']:.1e}" if r["worst_rel"] else "exact"
        else:
            worst = ""
        gap = r.get("worst_cosine_gap")
        cosine = "" if gap is None else "1" if not gap else f"1 - {gap:.1e}"  # 0.99999999 would hide what differs
        drift = "" if r.get("drift_lsb") is None else f"{r['drift_lsb']} LSB" if r["drift_lsb"] else "none"
        verdict = {"pass": "PASS", "pass-no-source": "PASS (no source check)"}.get(r["status"], "FAIL")
        lines.append(f"| {r['model']} | {_format_title(r)} | {r['layers']} | {share_text} | {worst} | {cosine} "
                     f"| {drift} | {_times(r)} | {verdict} |")
    return "\n".join(lines)


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "models.json"
MODELS_PAGE = ROOT / "docs" / "models.md"
TABLE_BEGIN = "<!-- zoo table: generated from docs/models.json by `python tests/zoo.py --render` -->"
TABLE_END = "<!-- end of zoo table -->"


def load_results(path: Path = RESULTS) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))


def dump_results(rows: list[dict]) -> str:
    """docs/models.json's text: one row a line, its fields in :data:`RESULT_FIELDS` order."""
    lines = [json.dumps({k: r[k] for k in RESULT_FIELDS if k in r}, ensure_ascii=False) for r in rows]
    return "[\n" + ",\n".join(lines) + "\n]\n"


def merge_results(rows: list[dict], new: list[dict]) -> list[dict]:
    """``rows`` with each of ``new`` in place of the row of its case and opt level (or added),
    in the zoo's order (a case the zoo no longer has keeps its place at the end)."""
    merged = {(r["case"], r.get("opt_level")): r for r in rows}
    merged.update({(r["case"], r.get("opt_level")): r for r in new})
    order = {c.id: k for k, c in enumerate(cases())}
    return sorted(merged.values(), key=lambda r: (order.get(r["case"], len(order)), r.get("opt_level") is not None,
                                                  r.get("opt_level") or 0))


def render_page(page: str, rows: list[dict]) -> str:
    """``page`` (docs/models.md's text) with the table between its markers made from ``rows``."""
    a, b = page.index(TABLE_BEGIN) + len(TABLE_BEGIN), page.index(TABLE_END)
    return page[:a] + "\n" + table(rows) + "\n" + page[b:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", help="case ids (model-format) or model names; default: all")
    ap.add_argument("--folder", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "irgen-zoo")
    ap.add_argument("--table", action="store_true", help="print the markdown table of the cases run")
    ap.add_argument("--update", action="store_true",
                    help="merge the rows of the cases run into docs/models.json and write docs/models.md's table")
    ap.add_argument("--render", action="store_true",
                    help="write docs/models.md's table from docs/models.json (runs nothing unless cases are given)")
    ap.add_argument("--json", type=Path, default=None, help="write the summaries (without verify JSON) here")
    ap.add_argument("--opt-level", type=int, default=None, help="irgen run --opt-level (default: irgen's)")
    ap.add_argument("--from-json", type=Path, nargs="+", default=None, metavar="FILE",
                    help="take the summaries that --json wrote (the last of a case wins) instead of running")
    args = ap.parse_args(argv)
    todo = [c for c in cases() if not args.cases or c.id in args.cases or c.model in args.cases or c.fmt in args.cases]
    if args.render and not args.cases and not args.update:
        todo = []
    summaries = []
    if args.from_json:
        found = {}
        for f in args.from_json:
            for s in json.loads(f.read_text()):
                found[(s["case"], s.get("opt_level"))] = s
        order = {c.id: k for k, c in enumerate(cases())}
        summaries = sorted((s for s in found.values() if s["case"] in order),
                           key=lambda s: (order[s["case"]], s.get("opt_level") or 0))
        todo = []
    for c in todo:
        t0 = time.perf_counter()
        try:
            s = run_case(c, args.folder, runner=_subprocess, opt_level=args.opt_level)
        except Exception as err:  # a build failure is a row too
            s = {"case": c.id, "model": c.model, "format": c.fmt, "opt_level": args.opt_level, "passed": False,
                 "error": [f"build: {err}"[:200]]}
        s.pop("verify", None)
        summaries.append(s)
        print(f"{c.id}: {'PASS' if s['passed'] else 'FAIL'} ({time.perf_counter() - t0:.0f} s) "
              f"{'' if s['passed'] else (s.get('error') or s.get('problems'))}", file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps(summaries, indent=1))
    if args.table:
        print(table(summaries))
    if args.update or args.render:
        rows = load_results()
        if args.update:
            rows = merge_results(rows, [result_row(s) for s in summaries])
            RESULTS.write_text(dump_results(rows), encoding="utf-8")
        MODELS_PAGE.write_text(render_page(MODELS_PAGE.read_text(encoding="utf-8"), rows), encoding="utf-8")
    return 0 if all(s["passed"] for s in summaries) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
