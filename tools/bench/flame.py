"""Where a worker's CPU goes: py-spy samples, a flame graph (SVG) and a split by stage.

`record` samples a running worker with py-spy (`--nonblocking`, so the worker is not
paused) into collapsed stacks: one line per distinct stack, frames root first, then
its sample count. `by_stage` files each sample under the stage of its innermost frame
that names one (a sample in ONNX Runtime's `run` called from the pipeline counts as
infer, not as the pipeline), and `write_svg` draws the stacks as a flame graph.
Only the thread holding the GIL is sampled (`--gil`): that is the Python work, which
is what the shares split. Native work that releases the GIL (librdkafka's threads,
ONNX Runtime's run) and idle time show in the CPU meter (`tools/bench/cpu.py`), not here.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

SAMPLE_RATE_HZ = 200

# Our modules as py-spy names them: it shortens a file's path by the longest entry of
# the worker's import path it finds, so `streams/publish.py` may show as `publish.py`.
_STREAMS = r"\((?:streams/)?"
_OWN_MODULES = "|".join(
    sorted(path.stem for path in (Path(__file__).parents[2] / "streams").glob("[a-z]*.py"))
)

# (stage, pattern on "function (file:line)"), tried on each frame from the leaf up.
STAGE_PATTERNS: tuple[tuple[str, re.Pattern], ...] = tuple(
    (stage, re.compile(pattern))
    for stage, pattern in (
        ("metrics", r"prometheus_client|" + _STREAMS + r"metrics\.py"),
        ("infer", r"onnxruntime|\(models/|" + _STREAMS + r"infer\.py"),
        (
            "decode",
            r"\((schemas/codec\.py|schemas/validation\.py)|\bdecode \((?!aiokafka)|fastavro.*read|"
            + _STREAMS
            + r"(?:decode|holds)\.py",
        ),
        (
            "encode",
            r"\bencode \((?!aiokafka)|_outcomes \(|fastavro.*writ|" + _STREAMS + r"encode\.py",
        ),
        ("features", r"\(features/"),
        ("publish", _STREAMS + r"(?:publish|outgoing|transact)\.py|\bproduce \("),
        ("ack/commit", r"\back\b|commit|store_offsets|_store_offsets"),
        ("admit", _STREAMS + r"(?:admit|batching|backpressure)\.py|\bPipeline\.route\b"),
        # Faust's worker runs the loop: samples on its frame are the loop's own work.
        ("event loop and hand-offs", r"Worker\.execute_from_commandline \(mode/"),
        (
            "consume",
            r"faust|aiokafka|mode/|" + _STREAMS + r"consumers/|\bconsume \(|\bpoll \(",
        ),
        # The rest of our own code (the runner's and the pipeline's bookkeeping): its
        # own work, not the event loop or the consumer that called it.
        ("other", _STREAMS + rf"(?:{_OWN_MODULES})\.py"),
        ("event loop and hand-offs", r"asyncio|uvloop|threading|concurrent/futures|queue\.py"),
    )
)


def _py_spy() -> str | None:
    # Installed with headrace's dev extra beside this Python, or anywhere on PATH.
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def available() -> bool:
    return _py_spy() is not None


def record(pid: int, seconds: float, out: Path) -> Path | None:
    """Sample process `pid` for `seconds` into collapsed stacks at `out`; None if py-spy
    is missing or could not attach (it needs ptrace rights over the process)."""
    py_spy = _py_spy()
    if py_spy is None:
        return None
    command = [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
               "--rate", str(SAMPLE_RATE_HZ), "--format", "raw", "--nonblocking", "--gil",
               "--output", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, timeout=seconds + 60, check=False)
    return out if done.returncode == 0 and out.exists() else None


def read_stacks(path: Path) -> Counter[tuple[str, ...]]:
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def stage_of(frames: tuple[str, ...]) -> str:
    for frame in reversed(frames):
        for stage, pattern in STAGE_PATTERNS:
            if pattern.search(frame):
                return stage
    return "other"


def by_stage(stacks: Counter[tuple[str, ...]]) -> dict[str, float]:
    """Share of the sampled (busy) time per stage, largest first."""
    total = sum(stacks.values()) or 1
    shares: Counter[str] = Counter()
    for frames, count in stacks.items():
        shares[stage_of(frames)] += count
    return {stage: count / total for stage, count in shares.most_common()}


def top_functions(stacks: Counter[tuple[str, ...]], count: int = 12) -> list[tuple[str, float]]:
    """The functions with the most samples on top of the stack (self time), as shares."""
    total = sum(stacks.values()) or 1
    leaves: Counter[str] = Counter()
    for frames, samples in stacks.items():
        leaves[frames[-1]] += samples
    return [(frame, samples / total) for frame, samples in leaves.most_common(count)]


def write_svg(stacks: Counter[tuple[str, ...]], title: str, path: Path) -> Path:
    """A flame graph: the root at the bottom, each frame as wide as its samples."""
    tree: dict = {}
    for frames, samples in stacks.items():
        node = tree
        for frame in frames:
            child = node.setdefault(frame, {"samples": 0, "children": {}})
            child["samples"] += samples
            node = child["children"]
    total = sum(stacks.values()) or 1
    width, row = 1200.0, 16
    depth = max((len(frames) for frames in stacks), default=0)
    height = (depth + 3) * row
    boxes: list[str] = []

    def draw(children: dict, x: float, level: int) -> None:
        for frame, node in sorted(children.items()):
            w = node["samples"] / total * width
            if w >= 0.3:
                y = height - (level + 2) * row
                share = node["samples"] / total * 100
                label = html.escape(frame)
                hue = 20 + (hash(frame) % 40)
                text = ""
                if w > 30:  # room for a label
                    text = (f'<text x="{x + 2:.1f}" y="{y + row - 4}" font-size="10">'
                            f"{label[: int(w / 6)]}</text>")  # fmt: skip
                boxes.append(
                    f"<g><title>{label} ({node['samples']} samples, {share:.1f}%)</title>"
                    f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" '
                    f'fill="hsl({hue},90%,60%)"/>{text}</g>'
                )
                draw(node["children"], x, level + 1)
            x += w

    draw(tree, 0.0, 0)
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
        f'font-family="monospace"><text x="4" y="14" font-size="12">{html.escape(title)} '
        f"({total} samples at {SAMPLE_RATE_HZ} Hz)</text>{''.join(boxes)}</svg>\n"
    )
    return path
