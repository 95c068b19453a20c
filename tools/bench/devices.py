"""`headrace bench --scenario devices`: the CUDA path of ONNX Runtime, checked.

- which providers this ONNX Runtime build offers, and which a session asked for CUDA
  really got (a session falls back to CPU silently when CUDA is unusable);
- batch latency at sizes 1 to 1024 on CPU and, where usable, on CUDA (p50/p99 of
  repeated runs on the same input, the copy to and from the device included);
- the session pool's routing with one CPU and one CUDA session: small batches should
  stay on the CPU and large ones go to the GPU once both are measured.

It needs no Kafka. On a machine without a usable CUDA provider it says so and reports
the CPU figures alone.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from models.config import ModelConfig
from models.pool import SessionPool
from models.session import ModelSession

SIZES = tuple(2**i for i in range(11))  # 1 .. 1024
SECONDS_PER_SIZE = 0.5
MIN_RUNS = 20
ROUTING_SMALL, ROUTING_LARGE, ROUTING_ROUNDS = 4, 1024, 50


def run(model_path: Path, seconds_per_size: float = SECONDS_PER_SIZE) -> dict:
    import onnxruntime as ort

    result: dict = {
        "onnxruntime": ort.__version__,
        "available_providers": ort.get_available_providers(),
        "cuda_usable": False,
        "latency": {},
        "routing": None,
    }
    config = ModelConfig(path=model_path)
    cpu = ModelSession(config, "cpu")
    cuda = ModelSession(config, "cuda")
    try:
        result["cuda_session_providers"] = cuda.providers
        result["cuda_usable"] = cuda.device == "cuda"
        sessions = {"cpu": cpu, **({"cuda": cuda} if result["cuda_usable"] else {})}
        (model_input,) = cpu.signature.inputs
        rng = np.random.default_rng(0)
        for size in SIZES:
            feeds = {model_input.name: rng.random((size, len(model_input.columns)), np.float32)}
            result["latency"][size] = {
                device: _timings(session, feeds, seconds_per_size)
                for device, session in sessions.items()
            }
    finally:
        cpu.close()
        cuda.close()
    if result["cuda_usable"]:
        result["routing"] = asyncio.run(_routing(model_path))
    return result


def _timings(session: ModelSession, feeds: dict, seconds: float) -> dict[str, float]:
    runs = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(runs) < MIN_RUNS:
        started = time.perf_counter_ns()
        session.run(feeds)
        runs.append((time.perf_counter_ns() - started) / 1000)
    p50, p99 = np.percentile(runs, [50, 99])
    return {"runs": len(runs), "p50_us": float(p50), "p99_us": float(p99)}


async def _routing(model_path: Path) -> dict:
    """Where a pool of one CPU and one CUDA session sends small and large batches."""
    config = ModelConfig(path=model_path, cpu_sessions=1, cuda_sessions=1)
    pool = SessionPool(config, batch_sizes=(1, 1024))
    try:
        (model_input,) = pool.signature.inputs
        placed = {}
        for size in (ROUTING_SMALL, ROUTING_LARGE):
            before = [member["rows"] for member in pool.usage]
            feeds = {model_input.name: model_input.zeros(size)}
            for _ in range(ROUTING_ROUNDS):
                await pool.run_timed(feeds)
            placed[size] = {
                member["device"]: (member["rows"] - rows) // size
                for member, rows in zip(pool.usage, before, strict=True)
            }
        return {"batches_per_device_by_size": placed, "rounds": ROUTING_ROUNDS}
    finally:
        pool.close()


def markdown(result: dict) -> str:
    lines = ["# headrace devices check", "",
             f"ONNX Runtime {result['onnxruntime']}; available providers: "
             f"{', '.join(result['available_providers'])}.", ""]  # fmt: skip
    if result["cuda_usable"]:
        lines.append(f"A session asked for CUDA got {result['cuda_session_providers']}.")
    else:
        lines.append("CUDA is not usable here: a session asked for CUDA got "
                     f"{result.get('cuda_session_providers')}. CPU figures only.")  # fmt: skip
    devices = sorted({d for row in result["latency"].values() for d in row})
    lines += ["", "| batch | " + " | ".join(f"{d} p50 µs | {d} p99 µs" for d in devices) + " |",
              "|---|" + "---|---|" * len(devices)]  # fmt: skip
    for size, row in result["latency"].items():
        cells = " | ".join(f"{row[d]['p50_us']:.0f} | {row[d]['p99_us']:.0f}" for d in devices)
        lines.append(f"| {size} | {cells} |")
    if result["routing"]:
        lines += ["", "Routing (one CPU and one CUDA session, batches per device):", ""]
        for size, placed in result["routing"]["batches_per_device_by_size"].items():
            lines.append(f"- batches of {size}: {placed}")
    return "\n".join(lines) + "\n"
