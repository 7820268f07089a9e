"""The shipped Serve config is valid for Ray Serve and for `eagleray serve`; build_app takes its args."""

from pathlib import Path

import pytest
import yaml

from eagleray.platform.errors import ConfigError

CONFIG = Path(__file__).resolve().parents[3] / "jobs" / "configs" / "serve-smollm2-cpu.yaml"


def test_serve_config_is_valid_for_ray_serve_and_eagleray():
    from ray.serve.schema import ServeDeploySchema

    from eagleray.jobs.serve import load_serving
    from eagleray.serve.app import build_app

    data = yaml.safe_load(CONFIG.read_text())
    ServeDeploySchema.model_validate(data) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(data)
    cfg = load_serving(str(CONFIG))
    assert cfg.model_name == "smollm2" and cfg.port == 8000 and cfg.draft.source == "random"
    assert build_app(data["applications"][0]["args"]) is not None


@pytest.mark.parametrize("args", [{}, {"config": "x.yaml", "serving": {}}, {"serving": {"target": {"modle": "x"}}}])
def test_build_app_rejects_bad_args(args):
    from eagleray.serve.app import build_app

    with pytest.raises(ConfigError):
        build_app(args)


def test_tensor_parallel_gets_strict_pack_bundles():
    from eagleray.platform.config.schemas import ServingConfig
    from eagleray.serve.app import engine_options

    opts = engine_options(ServingConfig.model_validate({"target": {"tensor_parallel_size": 4, "device": "cuda"}}))
    assert opts["placement_group_strategy"] == "STRICT_PACK" and len(opts["placement_group_bundles"]) == 4
    assert opts["placement_group_bundles"][0] == {"CPU": 1, "GPU": 1}
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
