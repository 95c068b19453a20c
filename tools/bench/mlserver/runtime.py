"""The MLServer custom runtime of the baseline: headrace's work for a batch of events.

Runs only in MLServer's environment (`env.py`), loaded by MLServer from the model's
`model-settings.json` (`implementation: tools.bench.mlserver.runtime.FraudRuntime`).
Per (adaptively batched) request, inline on MLServer's event loop, as a custom runtime
usually is (`parallel_workers: 0`, the issue's best MLServer setting):

1. one Feast `get_online_features` call for the batch's entity rows, on the pipeline's
   feature service over the same Feast repo (SQLite online store) headrace reads;
2. the float32 model matrix, column by column from the event's fields and the
   features, a missing value replaced by the column's default (the model's metadata,
   resolved by the harness and passed in the settings' `parameters.extra`);
3. one ONNX Runtime run of the same model file, one intra-op thread as headrace's;
4. a V2 answer per event: score, label and the input's Kafka timestamp.

Once loaded, with `freeze_heap`, it freezes the heap start-up left (`gc.freeze`), as
headrace's workers do, so that full collections do not walk Feast's and MLServer's
modules under traffic. Feast has no cache of its own, so every batch reads the store:
headrace's feature cache is part of what the comparison measures. A failure fails the whole batch
(MLServer logs it, the events stay unanswered and count as lost).
"""

from __future__ import annotations

import gc

import onnxruntime as ort
from feast import FeatureStore
from mlserver import MLModel
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput

from tools.bench.mlserver import v2


class FraudRuntime(MLModel):
    async def load(self) -> bool:
        extra = self.settings.parameters.extra
        self._store = FeatureStore(repo_path=extra["repo_path"])
        self._service = self._store.get_feature_service(extra["feature_service"])
        self._entity_fields = dict(extra["entity_fields"])
        self._columns = [(c["source"], float(c["default"])) for c in extra["columns"]]
        self._input = extra["input"]
        self._output = extra["output"]
        self._threshold = float(extra["threshold"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(extra["intra_op_threads"])
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(
            extra["model_path"], options, providers=["CPUExecutionProvider"]
        )
        if extra.get("freeze_heap"):
            gc.collect()
            gc.freeze()
        self.ready = True
        return self.ready

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        inputs = {i.name: list(getattr(i.data, "root", i.data)) for i in payload.inputs}
        rows = len(inputs[v2.TIMESTAMP_INPUT])
        features = self._store.get_online_features(
            features=self._service,
            entity_rows=v2.entity_rows(inputs, self._entity_fields),
            full_feature_names=True,
        ).to_dict()
        matrix = v2.model_matrix(inputs, features, self._columns, rows)
        (probabilities,) = self._session.run([self._output], {self._input: matrix})
        scores = v2.positive_scores(probabilities)
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            outputs=[
                ResponseOutput(name=v2.SCORE_OUTPUT, shape=[rows], datatype="FP32", data=scores),
                ResponseOutput(
                    name=v2.LABEL_OUTPUT,
                    shape=[rows],
                    datatype="BOOL",
                    data=[s >= self._threshold for s in scores],
                ),
                ResponseOutput(
                    name=v2.TIMESTAMP_OUTPUT,
                    shape=[rows],
                    datatype="INT64",
                    data=inputs[v2.TIMESTAMP_INPUT],
                ),
            ],
        )
