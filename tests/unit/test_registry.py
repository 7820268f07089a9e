"""MLflow registry client: register a draft directory, alias it, resolve models:/ URIs to local dirs."""

from __future__ import annotations

import pytest
import torch

from eagleray.platform import registry
from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.guard import check_compatibility
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.errors import EaglerayError


def test_register_alias_and_resolve(tiny_target, tmp_path):
    import mlflow

    uri = registry.configure(f"sqlite:///{tmp_path / 'm.db'}", "reg-test")
    spec = TargetSpec.from_dir(tiny_target)
    draft = make_random_draft(spec, tmp_path / "draft", draft_vocab_size=64, counts=torch.arange(spec.vocab_size))
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.get_experiment_by_name("reg-test").experiment_id)
    client.log_artifacts(run.info.run_id, str(draft), "draft")
    v = registry.register_draft(
        "d", run.info.run_id, "draft", {"aux_layer_ids": [2, 4, 5], "target_fingerprint": spec.fingerprint}
    )
    registry.set_alias("d", "champion", v.version)
    got = registry.get_alias("d", "champion")
    assert got.version == v.version == "1" and got.tags["aux_layer_ids"] == "2,4,5" and "champion" in got.aliases
    for source in ("models:/d@champion", "models:/d/1"):
        local = registry.download_draft(source, tmp_path / source.replace("/", "_").replace(":", "").replace("@", "_"))
        assert check_compatibility(spec, local).ok
    with pytest.raises(EaglerayError, match="models:/d@nope does not exist"):
        registry.download_draft("models:/d@nope")
    with pytest.raises(EaglerayError, match="not a model URI"):
        registry.lookup("models:/d")


def test_doctor_checks_a_registered_draft_by_alias(tiny_target, tmp_path, monkeypatch, capsys):
    """`eagleray doctor --draft models:/name@alias` downloads the version from the registry and guards it."""
    import argparse

    import mlflow

    from eagleray.jobs import doctor as cli_doctor

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    registry.configure(uri, "doctor-test")
    spec = TargetSpec.from_dir(tiny_target)
    draft = make_random_draft(spec, tmp_path / "draft", draft_vocab_size=64, counts=torch.arange(spec.vocab_size))
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.get_experiment_by_name("doctor-test").experiment_id)
    client.log_artifacts(run.info.run_id, str(draft), "draft")
    v = registry.register_draft("dd", run.info.run_id, "draft", {})
    registry.set_alias("dd", "candidate", v.version)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    args = argparse.Namespace(target=str(tiny_target), draft="models:/dd@candidate", algorithm=None, max_model_len=None)
    assert cli_doctor.run(args) == 0
    assert "compatible: models:/dd@candidate can serve" in capsys.readouterr().out
    args.draft = "models:/dd@missing"
    with pytest.raises(EaglerayError, match="models:/dd@missing does not exist"):
        cli_doctor.run(args)


def test_resolve_draft_random_directory_and_errors(tiny_target, tmp_path):
    """The one resolver: 'random' needs the target, a directory is itself, anything else names the fix."""
    spec = TargetSpec.from_dir(tiny_target)
    rnd = registry.resolve_draft("random", spec, workdir=tmp_path)
    assert rnd.version == "random" and rnd.path == tmp_path / "random-draft" and check_compatibility(spec, rnd.path).ok
    same = registry.resolve_draft(rnd.path)
    assert same.path == rnd.path and same.version == "random-draft" and same.source == str(rnd.path)
    with pytest.raises(EaglerayError, match="'random' needs the target"):
        registry.resolve_draft("random")
    with pytest.raises(EaglerayError, match="is not a directory.*\n    fix: pass a draft directory, models:/"):
        registry.resolve_draft(tmp_path / "missing")


def test_random_draft_is_written_once_per_target_not_per_start(tiny_target, tmp_path, monkeypatch):
    """Every server started with 'random' used to leave a new ~128 MB copy in /tmp; now it is cached by target."""
    import tempfile

    monkeypatch.setenv("EAGLERAY_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    spec = TargetSpec.from_dir(tiny_target)
    first = registry.resolve_draft("random", spec)
    weights = next(first.path.glob("*.safetensors")).stat()
    again = registry.resolve_draft("random", spec)
    assert again.path == first.path and again.version == "random" and check_compatibility(spec, again.path).ok
    assert first.path.parent == tmp_path / "home" / "drafts" / "random"
    assert next(again.path.glob("*.safetensors")).stat().st_mtime_ns == weights.st_mtime_ns  # not rewritten
    assert list((tmp_path / "tmp").iterdir()) == [] and [p.name for p in first.path.parent.iterdir()] == [first.path.name]


def test_write_once_keeps_the_first_complete_copy_and_drops_the_rest(tmp_path):
    """Two replicas filling one cache: the second rename loses, its copy is removed, the first is untouched."""
    from eagleray.platform.registry.source import _write_once

    dest = tmp_path / "cache" / "d"

    def racing_write(tmp):  # another process finishes first while this one writes
        (tmp / "w").write_text("mine")
        dest.mkdir()
        (dest / "w").write_text("theirs")

    _write_once(dest, racing_write)
    assert (dest / "w").read_text() == "theirs" and sorted(p.name for p in dest.parent.iterdir()) == ["d"]

    def failing_write(tmp):
        (tmp / "half").write_text("x")
        raise RuntimeError("download failed")

    with pytest.raises(RuntimeError, match="download failed"):
        _write_once(tmp_path / "cache" / "e", failing_write)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["d"]  # no half-written cache, no leftover
    with pytest.raises(FileNotFoundError):  # a rename that fails with no winner's copy in place is an error
        _write_once(tmp_path / "cache" / "f", lambda tmp: tmp.rmdir())


def test_shipped_drafts_resolve_by_name_and_an_unknown_name_lists_them():
    from eagleray.platform.checkpoints.draft import DraftCheckpoint
    from eagleray.platform.checkpoints.shipped import SMOLLM2_CHAMPION

    got = registry.resolve_draft(f"shipped:{SMOLLM2_CHAMPION}")
    assert got.version == f"shipped:{SMOLLM2_CHAMPION}" and got.path.name == SMOLLM2_CHAMPION
    ckpt = DraftCheckpoint.open(got.path)
    assert ckpt.config["architectures"] == ["LlamaForCausalLMEagle3"] and ckpt.config["torch_dtype"] == "bfloat16"
    assert (got.path / "MODEL_CARD.md").is_file()
    with pytest.raises(EaglerayError, match=f"no shipped draft 'nope' \\(shipped: .*{SMOLLM2_CHAMPION}"):
        registry.resolve_draft("shipped:nope")
