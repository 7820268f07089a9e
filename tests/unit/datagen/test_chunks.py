"""Prompt stage: turn splitting, dedup, MT-bench/HumanEval hold-out, shuffle/limit, chunk ids."""

import json

from eagleray.datagen.chunks import HoldOut, chunk_id_for, make_chunks, normalise, select_prompts
from eagleray.platform.config.schemas import DatagenConfig
from eagleray.platform.prompts import iter_prompts


def _write(path, convs):
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return str(path)


def _u(text):
    return {"role": "user", "content": text}


def _a(text):
    return {"role": "assistant", "content": text}


def test_split_dedup_holdout(tmp_path):
    mt = next(iter_prompts("mtbench")).messages[0].content
    src = _write(
        tmp_path / "p.jsonl",
        [
            [_u("q1"), _a("a1"), _u("q2"), _a("a2")],  # two prompts
            [_u("q1")],  # duplicate of the first turn above
            [_u("  " + mt.upper() + " ")],  # MT-bench text, differently spaced/cased
            [_u("q3")],
        ],
    )
    recs, stats = select_prompts(DatagenConfig(prompts=[src], output_dir=str(tmp_path)))
    assert [[m.content for m in r.messages] for r in recs] == [["q1"], ["q1", "a1", "q2"], ["q3"]]
    assert (stats.records, stats.turns, stats.duplicates, stats.held_out, stats.kept) == (4, 5, 1, 1, 3)


def test_holdout_matches_ids_and_text():
    h = HoldOut.load()
    rec = next(iter_prompts("humaneval"))
    assert h.matches(rec) and normalise(rec.messages[0].content) in h.texts


def test_shuffle_and_limit_are_seeded(tmp_path):
    src = _write(tmp_path / "p.jsonl", [[_u(f"q{i}")] for i in range(10)])
    cfg = DatagenConfig(prompts=[src], output_dir=str(tmp_path), shuffle_seed=3, limit=4, hold_out_eval=False)
    a, _ = select_prompts(cfg)
    b, _ = select_prompts(cfg)
    assert [r.prompt_id for r in a] == [r.prompt_id for r in b] and len(a) == 4
    assert [r.messages[0].content for r in a] != [f"q{i}" for i in range(4)]


def test_chunk_ids_depend_on_content_only(tmp_path):
    assert chunk_id_for("h", ["b", "a"]) == chunk_id_for("h", ["a", "b"]) != chunk_id_for("h2", ["a", "b"])
    src = _write(tmp_path / "p.jsonl", [[_u(f"q{i}")] for i in range(5)])
    recs, _ = select_prompts(DatagenConfig(prompts=[src], output_dir=str(tmp_path), hold_out_eval=False))
    chunks = make_chunks(recs, 2, "h")
    assert [len(c["prompt_ids"]) for c in chunks] == [2, 2, 1]
    assert json.loads(chunks[0]["conversations"][0]) == [_u("q0")]
