"""A chunk that Ray runs again after losing the worker or node that finished it (its result never came back):
the shard already written is kept as it is, and the same counts are reported (tests/integration/test_node_loss.py
saw a finished shard rewritten after a node loss)."""

import json

import pyarrow as pa

from eagleray.datagen import shards
from eagleray.datagen.stages import ExtractStage
from eagleray.platform.checkpoints.target import TargetSpec
from eagleray.platform.config.schemas import DatagenConfig
from eagleray.tests.support.datagen import datagen_config


def test_a_chunk_run_again_keeps_its_shard_and_reports_the_same_counts(tiny_target, prompt_file, tmp_path):
    cfg = DatagenConfig(**datagen_config(tiny_target, prompt_file, tmp_path / "out"))
    spec = TargetSpec.from_dir(tiny_target)
    meta = {
        "compat_hash": "test",
        "aux_layer_ids": json.dumps(list(spec.default_aux_layer_ids)),
        "target_fingerprint": spec.fingerprint,
        "tokenizer_fingerprint": spec.tokenizer_fingerprint,
        "hidden_size": str(spec.hidden_size),
        "encoding": "bf16-le-rowmajor",
    }
    stage = ExtractStage(cfg.model_dump_json(), json.dumps(meta))
    conv = json.dumps([{"role": "user", "content": "hello there, how are you today?"}])
    row = {
        "chunk_id": "c0",
        "prompt_ids": ["p0", "p1", "p2"],
        "conversations": [conv, conv, conv],
        "sources": ["test", "test", "test"],
        "responses": ["fine, thanks", "very well", ""],
        "errors": ["", "", json.dumps({"prompt_id": "p2", "chunk_id": "c0", "stage": "regenerate", "kind": "k", "message": "m"})],
    }
    batch = pa.Table.from_pylist([row])
    first = stage(batch).to_pylist()[0]
    path = shards.shard_path(cfg.output_dir, "c0")
    written = path.stat().st_mtime_ns
    again = stage(batch).to_pylist()[0]
    assert path.stat().st_mtime_ns == written, "a finished shard is never rewritten"
    first.pop("seconds"), again.pop("seconds")
    assert again == first and first["rows"] == 2 and first["errors"] == 1 and first["tokens"] > 0 < first["loss_tokens"]
