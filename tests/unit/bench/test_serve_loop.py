"""`bench serve-loop`: the Serve engine replica's loop (AsyncEngine) under concurrent clients, real SmolLM2 on CPU:
every request completes, each streams its tokens, the draft server's outputs equal the plain server's."""

from __future__ import annotations

import pytest

from eagleray.jobs.bench.serve_loop import run
from eagleray.platform.errors import EaglerayError


def test_every_request_completes_on_both_servers_with_equal_outputs(tmp_path):
    out = run(["--num-prompts", "3", "--concurrency", "2", "--max-tokens", "3", "--json", str(tmp_path / "r.json")])
    assert [s["server"] for s in out["servers"]] == ["plain", "draft"]
    for s in out["servers"]:
        assert (s["completed"], s["failed"], s["tokens"]) == (3, 0, 9)
        assert s["median_ttft_ms"] > 0 and s["median_tpot_ms"] > 0
    assert out["lossless"] is True and (tmp_path / "r.json").exists()


def test_nothing_to_send_is_refused_by_name():
    with pytest.raises(EaglerayError, match="--num-prompts 0"):
        run(["--num-prompts", "0"])
