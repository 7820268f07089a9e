"""``bench serve``: what the eagleray engine did during the load, from its /health counters."""

from pathlib import Path

from eagleray.jobs.bench.serve_load import _engine_during


def test_engine_during_is_the_difference_and_the_busy_share_of_the_wall():
    ms0 = {"prefill_step_ms": 400.0, "plain_decode_step_ms": 50.0, "spec_decode_step_ms": 0.0}
    cache0 = {"prefix_cache_queries": 100, "prefix_cache_hits": 16}
    before = {"prefill_steps": 2, "plain_decode_steps": 10, "spec_decode_steps": 0, "busy_seconds": 3.0, **ms0, **cache0}
    ms1 = {"prefill_step_ms": 500.0, "plain_decode_step_ms": 70.0, "spec_decode_step_ms": 120.0}
    cache1 = {"prefix_cache_queries": 1300, "prefix_cache_hits": 144}
    after = {"prefill_steps": 10, "plain_decode_steps": 260, "spec_decode_steps": 4, "busy_seconds": 63.0, **ms1, **cache1}
    d = _engine_during(before, after, wall_s=80.0)
    assert d == {
        "engine_prefill_steps": 8,
        "engine_plain_decode_steps": 250,
        "engine_spec_decode_steps": 4,
        "engine_busy_seconds": 60.0,
        "engine_prefix_cache_queries": 1200,  # prompt tokens of the load's requests, of them cached:
        "engine_prefix_cache_hits": 128,
        "engine_prefill_step_ms": 525.0,  # (10 x 500 - 2 x 400) / 8: the steps during the load, not the run's mean
        "engine_plain_decode_step_ms": 70.8,
        "engine_spec_decode_step_ms": 120.0,
        "engine_busy_share": 0.75,
    }
    idle = _engine_during(before, {**before, "busy_seconds": 3.0}, wall_s=10.0)
    assert idle["engine_prefill_step_ms"] is None and idle["engine_spec_decode_step_ms"] is None


def test_vs_vllm_is_per_round_and_the_median_with_every_line_above_one_when_eagleray_is_ahead():
    from eagleray.jobs.bench.serve_load import vs_vllm

    def rec(rnd, server, tok_s, tpot, ttft):
        return {"round": rnd, "server": server, "output_throughput": tok_s, "median_tpot_ms": tpot, "median_ttft_ms": ttft}

    records = [
        rec(0, "eagleray", 40.0, 100.0, 2000.0),
        rec(0, "vllm", 50.0, 80.0, 1000.0),
        rec(1, "eagleray", 60.0, 50.0, 1000.0),
        rec(1, "vllm", 50.0, 100.0, 2000.0),
        rec(2, "eagleray", 45.0, 90.0, 1500.0),
        rec(2, "vllm", 50.0, 90.0, 1500.0),
    ]
    r = vs_vllm(records)["eagleray"]
    assert r["output_tok_s"] == {"rounds": [0.8, 1.2, 0.9], "median": 0.9}
    assert r["median_tpot"] == {"rounds": [0.8, 2.0, 1.0], "median": 1.0}
    assert r["median_ttft"]["rounds"] == [0.5, 2.0, 1.0]
    assert vs_vllm([rec(0, "eagleray", 40.0, 100.0, 2000.0)]) == {}  # no vLLM in the round: no ratio


def test_steal_share_reads_the_eighth_column():
    from eagleray.jobs.bench.serve_load import _steal_share

    assert _steal_share([10, 0, 5, 80, 0, 0, 0, 5, 0, 0], [40, 0, 15, 100, 0, 0, 0, 25, 0, 0]) == 0.25
    assert _steal_share(None, [1] * 10) is None


def test_the_champion_servers_run_the_same_draft_and_are_compared_with_each_other(tmp_path):
    import json

    import yaml

    from eagleray.jobs.bench.serve_load import CHAMPION_K, _champion_dir, _server_command, vs_vllm

    vllm = _server_command("vllm-champion", 8001, tmp_path / "model", tmp_path, 8)
    spec = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(_champion_dir()), "num_speculative_tokens": CHAMPION_K}
    assert "--speculative-config" not in _server_command("vllm", 8001, tmp_path / "model", tmp_path, 8)
    ours = _server_command("eagleray-champion", 8002, tmp_path / "model", tmp_path, 8)
    draft = yaml.safe_load(Path(ours[ours.index("--config") + 1]).read_text())["applications"][0]["args"]["serving"]["draft"]
    assert draft["source"] == str(_champion_dir()) and draft["num_speculative_tokens"] == CHAMPION_K

    def rec(server, tok_s):
        return {"round": 0, "server": server, "output_throughput": tok_s, "median_tpot_ms": 10.0, "median_ttft_ms": 10.0}

    r = vs_vllm([rec("eagleray-champion", 30.0), rec("vllm", 60.0), rec("vllm-champion", 20.0), rec("eagleray", 30.0)])
    assert r["eagleray-champion"]["output_tok_s"]["rounds"] == [1.5] and r["eagleray"]["output_tok_s"]["rounds"] == [0.5]


def _serving(tmp_path, name, direct=None) -> dict:
    """The serving config ``bench serve`` writes for the server ``name`` (on ``direct``, serving.direct_port)."""
    import yaml

    from eagleray.jobs.bench.serve_load import _server_command

    cmd = _server_command(name, 8002, tmp_path / "model", tmp_path, 8, direct)
    return yaml.safe_load(Path(cmd[cmd.index("--config") + 1]).read_text())["applications"][0]["args"]["serving"]


def test_the_spin_server_is_the_plain_server_with_libgomps_default_workers(tmp_path):
    spin, plain = _serving(tmp_path, "eagleray-spin"), _serving(tmp_path, "eagleray")
    assert spin.pop("cpu_omp_passive") is False and "cpu_omp_passive" not in plain
    assert spin == plain and spin["draft"] is None


def test_the_2k_server_is_the_plain_server_with_vllms_cpu_prefill_budget(tmp_path):
    old, plain = _serving(tmp_path, "eagleray-2k"), _serving(tmp_path, "eagleray")
    assert old.pop("max_num_batched_tokens") == 2048 and "max_num_batched_tokens" not in plain
    assert old == plain and old["draft"] is None


def test_the_direct_server_is_the_plain_server_on_the_replicas_own_port(tmp_path):
    from eagleray.jobs.bench.serve_load import PEER

    direct, plain = _serving(tmp_path, "eagleray-direct", 8003), _serving(tmp_path, "eagleray")
    assert direct.pop("direct_port") == 8003 and "direct_port" not in plain
    assert direct == plain and direct["draft"] is None and direct["ingress"] == "engine" and PEER["eagleray-direct"] == "vllm"


def test_the_champion_direct_server_is_the_champion_server_on_the_replicas_own_port(tmp_path):
    from eagleray.jobs.bench.serve_load import MODES, PEER

    direct, champion = _serving(tmp_path, "eagleray-champion-direct", 8003), _serving(tmp_path, "eagleray-champion")
    assert direct.pop("direct_port") == 8003 and "direct_port" not in champion
    assert direct == champion and champion["draft"]["source"] != "random"
    assert PEER["eagleray-champion-direct"] == "vllm-champion" and "direct_port" in MODES["eagleray-champion-direct"]
