"""The session pool: concurrent batches equal serial runs; routing; CUDA fallback."""

from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from models.errors import ModelError
from models.pool import SessionPool, warmup_sizes
from models.train import FEATURE_NAMES


@pytest.fixture(scope="module")
def pool(sample_assets):
    sessions = SessionPool(sample_assets.model, cpu_sessions=2, batch_sizes=(1, 8, 64))
    yield sessions
    sessions.close()


def batches(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.random((int(rng.integers(1, 65)), len(FEATURE_NAMES)), dtype=np.float32) * 50
        for _ in range(count)
    ]


def test_batches_from_several_threads_equal_serial_runs(pool):
    inputs = batches(40)
    serial = [pool.predict_blocking(b) for b in inputs]

    def run_async(batch):
        return asyncio.run(pool.predict(batch))

    with ThreadPoolExecutor(4) as threads:
        concurrent = list(threads.map(run_async, inputs))
    for expected, got in zip(serial, concurrent, strict=True):
        np.testing.assert_array_equal(got, expected)


async def test_concurrent_batches_on_one_loop_equal_serial_runs(pool):
    inputs = batches(24, seed=1)
    together = await asyncio.gather(*(pool.predict(b) for b in inputs))
    for batch, scores in zip(inputs, together, strict=True):
        np.testing.assert_array_equal(scores, pool.predict_blocking(batch))


def test_every_session_reports_its_provider(pool):
    assert pool.providers == [["CPUExecutionProvider"], ["CPUExecutionProvider"]]


def test_cuda_sessions_fall_back_to_cpu_plainly_without_a_gpu(sample_assets, caplog):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine may have a usable GPU")
    mixed = SessionPool(sample_assets.model, cpu_sessions=1, cuda_sessions=1)
    try:
        assert mixed.providers == [["CPUExecutionProvider"], ["CPUExecutionProvider"]]
        assert "CUDA was asked for" in caplog.text
    finally:
        mixed.close()


def test_a_pool_needs_a_session(sample_assets):
    with pytest.raises(ModelError, match="at least one session"):
        SessionPool(sample_assets.model, cpu_sessions=0, cuda_sessions=0)


def test_warmup_covers_every_size_a_small_batcher_emits():
    assert warmup_sizes(64) == tuple(range(1, 65))
    sizes = warmup_sizes(1000)
    assert sizes[:128] == tuple(range(1, 129)) and sizes[-1] == 1000 and 512 in sizes


def test_warmup_times_every_size_as_a_first_estimate_of_run_times(pool):
    assert set(pool.warmup_seconds) == {1, 8, 64}
    assert all(seconds > 0 for seconds in pool.warmup_seconds.values())
