"""Real Ray Serve on 127.0.0.1 at tensor_parallel_size=2 (gloo, CPU): rank 1 is a Ray actor in the
replica's STRICT_PACK placement group, and the greedy chat answer equals the engine's TP=1 answer."""

from __future__ import annotations

import pytest
import torch

from eagleray.serve.serving_config import ServingConfig

KEY = "test-key"
CTX = 128
PROMPT = "Explain tensor parallelism"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def peaked_target(tiny_target, tmp_path_factory):
    """The tiny target with 2-D weights x6: peaked logits, so TP's different reduction order cannot flip an argmax."""
    from eagleray.tests.support.tiny import scaled_copy

    return scaled_copy(tiny_target, tmp_path_factory.mktemp("tp2") / "target")


@pytest.fixture(scope="module")
def tp1_answer(peaked_target) -> str:
    """The plain engine's greedy chat answer at TP=1, computed in-process."""
    from eagleray.platform.config.schemas import TargetConfig
    from eagleray.serve.engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine.from_config(
        EngineConfig(target=TargetConfig(model=str(peaked_target), device="cpu", max_model_len=CTX), max_num_seqs=2)
    )
    messages = [{"role": "user", "content": PROMPT}]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    out = engine.generate([list(ids["input_ids"])], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    engine.close()
    assert len(out.token_ids) == MAX_TOKENS and out.text.strip()  # a real answer to compare, not an empty string
    return out.text


@pytest.fixture(scope="module")
def server(peaked_target):
    from eagleray.serve.local import start_local
    from eagleray.tests.support.cluster import stop_local_ray

    cfg = ServingConfig.model_validate(
        {
            "target": {"model": str(peaked_target), "device": "cpu", "max_model_len": CTX, "tensor_parallel_size": 2},
            "draft": {"source": "random", "num_speculative_tokens": 3},
            "model_name": "tiny",
            "api_key": KEY,
            "max_num_seqs": 4,
        }
    )
    try:
        url = start_local(cfg, num_cpus=2, timeout_s=120)
        yield url, cfg
    finally:
        stop_local_ray()


def test_tp2_serve_matches_tp1_and_workers_are_placed_actors(server, tp1_answer):
    import ray
    from ray import serve

    from eagleray.serve.local import chat

    url, cfg = server
    text, ext = chat(url, PROMPT, cfg, max_tokens=MAX_TOKENS)
    assert text == tp1_answer and ext["draft_version"] == "random"
    streamed, _ = chat(url, PROMPT, cfg, max_tokens=MAX_TOKENS, stream=True)
    assert streamed == tp1_answer

    info = serve.get_deployment_handle("EagleRayEngine", app_name="eagleray").info.remote().result(timeout_s=60)
    tp = info["tensor_parallel"]
    assert tp["backend"] == "ray" and tp["world"] == 2 and [r["rank"] for r in tp["ranks"]] == [1]
    pg = ray.util.placement_group_table()[tp["placement_group"]]
    assert pg["strategy"] == "STRICT_PACK" and pg["state"] == "CREATED" and len(pg["bundles"]) == 2
    worker = tp["ranks"][0]
    assert worker["placement_group"] == tp["placement_group"]  # the actor runs inside the deployment's group
    actor = ray._private.state.actors(actor_id=worker["actor_id"])
    assert actor["State"] == "ALIVE" and actor["ActorClassName"].endswith("RankActor") and actor["Pid"] == worker["pid"]
