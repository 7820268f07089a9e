"""``eagleray serve --config FILE`` / ``python -m eagleray.jobs.serve --config FILE``.

FILE is either a Ray Serve config (``applications: [{import_path: eagleray.serve.app:build_app,
args: {serving: {...}}}]``, as ``serve run``/``serve deploy`` take) or a plain ServingConfig YAML.
Starts a local Ray instance (or joins RAY_ADDRESS), deploys the app and serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import yaml

from eagleray.jobs.entry import run_job
from eagleray.platform.config.load import load_yaml_config, parse_config
from eagleray.platform.errors import ConfigError, Problem
from eagleray.serve.serving_config import ServingConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="Serve config or ServingConfig YAML (see jobs/configs/serve-*.yaml)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's)")
    p.add_argument("--host", default=None, help="HTTP bind address (default: the config's, 127.0.0.1)")


def load_serving(path: str) -> ServingConfig:
    """The ServingConfig of a Serve config's first eagleray application, or of a plain ServingConfig file."""
    p = Path(path)
    data = yaml.safe_load(p.read_text()) if p.is_file() else None
    if not isinstance(data, dict) or "applications" not in data:
        return load_yaml_config(ServingConfig, p)
    apps = [a for a in data["applications"] if str(a.get("import_path", "")).startswith("eagleray.serve.app:")]
    if not apps:
        raise ConfigError(
            [
                Problem(
                    "applications",
                    "no application with import_path eagleray.serve.app:build_app",
                    "add one (see jobs/configs/serve-smollm2-cpu.yaml)",
                )
            ],
            source=str(p),
        )
    from eagleray.serve.app import AppArgs

    cfg = parse_config(AppArgs, apps[0].get("args") or {}, source=str(p), prefix="applications.0.args").load()
    http = data.get("http_options") or {}
    return cfg.model_copy(update={k: http[k] for k in ("host", "port") if k in http})


def direct_ingress_env(cfg: ServingConfig, ray_address: str | None) -> dict[str, str]:
    """What this process's environment needs before it starts Ray for ``serving.direct_port`` (Ray's processes
    inherit it); a Ray cluster started elsewhere (RAY_ADDRESS) was started without it."""
    env = cfg.direct_ingress_env()
    if env and ray_address:
        raise ConfigError(
            [
                Problem(
                    "serving.direct_port",
                    f"Ray Serve reads direct ingress from the environment its processes start with, and RAY_ADDRESS "
                    f"({ray_address}) joins a Ray started elsewhere",
                    "start that cluster with " + " ".join(f"{k}={v}" for k, v in env.items()) + " in its environment "
                    "and unset direct_port here, or unset RAY_ADDRESS so that eagleray serve starts Ray itself",
                )
            ]
        )
    return env


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from eagleray.serve.app import build
    from eagleray.serve.local import APP_NAME, wait_ready

    cfg = load_serving(args.config)
    cfg = cfg.model_copy(update={k: v for k, v in (("port", args.port), ("host", args.host)) if v is not None})
    app = build(cfg)  # before Ray starts: a draft the guard refuses is the error the user sees (exit 2)
    os.environ.update(direct_ingress_env(cfg, os.environ.get("RAY_ADDRESS")))
    ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://{cfg.host}:{cfg.port}"
    wait_ready(url, cfg.api_key, timeout_s=600)
    if cfg.direct_port is not None:
        url = f"http://{cfg.host}:{cfg.direct_port}"  # the replica's own server; the proxy's stays up on cfg.port
        wait_ready(url, cfg.api_key, timeout_s=120)
    print(
        f"eagleray serving {cfg.model_name!r} at {url}/v1 (draft: {cfg.draft.source if cfg.draft else 'none'}); Ctrl-C stops",
        flush=True,
    )
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` and `ray job stop` shut down like Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(run_job("python -m eagleray.jobs.serve", add_arguments, run))
