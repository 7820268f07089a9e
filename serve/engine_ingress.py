"""The OpenAI routes and the engine in one replica (``serving.ingress: engine``).

A token then crosses one process boundary (engine replica -> Serve proxy) instead of two (engine replica ->
ingress replica -> proxy), and the machine runs one Python process fewer while the engine steps. The
routes, their errors and auth are the ingress's own (:class:`~eagleray.serve.ingress.OpenAIIngress`); the
engine's Serve hooks (``reconfigure`` for a draft hot-swap, ``check_health``) are forwarded to it. What this
gives up is the separate ingress's answer while the engine replica is lost (a clean 503 from a replica
that is still up): with both in one replica, a lost replica takes its routes along, and Serve's proxy answers
until the replacement is up. Keep ``ingress: separate`` where that matters (docs/fault-model.md).
"""

from __future__ import annotations

import os
from typing import Any

from eagleray.platform.config.load import parse_config
from eagleray.serve.engine_client import LocalClient
from eagleray.serve.engine_server import EngineServer
from eagleray.serve.ingress import OpenAIIngress
from eagleray.serve.serving_config import ServingConfig


class EngineIngress(OpenAIIngress):
    """Ray Serve ingress class of ``ingress: engine`` (wrapped with ``serve.deployment`` + ``serve.ingress(app)``)."""

    def __init__(self, serving: dict[str, Any]):
        parse_config(ServingConfig, serving, prefix="serving").check_direct_ingress(os.environ)  # before the engine loads
        self.server = EngineServer(serving)
        super().__init__(LocalClient(self.server), serving)

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        await self.server.reconfigure(user_config)

    async def check_health(self) -> None:
        await self.server.check_health()

    def __del__(self) -> None:
        """Ray Serve calls this when the replica shuts down: the engine's step loop stops with it."""
        server = getattr(self, "server", None)
        if server is not None:
            server.shutdown()
