"""The alias poller (``EngineServer._poll`` and its rule, ``hotswap.AliasFollower``) against a scripted registry.

No Ray, no models: each registry lookup of the poller takes the next step of a script, and a fake draft manager
resolves the alias again when the poller asks it to swap, as ``DraftManager.swap`` does. A step is the version
the alias points at, or ``(at the poll, at the swap)`` when the alias moves between the poll and the swap, or an
exception (the lookup fails), or a callable run before the next lookup (something else changes the served draft).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from eagleray.serve import engine_server
from eagleray.serve.engine_server import EngineServer
from eagleray.serve.hotswap import SwapRecord

NAME = "d"
URI = f"models:/{NAME}@champion"
REFUSED = {"3"}  # the guard refuses it (a refusal before loading: its record has no version)
BROKEN = {"5"}  # the swap raises


class ScriptEnd(BaseException):
    """Ends the poller (not an Exception: the poller survives those)."""


class FakeDrafts:
    def __init__(self, serving: str):
        self.version = f"{NAME}/{serving}"
        self.alias_at_swap: str | None = None
        self.attempts: list[tuple[str, str]] = []  # (the version the swap found, outcome)

    async def swap(self, source: str) -> SwapRecord:
        assert source == URI
        found = f"{NAME}/{self.alias_at_swap}"
        if self.alias_at_swap in BROKEN:
            self.attempts.append((found, "raised"))
            raise RuntimeError("boom")
        if self.alias_at_swap in REFUSED:
            outcome, version = "refused_guard", None
        elif found == self.version:
            outcome, version = "unchanged", found
        else:
            outcome, version = "swapped", found
            self.version = found
        self.attempts.append((found, outcome))
        return SwapRecord(source, outcome, version, "", 0.0)


def run_poller(
    monkeypatch, script: list, serving: str = "2", server: SimpleNamespace | None = None
) -> tuple[FakeDrafts, Counter]:
    drafts, counted = FakeDrafts(serving), Counter()
    steps = list(script)

    def registry_version(uri: str, tracking_uri: str | None) -> str:
        assert uri == URI
        while steps and callable(steps[0]):
            steps.pop(0)(drafts)
        if not steps:
            raise ScriptEnd
        step = steps.pop(0)
        if isinstance(step, Exception):
            raise step
        at_poll, drafts.alias_at_swap = step if isinstance(step, tuple) else (step, step)
        return at_poll

    monkeypatch.setattr(engine_server, "registry_version", registry_version)
    server = server or SimpleNamespace()
    server.cfg = SimpleNamespace(mlflow=SimpleNamespace(tracking_uri=None))
    server.drafts = drafts
    server.metrics = SimpleNamespace(record_swap=lambda outcome: counted.update([outcome]))
    with pytest.raises(ScriptEnd):
        asyncio.run(EngineServer._poll(server, URI, 0))
    return drafts, counted


def test_the_poller_swaps_when_the_alias_moves_and_not_while_it_points_at_the_served_version(monkeypatch):
    drafts, _ = run_poller(monkeypatch, ["2", "2", "1", "1", "1"])
    assert drafts.attempts == [("d/1", "swapped")] and drafts.version == "d/1"


def test_the_poller_state_says_where_the_alias_was_last_seen(monkeypatch):
    """/health's ``alias``: the replica has caught up with the alias when its version is the serving draft's."""
    server = SimpleNamespace()
    t0 = time.time()
    drafts, _ = run_poller(monkeypatch, ["2", ("1", "2"), OSError("registry down")], server=server)
    status = server.alias_follower.status()
    assert status["uri"] == URI and status["version"] == "d/1" != drafts.version  # the swap found 2: not caught up
    assert t0 <= status["polled_at"] <= time.time()


def test_the_alias_moving_back_between_poll_and_swap_leaves_the_next_move_followed(monkeypatch):
    """The flaky adapt-loop test: the alias pointed at 1 for a moment, the poll saw 1, the swap found 2 again
    ('unchanged'); when the alias later moved to 1 for good, the poller took 1 as tried and never swapped."""
    drafts, _ = run_poller(monkeypatch, [("1", "2"), "2", "2", "1", "1"])
    assert drafts.attempts == [("d/2", "unchanged"), ("d/1", "swapped")] and drafts.version == "d/1"


def test_the_alias_back_on_the_polled_version_at_the_next_poll_is_swapped_to(monkeypatch):
    """The same race, the alias back on 1 before the next poll: the poller never saw it elsewhere; what the swap
    found (2) is what was handled, not the version the poll saw."""
    drafts, _ = run_poller(monkeypatch, [("1", "2"), "1"])
    assert drafts.attempts == [("d/2", "unchanged"), ("d/1", "swapped")]


def test_a_refused_version_is_not_retried_until_the_alias_moves_and_comes_back(monkeypatch):
    drafts, counted = run_poller(monkeypatch, ["3", "3", "3", "2", "2", "3", "3", "4"])
    assert drafts.attempts == [("d/3", "refused_guard"), ("d/3", "refused_guard"), ("d/4", "swapped")]
    assert drafts.version == "d/4" and not counted  # the fake's swap records its refusals itself, as swap does


def test_a_refused_version_is_retried_once_the_alias_moved_elsewhere_in_between(monkeypatch):
    drafts, _ = run_poller(monkeypatch, ["3", "4", "3"])
    assert [v for v, _ in drafts.attempts] == ["d/3", "d/4", "d/3"]


def test_a_swap_that_raises_is_counted_and_the_poller_goes_on(monkeypatch):
    drafts, counted = run_poller(monkeypatch, ["5", "5", "5", "1"])
    assert drafts.attempts == [("d/5", "raised"), ("d/1", "swapped")] and counted == {"failed_load": 1}


def test_a_failed_lookup_is_counted_and_the_poller_goes_on(monkeypatch):
    drafts, counted = run_poller(monkeypatch, [OSError("registry down"), OSError("registry down"), "1"])
    assert drafts.attempts == [("d/1", "swapped")] and counted == {"poll_error": 2}


def test_a_rollback_or_admin_swap_is_not_undone_while_the_alias_stays(monkeypatch):
    def rolled_back(drafts: FakeDrafts) -> None:  # the watchdog or POST /admin/rollback
        drafts.version = "d/2"

    drafts, _ = run_poller(monkeypatch, ["1", rolled_back, "1", "1", "4"])
    assert [v for v, _ in drafts.attempts] == ["d/1", "d/4"]

    def admin_swap(drafts: FakeDrafts) -> None:  # before the first poll: the alias still on the version served at start
        drafts.version = "d/9"

    drafts, _ = run_poller(monkeypatch, [admin_swap, "2", "2", "1"])
    assert [v for v, _ in drafts.attempts] == ["d/1"]
