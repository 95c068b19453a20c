"""The benchmark's measuring tools: CPU meter, py-spy stage split, flame graph, devices."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from types import SimpleNamespace

from tools.bench import devices, flame, stages
from tools.bench.cpu import CpuMeter, cpu_seconds, thread_cpu_seconds
from tools.bench.harness import Bench, BenchSettings
from tools.deploy import sample_config, write_config


def test_the_cpu_meter_sees_this_process_burn_cpu():
    meter = CpuMeter({"me": os.getpid(), "gone": None})
    before = meter.snapshot()
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    after = meter.snapshot()
    assert set(before.seconds) == {"me"}
    assert CpuMeter.per_event_us(before, after, 1000)["me"] >= 150  # 0.2 s over 1,000 events
    mine = CpuMeter.cores(before, after)["me"]
    assert 0 < mine <= os.cpu_count()
    machine = CpuMeter.machine_cores(before, after)  # the whole machine: this process and more
    assert machine["busy"] >= 0.8 * mine  # clock ticks of 10 ms over 0.2 s
    assert machine["busy"] + machine["stolen"] <= os.cpu_count() * 1.05
    assert cpu_seconds(2**22 + 12345) is None  # no such process


# A worker stand-in: its main thread (the event loop) spins 0.2 s of CPU, a helper thread
# 0.3 s, then it waits for stdin to close. Its own process: the test process runs
# librdkafka threads of its session's clients, which would blur the split.
_SPLIT_WORKER = """
import sys, threading, time
def spin(seconds):
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        pass
spin(0.2)
helper = threading.Thread(target=spin, args=(0.3,))
helper.start()
helper.join()
print("spun", flush=True)
sys.stdin.read()
"""


def test_the_cpu_meter_splits_a_worker_by_thread():
    worker = subprocess.Popen(
        [sys.executable, "-c", _SPLIT_WORKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        meter = CpuMeter({"worker": worker.pid}, by_thread=frozenset({"worker"}))
        before = meter.snapshot()
        assert worker.stdout.readline() == "spun\n"
        # The helper ended before this snapshot: still counted, from the process total.
        spent = CpuMeter.per_event_us(before, meter.snapshot(), 1_000_000)  # µs = seconds
    finally:
        worker.communicate("", timeout=10)
    assert 0.15 <= spent["worker/loop"] <= 0.35  # with the interpreter starting
    assert 0.25 <= spent["worker/threads"] <= 0.45
    assert spent["worker/librdkafka"] == 0
    parts = ("worker/loop", "worker/librdkafka", "worker/threads")
    assert abs(spent["worker"] - sum(spent[part] for part in parts)) < 0.02
    assert thread_cpu_seconds(2**22 + 12345) is None


def test_samples_go_to_the_stage_of_their_innermost_known_frame():
    run = "Session.run (onnxruntime/capi/onnxruntime_inference_collection.py:395)"
    infer = ("main (cli.py:1)", "Pipeline._run (streams/pipeline.py:250)", run)
    decode = ("main (cli.py:1)", "AvroDecoder.decode (schemas/codec.py:50)")
    idle = ("main (cli.py:1)", "BaseEventLoop._run_once (asyncio/base_events.py:1884)")
    stacks = Counter({infer: 6, decode: 3, idle: 1})
    assert flame.by_stage(stacks) == {"infer": 0.6, "decode": 0.3, "event loop and hand-offs": 0.1}
    assert flame.top_functions(stacks, 1) == [(run, 0.6)]


def test_our_frames_count_as_their_stage_with_or_without_their_package_in_the_path():
    # py-spy may shorten `streams/publish.py` to `publish.py`; either way the frame is
    # ours, not the event loop's or Faust's above it.
    loop = ("run (asyncio/runners.py:190)", "Runner.run (asyncio/runners.py:118)")
    agent = ("_add_agent.<locals>.consume (consumers/faust.py:120)",)
    publish = ("PipelineRunner._publish (runner.py:375)", "produce_together (publish.py:445)")
    admit = ("PipelineRunner._put (streams/runner.py:285)", "Tickets.priority (admit.py:213)")
    count = ("PipelineRunner._release (runner.py:330)", "Pipeline._count (pipeline.py:392)")
    wake = ("MicroBatcher.put (batching.py:141)", "Event.set (asyncio/locks.py:192)")
    stacks = Counter({
        (*loop, *publish): 4,
        (*agent, *admit): 3,
        (*loop, *count): 2,
        (*agent, "Struct.decode (aiokafka/protocol/struct.py:35)"): 1,
        ("Worker.execute_from_commandline (mode/worker.py:264)",): 1,
        (*loop, *wake): 1,
    })  # fmt: skip
    shares = {"publish": 4, "admit": 3, "other": 2, "consume": 1, "event loop and hand-offs": 2}
    assert flame.by_stage(stacks) == {stage: n / 12 for stage, n in shares.items()}


def test_the_flame_graph_has_a_box_per_frame_with_its_share(tmp_path):
    stacks = Counter({("a (x.py:1)", "b (x.py:2)"): 3, ("a (x.py:1)", "c (x.py:3)"): 1})
    svg = flame.write_svg(stacks, "test", tmp_path / "f.svg").read_text()
    assert svg.startswith("<svg")
    assert "a (x.py:1) (4 samples, 100.0%)" in svg
    assert "b (x.py:2) (3 samples, 75.0%)" in svg


def test_the_devices_check_reports_cpu_figures_and_whether_cuda_is_usable(sample_assets):
    result = devices.run(sample_assets.model, seconds_per_size=0.01)
    assert set(result["latency"]) == set(devices.SIZES)
    assert all(row["cpu"]["runs"] >= devices.MIN_RUNS for row in result["latency"].values())
    if not result["cuda_usable"]:
        assert "cuda" not in result["latency"][1]
        assert result["routing"] is None
        assert "CUDA is not usable here" in devices.markdown(result)


def test_without_baselines_the_sweep_keeps_the_runtimes_asked_for():
    assert BenchSettings(baselines=False, systems=("bare",)).swept_systems() == ("bare",)
    assert BenchSettings(baselines=False).swept_systems() == ("headrace", "bare")
    assert BenchSettings(baselines=False, systems=("kafka",)).swept_systems() == ("headrace",)
    assert BenchSettings(systems=("kafka", "bare")).swept_systems() == ("kafka", "bare")


def test_the_bench_overrides_only_the_fetch_settings_it_was_given():
    quiet = {"echo": lambda *_a, **_k: None}
    assert Bench(BenchSettings(), **quiet)._fetch_settings() == {}
    latency_first = BenchSettings(fetch_min_bytes=1, fetch_max_wait_ms=500)
    assert Bench(latency_first, **quiet)._fetch_settings() == {
        "fetch_min_bytes": 1, "fetch_max_wait_ms": 500,
    }  # fmt: skip
    assert Bench(BenchSettings(fetch_max_wait_ms=2), **quiet)._fetch_settings() == {
        "fetch_max_wait_ms": 2
    }


def test_a_failing_sweep_step_runs_again_and_bisection_repeats_must_all_pass():
    """The sweep's rules on a system that passes up to 300/s, with one noisy failure at
    200/s: the rerun stands, so the noise does not set the bracket."""
    runs: list[float] = []
    noisy = {200.0}

    def run_step(_system, rate, phase, at_window=None):
        runs.append(rate)
        noise = rate in noisy and runs.count(rate) == 1
        good = rate <= 300 and not noise
        return SimpleNamespace(offered_per_s=rate, within_budget=good, overloaded=rate > 600,
                               phase=phase)  # fmt: skip

    bench = Bench(BenchSettings(refine_steps=2, repeats=2), echo=lambda *_a, **_k: None)
    bench.systems = {}
    bench._run_step = run_step
    steps = bench._sweep(SimpleNamespace(name="bare"), [100.0, 200.0, 400.0, 800.0])
    assert runs == [100, 200, 200, 400, 400, 800, 800, 300, 300, 350]
    assert bench.systems["bare"] == {
        "sustainable_per_s": 300, "first_failing_per_s": 350, "capped": False,
    }  # fmt: skip
    assert len(steps) == len(runs)


def test_the_stage_cost_runs_a_pipeline_without_kafka_and_counts_its_batches(
    sample_assets, tmp_path
):
    raw = sample_config("127.0.0.1:1", sample_assets.repo, sample_assets.model)
    config = write_config(raw, tmp_path / "worker.yaml")
    costs = stages.measure(config, batch_sizes=(1, 32), pause_ms=(0.0, 2.0), windows=2)
    assert [(c.batch_size, c.pause_ms) for c in costs] == [(1, 0), (1, 2), (32, 0), (32, 2)]
    assert all(0 < c.min_us <= c.median_us for c in costs)
    # A batch of 32 costs more than one of 1, and less than 32 of them: a per-batch part.
    hot_one, hot_many = costs[0].min_us, costs[2].min_us
    assert hot_one < hot_many < 32 * hot_one


def test_raw_kafka_is_swept_past_the_others_top_rate_to_find_its_limit():
    settings = BenchSettings(sweep_start_per_s=100.0, sweep_max_per_s=800.0)
    assert settings.offered_rates() == [100.0, 200.0, 400.0, 800.0]
    assert settings.raw_kafka_rates() == [100.0, 200.0, 400.0, 800.0, 1_600.0, 3_200.0]
    # Rates given: exactly those, for every system.
    assert BenchSettings(rates=(50.0, 70.0)).raw_kafka_rates() == [50.0, 70.0]
