"""How a worker ends when it gives up on a batch (exit 70): one line naming the batch,
the failure and a hint for the failures headrace names; a traceback only for a bug."""

from __future__ import annotations

import subprocess
import sys

import pytest

from streams.app import EXIT_BATCH_FAILED

GIVE_UP = """
import logging, sys
logging.basicConfig(stream=sys.stderr, format="%(levelname)s %(message)s")
from streams.app import exit_on_fatal
from streams.errors import PublishError, TransactionFenced
from streams.records import InputRecord
record = InputRecord("transactions", 2, 41, 0, b"k", b"v", ())
try:
    raise {error}
except Exception as exc:  # as the runner catches what a stage raised
    exit_on_fatal(exc, [record])
"""


def give_up(error: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", GIVE_UP.format(error=error)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        (
            "PublishError('1 of 1 records were not delivered (Local: Message timed out)')",
            "check that the brokers are up",
        ),
        ("TransactionFenced('fenced by a newer producer')", "its own broker.instance_id"),
    ],
    ids=["unwritable", "fenced"],
)
def test_a_batch_given_up_ends_the_worker_with_one_line_and_a_hint(error, hint):
    done = give_up(error)
    assert done.returncode == EXIT_BATCH_FAILED, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("CRITICAL giving up on a batch of 1 from transactions[2]@41: ")
    assert "; hint: " in line and hint in line.split("; hint: ")[1]


def test_a_bug_that_ends_the_worker_keeps_its_traceback():
    done = give_up("KeyError('a bug')")
    assert done.returncode == EXIT_BATCH_FAILED, done.stderr
    assert "Traceback" in done.stderr and "KeyError: 'a bug'" in done.stderr
    assert "hint: a bug in headrace" in done.stderr
