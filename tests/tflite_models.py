"""Seeded Keras models converted to ``.tflite`` (float and full-integer int8), and a
TFLite-interpreter reference that returns every tensor's value.

TensorFlow is imported lazily: it is needed only to *make* and *check* models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SEED = 0


def _tf():
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    return tf


def small_cnn(tf):
    """conv+relu, depthwise+relu6, residual Add, max pool, avg pool, concatenate, GAP, dense."""
    L = tf.keras.layers
    x = L.Input((16, 16, 3), batch_size=1, name="x")
    c1 = L.Conv2D(8, 3, padding="same", activation="relu", name="conv1")(x)
    d1 = L.DepthwiseConv2D(3, padding="same", name="dw1")(c1)
    d1 = L.ReLU(max_value=6.0, name="relu6")(d1)
    r = L.Add(name="residual")([c1, d1])
    mp = L.MaxPooling2D(2, name="maxpool")(r)
    ap = L.AveragePooling2D(2, name="avgpool")(r)
    cat = L.Concatenate(axis=-1, name="concat")([mp, ap])
    c2 = L.Conv2D(16, 3, strides=2, padding="valid", activation="relu", name="conv2")(cat)
    g = L.GlobalAveragePooling2D(name="gap")(c2)
    y = L.Dense(10, name="fc")(g)
    return tf.keras.Model(x, y), (1, 16, 16, 3)


def mlp(tf):
    """Dense layers only."""
    L = tf.keras.layers
    x = L.Input((32,), batch_size=1, name="x")
    h = L.Dense(64, activation="relu", name="fc1")(x)
    h = L.Dense(32, activation="relu", name="fc2")(h)
    y = L.Dense(10, name="fc3")(h)
    return tf.keras.Model(x, y), (1, 32)


def classifier(tf):
    """Dense layers ending in a softmax over 10 classes."""
    L = tf.keras.layers
    x = L.Input((32,), batch_size=1, name="x")
    h = L.Dense(48, activation="relu", name="fc1")(x)
    y = L.Dense(10, name="fc2")(h)
    return tf.keras.Model(x, L.Softmax(name="probs")(y)), (1, 32)


def hybrid_cnn(tf):
    """Layers big enough for the converter's dynamic-range quantization (1024 weights or more):
    conv + relu6, a strided depthwise + relu, a depthwise with depth multiplier 2, a 1x1 conv,
    global average pool, dense + relu, dense; and a dense on [1, 4, 64] tokens (keep_num_dims)."""
    L = tf.keras.layers
    x = L.Input((12, 12, 8), batch_size=1, name="x")
    h = L.Conv2D(128, 3, padding="same", activation="relu6", name="conv1")(x)
    h = L.DepthwiseConv2D(3, strides=2, padding="same", activation="relu", name="dw1")(h)
    h = L.Conv2D(64, 1, name="pw1")(h)
    h = L.DepthwiseConv2D(3, depth_multiplier=2, padding="valid", name="dw2")(h)
    t = L.Reshape((4, 64), name="tokens")(L.Conv2D(16, 1, name="pw2")(h))
    t = L.Dense(64, name="token_fc")(t)
    g = L.GlobalAveragePooling2D(name="gap")(h)
    g = L.Dense(64, activation="relu", name="fc1")(g)
    y = L.Dense(40, name="fc2")(L.Concatenate(name="cat")([g, L.Flatten(name="flat")(t)]))
    return tf.keras.Model(x, y), (1, 12, 12, 8)


def gated_cnn(tf):
    """EfficientNet's and DenseNet's gates and scalings: conv + swish (x * sigmoid(x)), a
    squeeze-and-excite gate (global pool, dense, sigmoid, multiply), a batch norm after a
    concatenation (a multiply and an add by constants), a tanh, a subtraction, dense, softmax."""
    L = tf.keras.layers
    x = L.Input((8, 8, 4), batch_size=1, name="x")
    c = L.Conv2D(8, 3, padding="same", name="conv1")(x)
    s = L.Multiply(name="swish")([c, L.Activation("sigmoid", name="sig1")(c)])
    g = L.GlobalAveragePooling2D(keepdims=True, name="squeeze")(s)
    g = L.Dense(8, activation="sigmoid", name="excite")(g)
    e = L.Multiply(name="gate")([s, g])
    t = L.Activation("tanh", name="tanh")(L.Conv2D(8, 1, name="conv2")(x))
    cat = L.Concatenate(name="cat")([e, L.Subtract(name="sub")([e, t])])
    bn = L.BatchNormalization(name="bn")(cat)
    y = L.Dense(10, name="fc")(L.GlobalAveragePooling2D(name="gap")(bn))
    return tf.keras.Model(x, L.Softmax(name="probs")(y)), (1, 8, 8, 4)


def attention_cnn(tf):
    """A bilinear upsampling, a transpose and reshape to tokens, a dense, and a matmul of two
    activations (attention scores: BATCH_MATMUL), averaged, dense."""
    L = tf.keras.layers
    x = L.Input((8, 8, 4), batch_size=1, name="x")
    up = L.UpSampling2D(2, interpolation="bilinear", name="up")(L.Conv2D(8, 3, padding="same", name="conv")(x))
    tokens = L.Reshape((256, 8), name="tokens")(L.Permute((2, 1, 3), name="transpose")(up))
    q = L.Dense(8, name="query")(tokens)
    scores = L.Lambda(lambda z: tf.matmul(z[0], z[1], transpose_b=True), name="scores")([q, tokens])
    return tf.keras.Model(x, L.Dense(4, name="fc")(L.GlobalAveragePooling1D(name="gap")(scores))), (1, 8, 8, 4)


def upsample_nearest(tf):
    """Keras' nearest UpSampling2D (a TILE and a RESHAPE in TFLite) after a conv."""
    L = tf.keras.layers
    x = L.Input((8, 8, 4), batch_size=1, name="x")
    c = L.Conv2D(8, 3, padding="same", name="conv")(x)
    return tf.keras.Model(x, L.Conv2D(4, 1, name="head")(L.UpSampling2D(2, name="up")(c))), (1, 8, 8, 4)


def leaky_minmax(tf):
    """LeakyReLU (YOLO's, GANs'), and a MAXIMUM and a MINIMUM of two activations."""
    L = tf.keras.layers
    x = L.Input((8, 8, 4), batch_size=1, name="x")
    c = L.LeakyReLU(0.1, name="leaky")(L.Conv2D(8, 3, padding="same", name="conv")(x))
    m = L.Maximum(name="max")([c, L.Conv2D(8, 1, name="side1")(x)])
    n = L.Minimum(name="min")([m, L.Conv2D(8, 1, name="side2")(x)])
    return tf.keras.Model(x, L.Flatten(name="flat")(L.MaxPooling2D(2, name="pool")(n))), (1, 8, 8, 4)


def prelu_cnn(tf):
    """PReLU with one alpha per channel (shared over the image) and one per value (face
    recognition and super-resolution networks)."""
    L = tf.keras.layers
    x = L.Input((8, 8, 4), batch_size=1, name="x")
    c = L.PReLU(shared_axes=[1, 2], name="prelu1")(L.Conv2D(8, 3, padding="same", name="conv1")(x))
    d = L.PReLU(name="prelu2")(L.Conv2D(8, 1, name="conv2")(c))
    return tf.keras.Model(x, L.Flatten(name="flat")(d)), (1, 8, 8, 4)


def gelu_mlp(tf):
    """Dense layers with GELU between them: the erf form, then the tanh form (``approximate``)."""
    L = tf.keras.layers
    x = L.Input((8, 16), batch_size=1, name="x")
    h = L.Activation("gelu", name="gelu")(L.Dense(32, name="fc1")(x))
    h = L.Lambda(lambda t: tf.nn.gelu(t, approximate=True), name="gelu_tanh")(L.Dense(16, name="fc2")(h))
    return tf.keras.Model(x, L.Dense(4, name="fc3")(h)), (1, 8, 16)


def moves_and_extremes(tf):
    """Ops that move or pick int8 values: MIRROR_PAD (reflect), SPACE_TO_DEPTH, DEPTH_TO_SPACE,
    REDUCE_MAX, REDUCE_MIN, ARG_MAX (an int64 model output) after a conv."""
    L = tf.keras.layers
    x = L.Input((8, 8, 4), batch_size=1, name="x")
    c = L.Conv2D(8, 3, padding="same", name="conv")(x)
    p = L.Lambda(lambda t: tf.pad(t, [[0, 0], [1, 1], [2, 2], [0, 0]], mode="REFLECT"), name="mirror")(c)
    s2d = L.Lambda(lambda t: tf.nn.space_to_depth(t, 2), name="s2d")(c)
    d2s = L.Lambda(lambda t: tf.nn.depth_to_space(t, 2), name="d2s")(s2d)
    hi = L.Lambda(lambda t: tf.reduce_max(t, axis=[1, 2]), name="rmax")(p)
    lo = L.Lambda(lambda t: tf.reduce_min(t, axis=-1, keepdims=True), name="rmin")(d2s)
    arg = L.Lambda(lambda t: tf.argmax(t, axis=-1), name="argmax")(c)
    return tf.keras.Model(x, [hi, lo, arg]), (1, 8, 8, 4)


def conv_chain(tf):
    """Four 3x3 convolutions of one shape (relu, relu6, none, relu) with residual adds: layers
    that differ only in their quantization parameters (kernels that share one function)."""
    L = tf.keras.layers
    x = L.Input((12, 12, 8), batch_size=1, name="x")
    h = x
    for k, act in enumerate(["relu", "relu6", None, "relu"]):
        c = L.Conv2D(8, 3, padding="same", name=f"conv{k}")(h)
        c = L.ReLU(max_value=6.0, name=f"act{k}")(c) if act == "relu6" else (L.ReLU(name=f"act{k}")(c) if act else c)
        h = L.Add(name=f"add{k}")([h, c])
    y = L.Dense(4, name="fc")(L.GlobalAveragePooling2D(name="gap")(h))
    return tf.keras.Model(x, y), (1, 12, 12, 8)


BUILDERS = {"small_cnn": small_cnn, "conv_chain": conv_chain, "gelu_mlp": gelu_mlp, "moves_and_extremes": moves_and_extremes, "leaky_minmax": leaky_minmax, "prelu_cnn": prelu_cnn, "mlp": mlp, "classifier": classifier, "hybrid_cnn": hybrid_cnn, "gated_cnn": gated_cnn,
            "attention_cnn": attention_cnn, "upsample_nearest": upsample_nearest}


def _randomize(model, rng) -> None:
    """Seeded weights, biases not zero (Keras initializes biases to zero)."""
    for w in model.weights:
        shape = tuple(w.shape)
        fan_in = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        v = rng.normal(0.0, 1.0 / np.sqrt(max(fan_in, 1)), size=shape).astype(np.float32)
        if "variance" in w.name:  # a batch norm's: positive
            v = np.abs(v) + np.float32(0.5)
        w.assign(v)


def build(name: str):
    """Keras model ``name`` with its seeded random weights, and its input shape."""
    tf = _tf()
    tf.keras.utils.set_random_seed(SEED)
    model, shape = BUILDERS[name](tf)
    _randomize(model, np.random.default_rng(SEED))
    return model, shape


def export(name: str, folder: Path, quant: str = "float") -> tuple[Path, np.ndarray]:
    """Build model ``name``, convert it to ``folder/<name>_<quant>.tflite``.

    ``quant``: ``float``; ``int8`` (full integer: int8 inputs/outputs, a
    representative dataset of 20 seeded random inputs); ``int8-floatio`` (the same
    with the converter's default float input and output: a QUANTIZE first, a
    DEQUANTIZE last); ``int8-pertensor`` (``int8`` with one weight scale per tensor);
    ``int16x8`` (16-bit activations, int8 weights, float interface);
    ``dynamic`` (dynamic-range: float activations, int8 weights); ``float16`` (float16
    weights, float32 activations: the converter's float16 quantization); ``int8-offset`` (``int8``
    with every buffer's data stored after the flatbuffer at an offset, the layout of models
    over 2 GB that Google's ai-edge-quantizer writes for every model). Returns the path
    and a seeded input for it (float32, or int8 quantized with the input tensor's
    scale and zero point).
    """
    tf = _tf()
    model, shape = build(name)
    conv = tf.lite.TFLiteConverter.from_keras_model(model)
    if quant in ("int8", "int8-floatio", "int8-pertensor", "int8-offset", "int16x8", "dynamic"):
        conv.optimizations = [tf.lite.Optimize.DEFAULT]
    if quant.startswith("int8") or quant == "int16x8":
        samples = [np.random.default_rng(SEED + 1 + i).standard_normal(shape).astype(np.float32) for i in range(20)]

        def rep():
            for s in samples:
                yield [s]

        conv.representative_dataset = rep
        conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        if quant == "int16x8":
            conv.target_spec.supported_ops = [tf.lite.OpsSet.EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8]
        elif quant != "int8-floatio":
            conv.inference_input_type = tf.int8
            conv.inference_output_type = tf.int8
        if quant == "int8-pertensor":
            conv._experimental_disable_per_channel = True
    elif quant == "float16":  # float16 weights, each dequantized to float32 by a DEQUANTIZE op
        conv.optimizations = [tf.lite.Optimize.DEFAULT]
        conv.target_spec.supported_types = [tf.float16]
    elif quant != "float" and quant != "dynamic":
        raise ValueError(quant)
    data = conv.convert()
    if quant == "int8-offset":
        data = buffers_after_the_flatbuffer(data)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}_{quant}.tflite"
    path.write_bytes(data)
    x = np.random.default_rng(SEED + 100).standard_normal(shape).astype(np.float32)
    if quant in ("int8", "int8-pertensor", "int8-offset"):
        det = tf.lite.Interpreter(model_content=data).get_input_details()[0]
        scale, zp = det["quantization"]
        x = np.clip(np.round(x / scale) + zp, -128, 127).astype(np.int8)
    return path, x


def buffers_after_the_flatbuffer(data: bytes) -> bytes:
    """``data`` with every non-empty buffer's bytes moved after the flatbuffer (``offset`` from
    the file's start, ``size``; 16-byte aligned), as models over 2 GB and ai-edge-quantizer's
    are stored. The offsets are known once the flatbuffer's length is: packed twice, the
    second time with the same field sizes."""
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.convert_bytearray_to_object(data)
    moved = [(b, bytes(bytearray(b.data))) for b in model.buffers if b.data is not None and len(b.data)]
    for b, _ in moved:
        b.data, b.offset, b.size = None, 1 << 40, 1 << 40  # placeholders the size of the real values
    head = len(flatbuffer_utils.convert_object_to_bytearray(model))
    tail, at = b"", (head + 15) // 16 * 16
    for b, raw in moved:
        b.offset, b.size = at + len(tail), len(raw)
        tail += raw + b"\0" * (-len(raw) % 16)
    packed = flatbuffer_utils.convert_object_to_bytearray(model)
    assert len(packed) == head
    return packed + b"\0" * (at - head) + tail


def tflite_reference(model_path, inputs) -> dict[str, np.ndarray]:
    """Every tensor's value after one run of TFLite's reference kernels.

    ``inputs``: one array (single-input model), a list in input order, or a dict by
    input tensor name. Tensors that cannot be read are skipped.
    """
    tf = _tf()
    it = tf.lite.Interpreter(
        model_path=str(model_path),
        experimental_op_resolver_type=tf.lite.experimental.OpResolverType.BUILTIN_REF,
        experimental_preserve_all_tensors=True,
    )
    it.allocate_tensors()
    details = it.get_input_details()
    if isinstance(inputs, np.ndarray):
        inputs = [inputs]
    if isinstance(inputs, dict):
        for d in details:
            it.set_tensor(d["index"], inputs[d["name"]])
    else:
        for d, arr in zip(details, inputs):
            it.set_tensor(d["index"], arr)
    it.invoke()
    out: dict[str, np.ndarray] = {}
    for d in it.get_tensor_details():
        try:
            out[d["name"]] = np.array(it.get_tensor(d["index"]))
        except (ValueError, RuntimeError):
            continue
    return out


def output_names(model_path) -> list[str]:
    tf = _tf()
    it = tf.lite.Interpreter(model_path=str(model_path))
    return [d["name"] for d in it.get_output_details()]
