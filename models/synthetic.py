"""Heavy models with the sample model's interface: a chosen cost per event, for tests
and benchmarks of serving when the model, not the plumbing, is the bottleneck.

The weights are random (the scores mean nothing); the inputs, outputs and metadata are
those of the model it is made `like`, so a pipeline serves it unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from models.config import ModelConfig
from models.session import load_session


def write_heavy_model(like: Path, out: Path, width: int = 1024, layers: int = 8) -> Path:
    """Same inputs, outputs and metadata as `like`, with `layers` dense layers of
    `width` per row (about 2 * layers * width² FLOPs per event). The hidden layers
    share one weight matrix, so the file stays small whatever the depth."""
    props = load_session(ModelConfig(path=like)).get_modelmeta().custom_metadata_map
    rng = np.random.default_rng(0)
    features = len(json.loads(props["feature_names"]))
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.05, (features, width)).astype(np.float32), "w0"),
        numpy_helper.from_array(rng.normal(0, 0.05, (width, width)).astype(np.float32), "w"),
    ]
    nodes = [helper.make_node("MatMul", ["features", "w0"], ["h0"])]
    for i in range(1, layers):
        nodes.append(helper.make_node("MatMul", [f"h{i - 1}", "w"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i}"]))
    nodes += [
        helper.make_node("ReduceMean", [f"h{layers - 1}"], ["mean"], axes=[1], keepdims=1),
        helper.make_node("Sigmoid", ["mean"], ["p"]),
        helper.make_node("Sub", ["one", "p"], ["q"]),
        helper.make_node("Concat", ["q", "p"], ["probabilities"], axis=1),
        helper.make_node("Greater", ["p", "half"], ["positive"]),
        helper.make_node("Cast", ["positive"], ["label64"], to=TensorProto.INT64),
        helper.make_node("Squeeze", ["label64", "axis1"], ["label"]),
    ]
    constants = [
        numpy_helper.from_array(np.array([[1.0]], np.float32), "one"),
        numpy_helper.from_array(np.array([[0.5]], np.float32), "half"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
    ]
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [None, features])],
        [
            helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, [None, 2]),
        ],
        initializer=weights + constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    original = onnx.load(str(like))
    for prop in original.metadata_props:
        entry = model.metadata_props.add()
        entry.key = prop.key
        entry.value = "fraud-heavy" if prop.key == "model_name" else prop.value
    onnx.save(model, str(out))
    return out
