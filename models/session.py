"""Loading an ONNX model artifact and running it off the event loop.

The session resolves the model's signature (`models/signature.py`) from the config and
the artifact, warms up at the batch sizes it will see, and answers feeds of column
tensors with the answer fields of its task.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from models.config import ModelConfig
from models.errors import ModelError
from models.signature import GraphPort, Signature, resolve

log = logging.getLogger(__name__)

Device = Literal["cpu", "cuda"]
Feeds = dict[str, np.ndarray]
"""Input name -> (batch, columns) tensor of its dtype."""

_PROVIDERS: dict[str, list[str]] = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
}


def load_session(config: ModelConfig, device: Device = "cpu"):
    """An ONNX Runtime session of the artifact; ModelError when it cannot be loaded."""
    import onnxruntime as ort

    path = config.path
    if not path.is_file():
        raise ModelError(f"model file {path} does not exist; hint: `headrace models train`")
    options = ort.SessionOptions()
    # Deliberate on small machines: ORT's default spins one thread per core and
    # competes with the consumer and producer threads.
    options.intra_op_num_threads = config.intra_op_threads
    options.inter_op_num_threads = 1
    # ORT would print each failed run to stderr; every failure becomes a ModelError instead.
    options.log_severity_level = 4
    available = ort.get_available_providers()
    providers = [p for p in _PROVIDERS[device] if p in available]
    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:
        raise ModelError(f"ONNX Runtime could not load {path}: {exc}") from exc


def signature_of(config: ModelConfig, session) -> Signature:
    """The resolved signature of a loaded session (ModelError lists every mismatch). It
    runs the model once on a row of zeros: that shows a ZipMap's class labels, and pays
    the session's one-time set-up before anything is timed."""
    metadata = session.get_modelmeta().custom_metadata_map
    inputs, outputs = graph_ports(session.get_inputs()), graph_ports(session.get_outputs())
    signature = resolve(config, inputs, outputs, metadata)
    feeds = {tensor.name: tensor.zeros(1) for tensor in signature.inputs}
    try:
        first = session.run([signature.output.tensor], feeds)[0]
    except Exception as exc:
        # Where the graph leaves an input's width open, a width that differs from the
        # config's or the metadata's shows only here.
        given = ", ".join(f"input {t.name!r} {len(t.columns)} columns" for t in signature.inputs)
        source = "model.inputs" if config.inputs is not None else "its metadata's feature_names"
        raise ModelError(
            f"model {config.path.name} failed on a row of zeros ({given}, from {source}): "
            f"{_ort_message(exc)}; hint: the usual cause is an input width that differs "
            f"from {source}: describe the inputs in model.inputs, or export the model again"
        ) from exc
    return dataclasses.replace(signature, output=signature.output.learn_classes(first))


def graph_ports(ports) -> list[GraphPort]:
    """A session's inputs or outputs (ONNX Runtime's `NodeArg`s) as the signature sees them."""
    return [GraphPort(port.name, port.type, tuple(port.shape)) for port in ports]


def _ort_message(exc: Exception) -> str:
    """ONNX Runtime's message without its status prefix: "[ONNXRuntimeError] : 2 :
    INVALID_ARGUMENT : Non-zero status ... Name:'Scaler' Status Message: Either ..." ->
    "INVALID_ARGUMENT in node 'Scaler': Either ..."."""
    found = re.match(
        r"\[ONNXRuntimeError\] : \d+ : (\w+) : (?:.*Name:'([^']*)' Status Message: )?(.*)",
        str(exc),
        re.DOTALL,
    )
    if found is None:
        return str(exc)
    status, node, message = found.groups()
    return f"{status}{f' in node {node!r}' if node else ''}: {message.strip()}"


class ModelSession:
    """One ONNX Runtime session with its signature, warmed up before first use.

    `run` blocks (ONNX releases the GIL while it runs); `run_timed` runs it on a single
    worker thread owned by this object, so the event loop never blocks. Call `close()`
    to stop that thread.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: Device = "cpu",
        warmup_batch_sizes: tuple[int, ...] = (1,),
    ) -> None:
        self._session = load_session(config, device)
        # A CUDA request silently falls back to CPU when CUDA is unusable: say so plainly.
        self.providers: list[str] = self._session.get_providers()
        if device == "cuda" and "CUDAExecutionProvider" not in self.providers:
            log.warning("CUDA was asked for %s but is not usable here; running on CPU",
                        config.path.name)  # fmt: skip
        self.device: Device = "cuda" if "CUDAExecutionProvider" in self.providers else "cpu"
        self.signature = signature_of(config, self._session)
        self._output = self.signature.output
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"onnx-{self.signature.name}")
        self.warmup_seconds: dict[int, float] = {}
        """Seconds of the warm-up run at each batch size."""
        for size in warmup_batch_sizes:
            self.warmup_seconds[size] = self.run_measured(self.zero_feeds(size))[1]

    def zero_feeds(self, rows: int) -> Feeds:
        return {tensor.name: tensor.zeros(rows) for tensor in self.signature.inputs}

    def run(self, feeds: Feeds) -> list[dict[str, Any]]:
        """The answer fields of each row (`ModelOutput.answers`)."""
        rows = len(next(iter(feeds.values())))
        try:
            if self.device == "cuda" and not self._output.zipmap:
                value = self._run_bound(feeds)
            else:
                value = self._session.run([self._output.tensor], feeds)[0]
            return self._output.answers(value, rows)
        except ModelError:
            raise
        except Exception as exc:  # ONNX Runtime's errors, or an output of the wrong shape
            raise ModelError(f"{self.signature.name} failed on a batch of {rows}: {exc}") from exc

    def _run_bound(self, feeds: Feeds) -> np.ndarray:
        """CUDA path: I/O binding copies the inputs once and keeps ORT from re-allocating."""
        binding = self._session.io_binding()
        for name, tensor in feeds.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(tensor))
        binding.bind_output(self._output.tensor, "cpu")
        self._session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    async def run_timed(self, feeds: Feeds) -> tuple[list[dict[str, Any]], float]:
        """Answers and the seconds the run itself took (without waiting for the thread)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.run_measured, feeds)

    def run_measured(self, feeds: Feeds) -> tuple[list[dict[str, Any]], float]:
        """Blocking: answers and the seconds of the run."""
        started = time.perf_counter()
        answers = self.run(feeds)
        return answers, time.perf_counter() - started

    def close(self) -> None:
        self._executor.shutdown(wait=True)
