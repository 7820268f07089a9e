"""The Ray Data pipeline on a tiny target: errors table, exactly-once under a killed worker, resume,
hidden states equal to transformers', vocab counts, backends and the disk-space refusal."""

import json
import os
from collections import Counter

import pyarrow.parquet as pq
import pytest
import torch

from eagleray.datagen import manifest as mf
from eagleray.datagen import shards
from eagleray.datagen.pipeline import dry_run, run_datagen
from eagleray.platform.config.schemas import DatagenConfig
from eagleray.platform.errors import EaglerayError
from eagleray.tests.support.datagen import datagen_config, expected_ids

from .conftest import LONG_PROMPT  # noqa: TID252


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def first_run(ray_local, tiny_target, prompt_file, tmp_path_factory):
    """One run whose hidden-state worker SIGKILLs itself mid-write after its first shard."""
    out = tmp_path_factory.mktemp("dg") / "out"
    cfg = datagen_config(tiny_target, prompt_file, out, testing={"kill_extract_worker_after_shards": 1})
    lines: list[str] = []
    manifest = run_datagen(DatagenConfig(**cfg), emit=lines.append)
    return cfg, out, manifest, lines


def _ids_everywhere(out) -> Counter:
    return Counter(shards.written_ids(out)) + Counter(e["prompt_id"] for e in shards.read_errors(out))


def test_killed_worker_loses_nothing_and_duplicates_nothing(first_run):
    cfg, out, manifest, _ = first_run
    assert (out / ".test-worker-killed").is_file(), "the fault-injection hook did not fire"
    seen = _ids_everywhere(out)
    assert set(seen) == expected_ids(cfg) and max(seen.values()) == 1
    assert not list((out / "shards").glob(".tmp-*"))


def test_errors_table_records_the_failing_row(first_run):
    _, out, manifest, _ = first_run
    errs = pq.read_table(out / mf.ERRORS_TABLE).to_pylist()
    assert len(errs) == manifest["errors"] == 1
    assert errs[0]["kind"] == "prompt_too_long" and errs[0]["stage"] == "regenerate"
    assert "max_prompt_tokens 96" in errs[0]["message"]


def test_manifest_and_vocab_counts(first_run, tiny_target):
    from eagleray.platform.checkpoints.target import TargetSpec

    _, out, manifest, lines = first_run
    spec = TargetSpec.from_dir(tiny_target)
    assert manifest["rows"] == 20 and manifest["target_fingerprint"] == spec.fingerprint
    assert manifest["aux_layer_ids"] == spec.default_aux_layer_ids and manifest["dtype"] == "bf16"
    assert manifest["shards"] == len(shards.shard_files(out))
    counts = mf.read_vocab_counts(str(out))
    assert counts.shape == (spec.vocab_size,) and int(counts.sum()) == manifest["loss_tokens"] > 0
    assert any(line.startswith("progress:") and "rows/s" in line and "ETA" in line for line in lines)
    assert any(line.startswith("estimate: output") for line in lines)
    assert json.loads((out / mf.MANIFEST).read_text())["dataset_id"] == manifest["dataset_id"]


def test_hidden_states_match_transformers(first_run, tiny_target):
    from transformers import AutoModelForCausalLM

    _, out, manifest, _ = first_run
    row = next(shards.iter_rows(out))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(row["input_ids"][None], output_hidden_states=True).hidden_states  # (N+1) x [1, T, H]
    ids = manifest["aux_layer_ids"]
    want = torch.cat([hs[i][0] for i in ids], dim=-1)  # [T, n_aux*H]; hs[N] is after the norm in HF
    assert ids[-1] < len(hs) - 1
    torch.testing.assert_close(row["aux_hidden"].float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(row["final_hidden"].float(), hs[-1][0], atol=2e-2, rtol=2e-2)


def test_rerun_resumes_only_missing_shards(first_run):
    cfg, out, _, _ = first_run
    files = shards.shard_files(out)
    gone = files[0]
    n_gone = pq.read_metadata(gone).num_rows
    kept = {p: p.stat().st_mtime_ns for p in files[1:]}
    gone.unlink()
    lines: list[str] = []
    manifest = run_datagen(DatagenConfig(**cfg), emit=lines.append)
    assert manifest["run"]["rows"] == n_gone and manifest["run"]["errors"] == 0
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items()), "finished shards were rewritten"
    seen = _ids_everywhere(out)
    assert set(seen) == expected_ids(cfg) and max(seen.values()) == 1
    assert any(f"{len(seen) - n_gone} already done, {n_gone} to run" in line for line in lines)


def test_rerun_with_other_settings_is_refused(first_run):
    cfg, out, _, _ = first_run
    with pytest.raises(EaglerayError, match="differs in: generation"):
        dry_run(DatagenConfig(**{**cfg, "generation": {"max_tokens": 9}}), emit=lambda s: None)


def test_not_enough_space_refuses_with_numbers(tiny_target, prompt_file, tmp_path):
    cfg = DatagenConfig(**datagen_config(tiny_target, prompt_file, tmp_path / "o", disk_headroom=1e15))
    with pytest.raises(EaglerayError, match=r"not enough space .* estimated .* free"):
        dry_run(cfg, emit=lambda s: None)


def test_draft_needs_the_eagleray_backend(tiny_target, prompt_file, tmp_path):
    from eagleray.datagen.backends import make_generator

    cfg = DatagenConfig(**datagen_config(tiny_target, prompt_file, tmp_path / "o", draft={"source": "random"}))
    with pytest.raises(EaglerayError, match=r"(?s)draft is set but backend is 'transformers'.*backend: eagleray"):
        make_generator(cfg, str(tiny_target), "cpu")


def test_vllm_processor_config_builds(tiny_target, prompt_file, tmp_path):
    from eagleray.datagen.backends import vllm_processor_config

    cfg = DatagenConfig(**datagen_config(tiny_target, prompt_file, tmp_path / "o", backend="vllm"))
    pc = vllm_processor_config(cfg, str(tiny_target))
    assert pc.model_source == str(tiny_target) and pc.engine_kwargs["enforce_eager"] is True
    assert pc.runtime_env["env_vars"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert LONG_PROMPT and os.path.isdir(tiny_target)
