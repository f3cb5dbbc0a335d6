"""A tiny SNAC-shaped decoder, written with the ``onnx`` package, for the real onnxruntime to run.

It has the real export's signature (``onnx-community/snac_24khz-ONNX``, ``onnx/decoder_model.onnx``):
int64 inputs ``audio_codes.0`` ``[batch, F]``, ``audio_codes.1`` ``[batch, 2F]``, ``audio_codes.2``
``[batch, 4F]`` and a float32 output ``audio_values`` ``[batch, 1, 2048 F]``. Instead of SNAC's
network, each fine code ``c`` becomes 512 samples of ``c / 4096`` plus a small term from the other two
layers' means, so a test can tell exactly which codes reached which input.
"""

from __future__ import annotations

from pathlib import Path

HOP = 512


def write_snac_decoder(path: Path) -> Path:
    """Write the tiny decoder to ``path`` and return it."""
    import onnx
    from onnx import TensorProto, helper

    inputs = [
        helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", length])
        for name, length in (("audio_codes.0", "frames"), ("audio_codes.1", "codes_1"), ("audio_codes.2", "codes_2"))
    ]
    output = helper.make_tensor_value_info("audio_values", TensorProto.FLOAT, ["batch", 1, "samples"])
    consts = [
        helper.make_tensor("scale", TensorProto.FLOAT, [], [1 / 4096]),
        helper.make_tensor("small", TensorProto.FLOAT, [], [1 / 65536]),
        helper.make_tensor("axes", TensorProto.INT64, [2], [1, 3]),
        helper.make_tensor("repeats", TensorProto.INT64, [4], [1, 1, 1, HOP]),
        helper.make_tensor("shape", TensorProto.INT64, [3], [0, 1, -1]),
    ]
    nodes = [
        helper.make_node("Cast", ["audio_codes.0"], ["coarse"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["audio_codes.1"], ["middle"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["audio_codes.2"], ["fine"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["coarse"], ["coarse_mean"], axes=[1], keepdims=1),
        helper.make_node("ReduceMean", ["middle"], ["middle_mean"], axes=[1], keepdims=1),
        helper.make_node("Add", ["coarse_mean", "middle_mean"], ["means"]),
        helper.make_node("Mul", ["means", "small"], ["bias"]),
        helper.make_node("Mul", ["fine", "scale"], ["level"]),
        helper.make_node("Add", ["level", "bias"], ["value"]),
        helper.make_node("Unsqueeze", ["value", "axes"], ["column"]),
        helper.make_node("Tile", ["column", "repeats"], ["held"]),
        helper.make_node("Reshape", ["held", "shape"], ["audio_values"]),
    ]
    graph = helper.make_graph(nodes, "snac_24khz_decoder_stand_in", inputs, [output], initializer=consts)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def expected_samples(coarse: list[int], middle: list[int], fine: list[int]) -> list[float]:
    """What the tiny decoder answers for these layers: 512 samples of each fine code's level."""
    bias = (sum(coarse) / len(coarse) + sum(middle) / len(middle)) / 65536
    return [c / 4096 + bias for c in fine for _ in range(HOP)]
