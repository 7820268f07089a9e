"""Run the Serve app in-process on 127.0.0.1 and talk to it with the official ``openai`` client.

For the quickstart and the integration tests::

    url = start_local(cfg)                      # local Ray + Serve, returns http://127.0.0.1:<port>
    text, ext = chat(url, "Hello", cfg)         # ext = the response's `eagleray` field (draft_version, tau, ...)
    stop_local()
"""

from __future__ import annotations

import time
from typing import Any

from eagleray.platform.errors import EaglerayError
from eagleray.platform.host import free_port
from eagleray.serve.serving_config import ServingConfig

APP_NAME = "eagleray"


def start_local(cfg: ServingConfig, port: int | None = None, *, num_cpus: int | None = None, timeout_s: float = 300.0) -> str:
    """Start (or reuse) a local Ray instance and Serve on 127.0.0.1:port; deploy the app; return its URL."""
    import ray
    from ray import serve

    from eagleray.serve.app import build

    port = port or free_port()
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(cfg), name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, cfg.api_key, timeout_s)
    return url


def wait_ready(url: str, api_key: str | None, timeout_s: float) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", headers=headers, timeout=10)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as err:
            last = f"{type(err).__name__}: {err}"
        time.sleep(0.5)
    raise EaglerayError(
        f"the Serve app at {url} was not healthy after {timeout_s:.0f}s (last: {last})\n"
        f"    fix: read the replica logs under /tmp/ray/session_latest/logs/serve"
    )


def stop_local() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def client(url: str, cfg: ServingConfig):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=cfg.api_key or "unused", max_retries=0, timeout=120)


def chat(
    url: str, prompt: str, cfg: ServingConfig, *, max_tokens: int = 64, temperature: float = 0.0, stream: bool = False
) -> tuple[str, dict[str, Any]]:
    """One chat answer and its ``eagleray`` extension (draft_version, num_drafts, tau, ...)."""
    c = client(url, cfg)
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        r = c.chat.completions.create(model=cfg.model_name, messages=messages, max_tokens=max_tokens, temperature=temperature)
        return r.choices[0].message.content or "", dict(r.model_extra.get("eagleray") or {})
    text, ext = "", {}
    for chunk in c.chat.completions.create(
        model=cfg.model_name, messages=messages, max_tokens=max_tokens, temperature=temperature, stream=True
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        ext = dict(chunk.model_extra.get("eagleray") or ext)
    return text, ext


def tau_of(url: str, cfg: ServingConfig) -> float:
    """Mean acceptance length over the server's recent window (GET /health)."""
    import httpx

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return float(httpx.get(f"{url}/health", headers=headers, timeout=30).json()["metrics"].get("tau", 0.0))
