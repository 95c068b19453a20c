"""`headrace check` and `headrace init` on the sample assets: the resolved column map of
a good config, every problem of a bad one, and a stanza that checks clean."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from models.train_intent import intent_path
from schemas.catalogue import SCHEMA_DIR
from tools.cli import cli
from tools.deploy import sample_config

pytestmark = pytest.mark.integration


def config_file(tmp_path: Path, sample_assets, edit=None) -> Path:
    raw = sample_config(
        "127.0.0.1:9", sample_assets.repo, sample_assets.model,
        clicks_model=intent_path(sample_assets.model),
    )  # fmt: skip
    if edit is not None:
        edit(raw["pipelines"][1])
    path = tmp_path / "headrace.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def check(path: Path):
    return CliRunner().invoke(cli, ["check", "-c", str(path)])


def test_a_good_config_shows_where_each_input_comes_from(tmp_path, sample_assets):
    result = check(config_file(tmp_path, sample_assets))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "input page_type (string, 1 columns)" in out
    assert "page_type (default '')  <- event" in out
    assert "product_stats__price (default" in out and "<- store" in out
    assert "multiclass, classes ['add_to_cart', 'browse', 'leave', 'purchase']" in out
    assert "answers IntentPrediction: event_id, session_id, input_topic" in out
    assert "2 pipeline(s), no problems" in out


def test_every_mismatch_is_listed_with_its_message(tmp_path, sample_assets):
    def break_it(spec: dict) -> None:
        inputs = spec["model"]["inputs"]
        inputs[0]["dtype"] = "float32"  # page_type is a string input
        inputs[1]["columns"] = ["dwell_seconds"]  # no such field or feature
        spec["model"]["output"]["tensor"] = "probabilities"  # no such output
        spec["input"]["validate"]["page_typ"] = ["required"]  # no such field
        spec["output"]["include"] = ["session_id", "status"]  # every answer has a status

    result = check(config_file(tmp_path, sample_assets, break_it))
    assert result.exit_code == 1
    out = result.output
    for expected in [
        "validate names 'page_typ', not a field of ClickEvent",
        "input 'page_type' is tensor(string) in the model, but its config says dtype float32",
        "hint: set dtype to string",
        "output.tensor 'probabilities' is not an output of the model (outputs: output_label",
        "output.include names 'status', which every answer carries already",
        "problem(s) in",
    ]:
        assert expected in out, out
    # A source problem shows once the model resolves; with a bad output it does not.


def test_a_column_without_a_source_names_the_input_and_what_is_available(tmp_path, sample_assets):
    def unknown_column(spec: dict) -> None:
        spec["model"]["inputs"][1]["columns"] = ["dwell_seconds"]

    result = check(config_file(tmp_path, sample_assets, unknown_column))
    assert result.exit_code == 1
    assert "input 'dwell_ms' column 'dwell_seconds' is neither a field of the event" in (
        result.output
    )
    assert "product_stats__price" in result.output  # what is available


def test_init_writes_a_stanza_that_checks_clean(tmp_path, sample_assets, monkeypatch):
    monkeypatch.chdir(SCHEMA_DIR)  # a path as typed here must hold in a config elsewhere
    result = CliRunner().invoke(
        cli,
        ["init", "--name", "clicks", "--schema", "click.avsc",
         "--model", str(intent_path(sample_assets.model)), "--feature-service",
         "click_intent", "--repo", str(sample_assets.repo)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (stanza,) = yaml.safe_load(result.stdout)
    assert stanza["model"]["output"]["task"] == "multiclass"
    names = {i["name"]: i for i in stanza["model"]["inputs"]}
    assert names["page_type"]["dtype"] == "string" and names["dwell_ms"]["dtype"] == "int64"
    assert names["product_stats__price"]["columns"] == ["product_stats__price"]
    assert stanza["entity_fields"] == {"product_id": "product_id"}
    assert stanza["input"]["schema"] == str((SCHEMA_DIR / "click.avsc").resolve())
    raw = sample_config("127.0.0.1:9", sample_assets.repo, sample_assets.model)
    raw["pipelines"] = [copy.deepcopy(stanza)]
    path = tmp_path / "init.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    checked = check(path)
    assert checked.exit_code == 0, checked.output


def test_the_reader_schema_can_be_the_latest_version_of_a_registry_subject(
    tmp_path, sample_assets, registry
):
    import json

    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    from schemas.catalogue import load_schema

    client = SchemaRegistryClient({"url": registry.url, "timeout": 10})
    client.register_schema("check-transactions-value",
                           Schema(json.dumps(load_schema("transaction.avsc")), "AVRO"))  # fmt: skip

    def from_subject(raw: dict) -> None:
        raw["pipelines"][0]["input"] = {
            **{k: v for k, v in raw["pipelines"][0]["input"].items() if k != "schema"},
            "subject": "check-transactions-value",
        }

    raw = sample_config("127.0.0.1:9", sample_assets.repo, sample_assets.model)
    from_subject(raw)
    without = tmp_path / "no-registry.yaml"
    without.write_text(yaml.safe_dump(raw, sort_keys=False))
    refused = check(without)
    assert refused.exit_code == 1 and "input.subject needs a registry" in refused.output
    raw["registry"] = {"url": registry.url}
    with_registry = tmp_path / "registry.yaml"
    with_registry.write_text(yaml.safe_dump(raw, sort_keys=False))
    result = check(with_registry)
    assert result.exit_code == 0, result.output
    assert "input Transaction (registry subject check-transactions-value)" in result.output


def test_a_default_score_on_a_multiclass_model_is_a_problem(tmp_path, sample_assets):
    """The worker refuses it at start; `check` said "no problems"."""

    def set_default(spec: dict) -> None:
        spec.setdefault("degradation", {})["default_score"] = 0.5

    result = check(config_file(tmp_path, sample_assets, set_default))
    assert result.exit_code == 1, result.output
    assert (
        "PROBLEM: pipeline clicks: degradation.default_score does not apply to a multiclass "
        "model; leave it unset (events no rung answers are shed)"
    ) in result.output


def test_a_model_with_a_fixed_batch_of_one_is_a_problem(tmp_path, sample_assets):
    """ONNX Runtime takes one row at a time from such a model: the worker's warm-up with
    larger batches failed at start, while `check` said "no problems"."""
    import onnx

    artifact = onnx.load(str(sample_assets.model))
    batch = artifact.graph.input[0].type.tensor_type.shape.dim[0]
    batch.ClearField("dim_param")
    batch.dim_value = 1
    fixed = tmp_path / "fixed.onnx"
    onnx.save(artifact, str(fixed))
    path = config_file(tmp_path, sample_assets)
    raw = yaml.safe_load(path.read_text())
    raw["pipelines"][0]["model"]["path"] = str(fixed)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    result = check(path)
    assert result.exit_code == 1, result.output
    name = artifact.graph.input[0].name
    assert (
        f"input {name!r} has a fixed batch dimension of 1, but max_batch_size is 64; hint: "
        "export the model with a dynamic batch axis, or set max_batch_size to 1"
    ) in result.output
