"""Loading an ONNX model artifact and running it off the event loop.

An artifact is one `.onnx` file whose metadata names the ordered input features,
their defaults for missing values, the model's name, version and decision threshold.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from models.errors import ModelError

log = logging.getLogger(__name__)

Device = Literal["cpu", "cuda"]

_PROVIDERS: dict[str, list[str]] = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
}


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    version: str
    feature_names: tuple[str, ...]
    feature_defaults: tuple[float, ...]
    threshold: float

    @classmethod
    def from_onnx(cls, path: Path, props: dict[str, str]) -> ModelMetadata:
        try:
            names = tuple(json.loads(props["feature_names"]))
            defaults = tuple(float(v) for v in json.loads(props["feature_defaults"]))
            return cls(
                name=props["model_name"],
                version=props["model_version"],
                feature_names=names,
                feature_defaults=defaults,
                threshold=float(props.get("threshold", "0.5")),
            )
        except (KeyError, ValueError) as exc:
            raise ModelError(
                f"{path} lacks headrace metadata ({exc}); expected feature_names, "
                "feature_defaults, model_name, model_version; hint: export with "
                "`headrace models train`"
            ) from exc


class ModelSession:
    """One ONNX Runtime session with its metadata, warmed up before first use.

    `predict` blocks (ONNX releases the GIL while it runs); `predict_async` runs it on
    a single worker thread owned by this object, so the event loop never blocks.
    Call `close()` to stop that thread.
    """

    def __init__(
        self,
        path: Path,
        device: Device = "cpu",
        intra_op_threads: int = 1,
        warmup_batch_sizes: tuple[int, ...] = (1,),
    ) -> None:
        import onnxruntime as ort

        if not path.is_file():
            raise ModelError(f"model file {path} does not exist; hint: `headrace models train`")
        options = ort.SessionOptions()
        # Deliberate on small machines: ORT's default spins one thread per core and
        # competes with the consumer and producer threads.
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        wanted = _PROVIDERS[device]
        available = ort.get_available_providers()
        providers = [p for p in wanted if p in available]
        try:
            self._session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:
            raise ModelError(f"ONNX Runtime could not load {path}: {exc}") from exc
        # A CUDA request silently falls back to CPU when CUDA is unusable: say so plainly.
        self.providers: list[str] = self._session.get_providers()
        if device == "cuda" and "CUDAExecutionProvider" not in self.providers:
            log.warning("CUDA was asked for %s but is not usable here; running on CPU", path.name)
        self.device: Device = "cuda" if "CUDAExecutionProvider" in self.providers else "cpu"
        props = self._session.get_modelmeta().custom_metadata_map
        self.metadata = ModelMetadata.from_onnx(path, props)
        self._input = self._session.get_inputs()[0].name
        # Outputs of the exported classifier: label, then class probabilities.
        self._probabilities_output = self._session.get_outputs()[-1].name
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"onnx-{self.metadata.name}")
        self.warmup_seconds: dict[int, float] = {}
        """Seconds of the warm-up run at each batch size."""
        width = len(self.metadata.feature_names)
        # The very first run pays the session's one-time set-up: keep it out of the times.
        self.predict(np.zeros((1, width), dtype=np.float32))
        for size in warmup_batch_sizes:
            self.warmup_seconds[size] = self._timed(np.zeros((size, width), np.float32))[1]

    def predict(self, matrix: np.ndarray) -> np.ndarray:
        """Positive-class probability per row of a float32 (batch, features) matrix."""
        if matrix.ndim != 2 or matrix.shape[1] != len(self.metadata.feature_names):
            raise ModelError(
                f"expected a (batch, {len(self.metadata.feature_names)}) matrix for "
                f"{self.metadata.name}, got shape {matrix.shape}"
            )
        if self.device == "cuda":
            probabilities = self._run_bound(matrix)
        else:
            _labels, probabilities = self._session.run(None, {self._input: matrix})
        scores = np.asarray(probabilities, dtype=np.float32)[:, 1]
        if scores.shape[0] != matrix.shape[0]:
            raise ModelError(f"model returned {scores.shape[0]} scores for {matrix.shape[0]} rows")
        return scores

    def _run_bound(self, matrix: np.ndarray) -> np.ndarray:
        """CUDA path: I/O binding copies the input once and keeps ORT from re-allocating."""
        binding = self._session.io_binding()
        binding.bind_cpu_input(self._input, np.ascontiguousarray(matrix))
        binding.bind_output(self._probabilities_output, "cpu")
        self._session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]

    async def predict_async(self, matrix: np.ndarray) -> np.ndarray:
        scores, _seconds = await self.predict_timed(matrix)
        return scores

    async def predict_timed(self, matrix: np.ndarray) -> tuple[np.ndarray, float]:
        """Scores and the seconds the run itself took (without waiting for the thread)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._timed, matrix)

    def _timed(self, matrix: np.ndarray) -> tuple[np.ndarray, float]:
        started = time.perf_counter()
        scores = self.predict(matrix)
        return scores, time.perf_counter() - started

    def close(self) -> None:
        self._executor.shutdown(wait=True)
