"""How the ingress reaches the engine: over a Serve handle (its own replica) or in its own process.

``serving.ingress: separate`` puts the OpenAI routes in a replica of their own that calls the engine
deployment through a :class:`HandleClient`; ``ingress: engine`` runs the routes in the engine's replica
(:class:`~eagleray.serve.app` builds one deployment), calling :class:`~eagleray.serve.engine_server.EngineServer`
through a :class:`LocalClient`: one process and one Ray streaming hop fewer per token. Both give the
ingress the same five calls; a stream has the handle stream's ``cancel()``.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Protocol


class EngineStream(Protocol):
    """The engine's items for one request; ``cancel()`` ends it and aborts the request."""

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]: ...

    async def __anext__(self) -> dict[str, Any]: ...

    def cancel(self) -> None: ...


class EngineClient(Protocol):
    def generate(self, payload: dict[str, Any]) -> EngineStream: ...

    async def health(self) -> dict[str, Any]: ...

    async def info(self) -> dict[str, Any]: ...

    async def swap(self, source: str) -> dict[str, Any]: ...

    async def rollback(self) -> dict[str, Any]: ...


class HandleClient:
    """The engine deployment behind a Serve ``DeploymentHandle``."""

    def __init__(self, handle: Any):
        self.handle = handle

    def generate(self, payload: dict[str, Any]) -> EngineStream:
        return self.handle.options(stream=True).generate.remote(payload)

    async def health(self) -> dict[str, Any]:
        return await self.handle.health.remote()

    async def info(self) -> dict[str, Any]:
        return await self.handle.info.remote()

    async def swap(self, source: str) -> dict[str, Any]:
        return await self.handle.swap.remote(source)

    async def rollback(self) -> dict[str, Any]:
        return await self.handle.rollback.remote()


class LocalStream:
    """An in-process engine generator with a handle stream's ``cancel()``: closing it aborts the request."""

    _closing: set[asyncio.Task] = set()  # close tasks in flight (the loop keeps only weak references)

    def __init__(self, items: AsyncIterator[dict[str, Any]]):
        self._items = items

    def __aiter__(self) -> "LocalStream":
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self._items.__anext__()

    def cancel(self) -> None:
        task = asyncio.get_running_loop().create_task(self._items.aclose())
        LocalStream._closing.add(task)
        task.add_done_callback(LocalStream._closing.discard)


class LocalClient:
    """An :class:`~eagleray.serve.engine_server.EngineServer` in this process."""

    def __init__(self, server: Any):
        self.server = server

    def generate(self, payload: dict[str, Any]) -> EngineStream:
        return LocalStream(self.server.generate(payload))

    async def health(self) -> dict[str, Any]:
        return await self.server.health()

    async def info(self) -> dict[str, Any]:
        return await self.server.info()

    async def swap(self, source: str) -> dict[str, Any]:
        return await self.server.swap(source)

    async def rollback(self) -> dict[str, Any]:
        return await self.server.rollback()
