"""A draft the guard refuses stops the app before Ray starts, with the guard's message (was a Ray RuntimeError traceback)."""

from __future__ import annotations

import pytest
import yaml

from eagleray.jobs.cli import main
from eagleray.platform.checkpoints.draft_factory import make_random_draft
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.errors import CompatibilityError
from eagleray.serve.serving_config import ServingConfig


@pytest.fixture
def empty_draft(tiny_target, tmp_path):
    draft = make_random_draft(TargetSpec.from_dir(tiny_target), tmp_path / "draft")
    (draft / "model.safetensors").write_bytes(b"")  # the probe's zero-byte checkpoint
    return draft


def _serving(target, draft) -> dict:
    return {"target": {"model": str(target), "device": "cpu"}, "draft": {"source": str(draft)}, "model_name": "tiny"}


def test_build_refuses_an_empty_draft_with_the_guards_message(tiny_target, empty_draft):
    from eagleray.serve.app import build

    with pytest.raises(CompatibilityError) as info:
        build(ServingConfig.model_validate(_serving(tiny_target, empty_draft)))
    assert "draft.files" in str(info.value) and "fix:" in str(info.value)


def test_eagleray_serve_exits_2_before_starting_ray(capsys, tmp_path, tiny_target, empty_draft):
    import ray

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "applications": [
                    {
                        "name": "eagleray",
                        "import_path": "eagleray.serve.app:build_app",
                        "args": {"serving": _serving(tiny_target, empty_draft)},
                    }
                ]
            }
        )
    )
    rc = main(["serve", "--config", str(cfg)])
    err = capsys.readouterr().err
    assert rc == 2 and "draft is not compatible" in err and "draft.files" in err and "Traceback" not in err, err
    assert not ray.is_initialized()
