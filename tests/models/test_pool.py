"""The session pool: concurrent batches equal serial runs; routing; CUDA fallback."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pydantic import ValidationError

from models.config import ModelConfig
from models.errors import ModelError
from models.pool import SessionPool, warmup_sizes
from models.train import FEATURE_NAMES, MODEL_NAME


@pytest.fixture(scope="module")
def pool(sample_assets):
    sessions = SessionPool(
        ModelConfig(path=sample_assets.model, cpu_sessions=2), batch_sizes=(1, 8, 64)
    )
    yield sessions
    sessions.close()


def batches(count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"X": rng.random((int(rng.integers(1, 65)), len(FEATURE_NAMES)), dtype=np.float32) * 50}
        for _ in range(count)
    ]


def test_batches_from_several_threads_equal_serial_runs(pool):
    inputs = batches(40)
    serial = [pool.run_blocking(b) for b in inputs]

    def run_async(batch):
        return asyncio.run(pool.run_timed(batch))[0]

    with ThreadPoolExecutor(4) as threads:
        concurrent = list(threads.map(run_async, inputs))
    assert concurrent == serial


async def test_concurrent_batches_on_one_loop_equal_serial_runs(pool):
    inputs = batches(24, seed=1)
    together = await asyncio.gather(*(pool.run_timed(b) for b in inputs))
    for batch, (answers, seconds) in zip(inputs, together, strict=True):
        assert len(answers) == len(batch["X"])
        assert answers == pool.run_blocking(batch)
        assert seconds > 0


def test_the_pool_has_its_sessions_signature(pool):
    assert pool.size == 2
    assert pool.signature.name == MODEL_NAME
    assert tuple(c.source for c in pool.signature.inputs[0].columns) == FEATURE_NAMES


def test_every_session_reports_its_provider(pool):
    assert pool.providers == [["CPUExecutionProvider"], ["CPUExecutionProvider"]]


async def test_concurrent_batches_are_spread_over_the_sessions(sample_assets):
    """A fresh pool has measured nothing: it routes by queue length, so batches sent
    together go to both sessions, and usage counts every batch and row once."""
    fresh = SessionPool(ModelConfig(path=sample_assets.model, cpu_sessions=2))
    try:
        inputs = batches(8, seed=2)
        await asyncio.gather(*(fresh.run_timed(b) for b in inputs))
        usage = fresh.usage
        assert [u["device"] for u in usage] == ["cpu", "cpu"]
        assert all(u["runs"] > 0 for u in usage)
        assert sum(u["runs"] for u in usage) == len(inputs)
        assert sum(u["rows"] for u in usage) == sum(len(b["X"]) for b in inputs)
    finally:
        fresh.close()


def test_blocking_runs_are_not_counted_as_routed_work(sample_assets):
    single = SessionPool(ModelConfig(path=sample_assets.model))
    try:
        single.run_blocking(batches(1)[0])
        assert single.usage == [{"device": "cpu", "runs": 0, "rows": 0}]
    finally:
        single.close()


def test_cuda_sessions_fall_back_to_cpu_plainly_without_a_gpu(sample_assets, caplog):
    mixed = SessionPool(ModelConfig(path=sample_assets.model, cpu_sessions=1, cuda_sessions=1))
    try:
        if ["CUDAExecutionProvider"] in [p[:1] for p in mixed.providers]:
            pytest.skip("CUDA is usable here")
        assert mixed.providers == [["CPUExecutionProvider"], ["CPUExecutionProvider"]]
        assert [u["device"] for u in mixed.usage] == ["cpu", "cpu"]
        assert "CUDA was asked for" in caplog.text
    finally:
        mixed.close()


def test_a_pool_needs_a_session(sample_assets):
    with pytest.raises(ValidationError, match="at least one session"):
        ModelConfig(path=sample_assets.model, cpu_sessions=0, cuda_sessions=0)
    # A config built without validation is refused by the pool itself.
    empty = ModelConfig(path=sample_assets.model).model_copy(update={"cpu_sessions": 0})
    with pytest.raises(ModelError, match="at least one session"):
        SessionPool(empty)


def test_a_pool_of_a_missing_model_is_refused(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        SessionPool(ModelConfig(path=tmp_path / "absent.onnx", cpu_sessions=2))


def test_warmup_covers_every_size_a_small_batcher_emits():
    assert warmup_sizes(64) == tuple(range(1, 65))
    sizes = warmup_sizes(1000)
    assert sizes[:128] == tuple(range(1, 129)) and sizes[-1] == 1000 and 512 in sizes


def test_warmup_times_every_size_as_a_first_estimate_of_run_times(pool):
    assert set(pool.warmup_seconds) == {1, 8, 64}
    assert all(seconds > 0 for seconds in pool.warmup_seconds.values())
