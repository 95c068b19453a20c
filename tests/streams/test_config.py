"""Configuration validation: errors name the file, the field and what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from streams.config import load_config, parse_config
from streams.errors import ConfigError
from tools.deploy import sample_config

REPO_ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, data) -> Path:
    path = tmp_path / "headrace.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def valid() -> dict:
    return sample_config("127.0.0.1:9092", Path("repo"), Path("models/m.onnx"))


def test_the_shipped_config_is_valid():
    config = load_config(REPO_ROOT / "headrace.yaml")
    assert config.pipelines[0].input_topic == "transactions"
    assert config.features.repo_path == REPO_ROOT / "features" / "repo"


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    config = load_config(write(tmp_path, valid()))
    assert config.features.repo_path == tmp_path / "repo"
    assert config.pipelines[0].model.path == tmp_path / "models" / "m.onnx"


def test_the_known_schemas_file_is_the_config_files_own(tmp_path):
    # Not the working directory's: registries elsewhere give the same ids other schemas.
    data = {**valid(), "registry": {"url": "http://127.0.0.1:8081/apis/ccompat/v7"}}
    config = load_config(write(tmp_path, data))
    assert config.registry.known_schemas_file == tmp_path / ".headrace" / "known-schemas.json"


def test_defaults_fill_what_is_left_out(tmp_path):
    data = valid()
    del data["pipelines"][0]["max_batch_size"]
    config = load_config(write(tmp_path, data))
    assert config.pipelines[0].max_batch_size == 64
    assert config.registry is None
    # No fallback model and no default answer: the answer cache, then shed records.
    degradation = config.pipelines[0].degradation
    assert degradation.fallback_model is None and degradation.default_score is None
    assert degradation.answer_cache.max_entries > 0


def test_the_fallback_model_path_resolves_like_the_model_path(tmp_path):
    data = valid()
    data["pipelines"][0]["degradation"] = {"fallback_model": {"path": "models/lite.onnx"}}
    config = load_config(write(tmp_path, data))
    assert config.pipelines[0].degradation.fallback_model.path == tmp_path / "models/lite.onnx"


@pytest.mark.parametrize(
    ("edit", "field", "problem"),
    [
        (lambda d: d["pipelines"][0].update(max_batch_size=0), "pipelines.0.max_batch_size",
         "greater than or equal to 1"),
        (lambda d: d["pipelines"][0].update(max_wait_ms=-1), "pipelines.0.max_wait_ms",
         "greater than or equal to 0"),
        (lambda d: d["pipelines"][0].pop("input_topic"), "pipelines.0.input_topic",
         "Field required"),
        (lambda d: d["pipelines"][0]["model"].update(cpu_sessions=0), "pipelines.0.model",
         "at least one session"),
        (lambda d: d["pipelines"][0].update(batching="greedy"), "pipelines.0.batching",
         "'adaptive' or 'fixed'"),
        (lambda d: d["pipelines"][0].update(max_in_flight=100, resume_in_flight=100),
         "pipelines.0", "must be below max_in_flight"),
        (lambda d: d.update(colour="blue"), "colour", "Extra inputs are not permitted"),
        (lambda d: d.update(pipelines=[]), "pipelines", "at least 1"),
        (lambda d: d.update(registry={"url": "localhost:8081"}), "registry.url",
         "should match pattern"),
        (lambda d: d["pipelines"][0].update(input_topic="bad topic"), "pipelines.0.input_topic",
         "should match pattern"),
        (lambda d: d["pipelines"][0].update(priority={"default": 3}), "pipelines.0.priority",
         "default priority 3 has no budget share"),
        (lambda d: d["pipelines"][0].update(priority={"budget_shares": [1.0, 0.5]}),
         "pipelines.0.priority.budget_shares", "must not decrease"),
        (lambda d: d["pipelines"][0].update(input={"event_id_field": "event_id"}),
         "pipelines.0.input", "exactly one of `schema`"),
        (lambda d: d["pipelines"][0].update(input={"schema": "t.avsc", "validate": {
            "amount": {"min": 5, "max": 1}}}), "pipelines.0.input.validate.amount",
         "min (5) is above max (1)"),
        (lambda d: d["pipelines"][0]["model"].update(inputs=[{"name": "X", "dtype": "int8",
            "columns": ["amount"]}]), "pipelines.0.model.inputs.0.dtype", "'float32'"),
        (lambda d: d.update(delivery="exactly-once"), "delivery",
         "'at_least_once' or 'exactly_once'"),
    ],
)  # fmt: skip
def test_errors_name_file_and_field(tmp_path, edit, field, problem):
    data = valid()
    edit(data)
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(str(path))
    assert f"{field}:" in message
    assert problem in message


def test_two_pipelines_cannot_share_an_input_topic():
    data = valid()
    second = {**data["pipelines"][0], "name": "other"}
    data["pipelines"].append(second)
    with pytest.raises(ConfigError, match="input_topic"):
        parse_config(data, "inline")


def test_not_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "pipelines: [unclosed"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")


def test_config_is_frozen(tmp_path):
    config = load_config(write(tmp_path, valid()))
    with pytest.raises(ValueError):
        config.pipelines[0].max_batch_size = 3


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_exactly_once_is_a_choice_of_either_runtime(tmp_path, runtime):
    config = load_config(write(tmp_path, {**valid(), "runtime": runtime}))
    assert config.delivery == "at_least_once"
    config = load_config(
        write(tmp_path, {**valid(), "runtime": runtime, "delivery": "exactly_once"})
    )
    assert config.delivery == "exactly_once"


def test_fetching_is_each_runtimes_own_unless_set(tmp_path):
    # Bare answers each fetch on its first byte; Faust's busy fetches wait for 16 KiB
    # (its light-load fetches are answered on their first byte by `FetchPace`).
    broker = load_config(write(tmp_path, valid())).broker
    assert broker.fetching("bare") == (500, 1)
    assert broker.fetching("faust") == (5, 16_384)
    data = {**valid(), "broker": {"fetch_max_wait_ms": 2}}
    broker = load_config(write(tmp_path, data)).broker
    assert broker.fetching("bare") == (2, 1)
    assert broker.fetching("faust") == (2, 16_384)
