"""``serving.direct_port``: the engine's replica serves HTTP itself (Ray Serve's direct ingress), set up only where
it can work: the environment ``eagleray serve`` gives Ray before it starts, refused where Ray was started elsewhere,
and a replica started without it refuses to load instead of never listening on the port."""

import pytest

from eagleray.platform.config.load import parse_config
from eagleray.platform.errors import ConfigError, EaglerayError
from eagleray.serve.serving_config import ServingConfig

DIRECT = {"ingress": "engine", "port": 8000, "direct_port": 8001}
ENV = {
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "8001",
    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "8002",
}


def test_off_by_default_and_no_environment_then():
    cfg = ServingConfig()
    assert cfg.direct_port is None and cfg.direct_ingress_env() == {}
    cfg.check_direct_ingress({})  # nothing asked, nothing needed


def test_the_environment_names_the_one_port():
    assert parse_config(ServingConfig, DIRECT, prefix="serving").direct_ingress_env() == ENV


@pytest.mark.parametrize(
    ("serving", "says"),
    [
        ({**DIRECT, "ingress": "separate"}, "direct_port: serves HTTP from the replica that runs the routes"),
        ({**DIRECT, "direct_port": 8000}, "direct_port: 8000 is also port"),
        ({**DIRECT, "direct_port": 0}, r"serving\.direct_port"),
    ],
)
def test_config_errors_name_the_field(serving, says):
    with pytest.raises(ConfigError, match=says):
        parse_config(ServingConfig, serving, prefix="serving")


def test_eagleray_serve_sets_it_before_starting_ray_and_refuses_a_cluster_started_elsewhere():
    from eagleray.jobs.serve import direct_ingress_env

    cfg = parse_config(ServingConfig, DIRECT, prefix="serving")
    assert direct_ingress_env(cfg, None) == ENV
    assert direct_ingress_env(ServingConfig(), "ray://head:10001") == {}
    with pytest.raises(ConfigError, match=r"serving\.direct_port.*RAY_ADDRESS") as err:
        direct_ingress_env(cfg, "ray://head:10001")
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS=1" in str(err.value)


@pytest.mark.parametrize(
    "env", [{}, {**ENV, "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}, {**ENV, "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "30000"}]
)
def test_a_replica_started_without_it_refuses_to_load(env):
    cfg = parse_config(ServingConfig, DIRECT, prefix="serving")
    with pytest.raises(EaglerayError, match=r"serving\.direct_port=8001: this replica started without"):
        cfg.check_direct_ingress(env)
    cfg.check_direct_ingress(ENV)


def test_the_engine_replica_checks_before_loading_its_engine(monkeypatch, tmp_path):
    from eagleray.serve.engine_ingress import EngineIngress

    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    serving = {**DIRECT, "target": {"model": str(tmp_path / "no-model-here"), "device": "cpu"}}
    with pytest.raises(EaglerayError, match=r"serving\.direct_port=8001: this replica started without"):
        EngineIngress(serving)  # raised before the target is looked up (a missing model would be a different error)
