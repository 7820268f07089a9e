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
    assert cfg.model_name == "smollm2" and cfg.port == 8000 and cfg.draft.source == "random" and cfg.kv_cache_gib == 1.0
    assert build_app(data["applications"][0]["args"]) is not None


@pytest.mark.parametrize("args", [{}, {"config": "x.yaml", "serving": {}}, {"serving": {"target": {"modle": "x"}}}])
def test_build_app_rejects_bad_args(args):
    from eagleray.serve.app import build_app

    with pytest.raises(ConfigError):
        build_app(args)


def test_tensor_parallel_gets_strict_pack_bundles():
    from eagleray.serve.app import engine_options
    from eagleray.serve.serving_config import ServingConfig

    opts = engine_options(ServingConfig.model_validate({"target": {"tensor_parallel_size": 4, "device": "cuda"}}))
    assert opts["placement_group_strategy"] == "STRICT_PACK" and len(opts["placement_group_bundles"]) == 4
    assert opts["placement_group_bundles"][0] == {"CPU": 1, "GPU": 1}
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}


def test_a_cpu_replica_alone_gets_passive_openmp_workers():
    """GOMP_SPINCOUNT=0 reaches a CPU engine replica through its runtime env (this process is left as it is);
    a GPU replica and ``cpu_omp_passive: false`` get none."""
    from eagleray.serve.app import engine_options
    from eagleray.serve.serving_config import ServingConfig

    cpu = engine_options(ServingConfig(target={"device": "cpu"}))["ray_actor_options"]
    assert cpu["runtime_env"] == {"env_vars": {"GOMP_SPINCOUNT": "0"}}
    gpu = engine_options(ServingConfig(target={"device": "cuda"}))["ray_actor_options"]
    off = engine_options(ServingConfig(target={"device": "cpu"}, cpu_omp_passive=False))["ray_actor_options"]
    assert "runtime_env" not in gpu and "runtime_env" not in off


def test_serving_config_carries_the_engine_settings():
    """A deployment sets the KV cache, block size and verification backend; the engine gets them."""
    from eagleray.platform.config.load import parse_config
    from eagleray.serve.engine import EngineConfig
    from eagleray.serve.serving_config import ServingConfig

    cfg = parse_config(
        ServingConfig,
        {
            "model_name": "m",
            "max_num_seqs": 4,
            "block_size": 32,
            "kv_cache_gib": 0.25,
            "verify_backend": "reference",
            "draft": {"source": "random"},
        },
        prefix="serving",
    )
    eng = cfg.engine_config(draft=None)
    assert type(eng) is EngineConfig and eng.draft is None and cfg.draft.source == "random"
    assert (eng.max_num_seqs, eng.block_size, eng.kv_cache_gib, eng.verify_backend) == (4, 32, 0.25, "reference")
    with pytest.raises(ConfigError, match=r"serving\.kv_cache_gb"):
        parse_config(ServingConfig, {"kv_cache_gb": 1}, prefix="serving")


@pytest.mark.parametrize(
    "serving, says",
    [
        ({"capture": {"path": "/tmp/x"}}, "capture: needs a draft"),
        ({"draft": {"source": "random"}, "decode_path": "rows", "capture": {"path": "/tmp/x"}}, "decode_path: varlen"),
        ({"draft": {"source": "random"}, "capture": {"path": "/tmp/x", "rate": 1.5}}, "serving.capture.rate"),
        ({"draft": {"source": "random"}, "capture": {"path": "/tmp/x", "sample": 0.5}}, "serving.capture.sample"),
        ({"draft": {"source": "random"}, "capture": {"rate": 0.5}}, "serving.capture.path"),
        (
            {"draft": {"source": "random"}, "adapt_schedule": {"command": ["x"], "every_s": 60}},
            "adapt_schedule: the adaptation loop",
        ),
        (
            {"draft": {"source": "random"}, "capture": {"path": "/x"}, "adapt_schedule": {"command": [], "every_s": 60}},
            "serving.adapt_schedule.command",
        ),
    ],
)
def test_capture_config_errors_name_the_field(serving, says):
    from eagleray.platform.config.load import parse_config
    from eagleray.serve.serving_config import ServingConfig

    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        parse_config(ServingConfig, serving, prefix="serving")


def test_capture_is_off_by_default():
    from eagleray.serve.serving_config import ServingConfig

    assert ServingConfig().capture is None


def test_a_cpu_engine_replica_uses_every_core_not_rays_one_thread_reservation():
    import os

    import torch

    from eagleray.serve.engine_server import replica_cpu_threads
    from eagleray.serve.serving_config import ServingConfig

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # what Ray's OMP_NUM_THREADS=1 (num_cpus=1) leaves a replica with
        cores = len(os.sched_getaffinity(0))
        assert replica_cpu_threads(ServingConfig(target={"device": "cpu"})) == cores == torch.get_num_threads()
        assert replica_cpu_threads(ServingConfig(target={"device": "cpu"}, cpu_threads=1)) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_ingress_resources_need_a_separate_ingress():
    from eagleray.platform.config.load import parse_config
    from eagleray.serve.serving_config import ServingConfig

    head = {"ingress_resources": {"node:__internal_head__": 0.01}}
    assert parse_config(ServingConfig, {**head, "ingress": "separate"}, prefix="serving").ingress == "separate"
    with pytest.raises(ConfigError, match="ingress_resources: places a separate ingress replica"):
        parse_config(ServingConfig, {**head, "ingress": "engine"}, prefix="serving")
    with pytest.raises(ConfigError, match=r"serving\.ingress"):
        parse_config(ServingConfig, {"ingress": "proxy"}, prefix="serving")


@pytest.mark.parametrize("ingress", ["engine", "separate"])
def test_ingress_engine_is_one_deployment_placed_as_the_engine(ingress):
    from eagleray.serve.app import build
    from eagleray.serve.serving_config import ServingConfig

    top = build(ServingConfig.model_validate({"ingress": ingress, "draft": None}))._bound_deployment
    inner = [a._bound_deployment for a in top.init_args if hasattr(a, "_bound_deployment")]
    if ingress == "engine":  # the routes and the engine in one replica, with the engine's CPU reservation
        assert top.name == "EagleRayEngine" and not inner and top.ray_actor_options["num_cpus"] == 1
    else:
        assert top.name == "EagleRayIngress" and [d.name for d in inner] == ["EagleRayEngine"]
        assert top.ray_actor_options["num_cpus"] == 0
