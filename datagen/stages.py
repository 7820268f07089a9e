"""The two model stages of the pipeline: callable classes over batches of chunk rows (Ray Data actors).

Chunk rows in (see prompts.make_chunks): chunk_id, prompt_ids, conversations, sources.
RegenerateStage adds: responses list<str>, errors list<str> (JSON error record or "").
ExtractStage writes the chunk's shard + errors part and returns one SUMMARY_SCHEMA row per chunk,
so hidden states never travel through the object store.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pyarrow as pa
import torch

from eagleray.datagen import shards
from eagleray.datagen.backends import batch_seed, make_generator
from eagleray.platform.checkpoints.target import resolve_target
from eagleray.platform.config.schemas import DatagenConfig
from eagleray.platform.host import pick_device
from eagleray.platform.prompts.template import RowError, Tokenized, prompt_ids, tokenize_with_mask

log = logging.getLogger(__name__)

REGEN_SCHEMA = pa.schema(
    [
        ("chunk_id", pa.string()),
        ("prompt_ids", pa.list_(pa.string())),
        ("conversations", pa.list_(pa.string())),
        ("sources", pa.list_(pa.string())),
        ("responses", pa.list_(pa.string())),
        ("errors", pa.list_(pa.string())),
    ]
)
SUMMARY_SCHEMA = pa.schema(
    [
        ("chunk_id", pa.string()),
        ("shard", pa.string()),
        ("rows", pa.int64()),
        ("errors", pa.int64()),
        ("tokens", pa.int64()),
        ("loss_tokens", pa.int64()),
        ("bytes", pa.int64()),
        ("seconds", pa.float64()),
    ]
)


def _error(pid: str, chunk: str, stage: str, kind: str, message: str) -> str:
    return json.dumps({"prompt_id": pid, "chunk_id": chunk, "stage": stage, "kind": kind, "message": message[:2000]})


def _device(cfg: DatagenConfig) -> str:
    return pick_device(cfg.target.device).type


def _set_threads(cfg: DatagenConfig) -> None:
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))


class RegenerateStage:
    """Generates the target's own response to every prompt of a chunk (backend: transformers/eagleray)."""

    def __init__(self, cfg_json: str):
        self.cfg = DatagenConfig.model_validate_json(cfg_json)
        _set_threads(self.cfg)
        model_dir = str(resolve_target(self.cfg.target.model, self.cfg.target.dtype))
        self.gen = make_generator(self.cfg, model_dir, _device(self.cfg))

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.Table.from_pylist([self._chunk(row) for row in batch.to_pylist()], schema=REGEN_SCHEMA)

    def _chunk(self, row: dict) -> dict:
        chunk, ids = row["chunk_id"], row["prompt_ids"]
        convs = [json.loads(c) for c in row["conversations"]]
        responses, errors = [""] * len(ids), [""] * len(ids)
        ok = []
        for i, conv in enumerate(convs):
            too_long = self.cfg.prompt_too_long(len(prompt_ids(self.gen.tokenizer, conv)))
            if too_long:
                errors[i] = _error(ids[i], chunk, "regenerate", "prompt_too_long", too_long)
            else:
                ok.append(i)
        bs = self.cfg.batch_size
        for b in range(0, len(ok), bs):
            idx = ok[b : b + bs]
            self._generate(chunk, b // bs, idx, ids, convs, responses, errors)
        return {**row, "responses": responses, "errors": errors}

    def _generate(self, chunk, batch_no, idx, ids, convs, responses, errors) -> None:
        """Generate one batch; if the batch call fails, retry row by row so only the bad rows fail."""
        seed = batch_seed(self.cfg.generation.seed, f"{chunk}:{batch_no}")
        try:
            outs = self.gen.generate([convs[i] for i in idx], self.cfg.generation, seed)
        except Exception as err:  # noqa: BLE001 - isolated below; every failure lands in the errors table
            log.warning("batch of %d in chunk %s failed (%s: %s); retrying row by row", len(idx), chunk, type(err).__name__, err)
            for i in idx:
                try:
                    responses[i] = self.gen.generate([convs[i]], self.cfg.generation, seed)[0].text
                except Exception as row_err:  # noqa: BLE001 - recorded, not dropped
                    errors[i] = _error(ids[i], chunk, "regenerate", type(row_err).__name__, str(row_err))
            return
        for i, out in zip(idx, outs):
            responses[i] = out.text


class GivenAnswersStage:
    """backend 'given': the last message of each conversation (role assistant) is the answer; nothing is generated.

    Out: the same REGEN_SCHEMA rows as RegenerateStage, with ``conversations`` cut before the answer,
    so the hidden-state stage templates prompt + answer exactly as it does for regenerated rows.
    """

    def __init__(self, cfg_json: str):
        from transformers import AutoTokenizer

        self.cfg = DatagenConfig.model_validate_json(cfg_json)
        self.tok = AutoTokenizer.from_pretrained(str(resolve_target(self.cfg.target.model, self.cfg.target.dtype)))

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.Table.from_pylist([self._chunk(row) for row in batch.to_pylist()], schema=REGEN_SCHEMA)

    def _chunk(self, row: dict) -> dict:
        chunk, ids = row["chunk_id"], row["prompt_ids"]
        convs, responses, errors = list(row["conversations"]), [""] * len(ids), [""] * len(ids)
        for i, conv in enumerate(row["conversations"]):
            msgs = json.loads(conv)
            if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
                errors[i] = _error(
                    ids[i],
                    chunk,
                    "given",
                    "no_answer",
                    "the record does not end with an assistant message (backend 'given' reads the answer from there)",
                )
                continue
            too_long = self.cfg.prompt_too_long(len(prompt_ids(self.tok, msgs[:-1])))
            if too_long:
                errors[i] = _error(ids[i], chunk, "given", "prompt_too_long", too_long)
                continue
            convs[i], responses[i] = json.dumps(msgs[:-1], ensure_ascii=False), msgs[-1]["content"]
        return {**row, "conversations": convs, "responses": responses, "errors": errors}


class ExtractStage:
    """Target forward over prompt+response capturing the aux layers; writes the chunk's shard."""

    def __init__(self, cfg_json: str, meta_json: str):
        from transformers import AutoTokenizer

        from eagleray.platform.models.llama import LlamaModel

        self.cfg = DatagenConfig.model_validate_json(cfg_json)
        self.meta = json.loads(meta_json)  # shard key-value metadata (fingerprints, layer ids, compat hash)
        _set_threads(self.cfg)
        model_dir = str(resolve_target(self.cfg.target.model, self.cfg.target.dtype))
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = LlamaModel.from_dir(
            model_dir, dtype=self.cfg.target.dtype, device=_device(self.cfg), aux_layer_ids=json.loads(self.meta["aux_layer_ids"])
        )
        self.written = 0  # shards written by this actor (fault-injection hook)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pa.Table.from_pylist([self._chunk(row) for row in batch.to_pylist()], schema=SUMMARY_SCHEMA)

    def _chunk(self, row: dict) -> dict:
        started = time.perf_counter()
        chunk, out_dir = row["chunk_id"], self.cfg.output_dir
        if shards.shard_path(out_dir, chunk).is_file():
            return self._finished(row, started)
        errors = [json.loads(e) for e in row["errors"] if e]
        todo: list[tuple[int, Tokenized]] = []
        for i, (pid, conv, resp, err) in enumerate(zip(row["prompt_ids"], row["conversations"], row["responses"], row["errors"])):
            if err:
                continue
            try:
                todo.append((i, tokenize_with_mask(self.tok, json.loads(conv), resp, self.cfg.max_seq_len)))
            except RowError as e:
                errors.append(json.loads(_error(pid, chunk, "tokenize", e.kind, str(e))))
        rows = self._forward_rows(row, todo, errors)
        if self.cfg.testing.chunk_delay_s:
            time.sleep(self.cfg.testing.chunk_delay_s)
        nbytes, shard = 0, ""
        if errors:
            shards.write_errors(shards.error_path(out_dir, chunk), errors)
        if rows:
            path = shards.shard_path(out_dir, chunk)
            nbytes = shards.write_shard(path, rows, self.meta, before_rename=self._maybe_die)
            shard = path.name
            self.written += 1
        tokens = sum(r["num_tokens"] for r in rows)
        loss = sum(sum(r["loss_mask"]) for r in rows)
        return {
            "chunk_id": chunk,
            "shard": shard,
            "rows": len(rows),
            "errors": len(errors),
            "tokens": tokens,
            "loss_tokens": loss,
            "bytes": nbytes,
            "seconds": time.perf_counter() - started,
        }

    def _finished(self, row: dict, started: float) -> dict:
        """A chunk whose shard is already written: Ray ran it again because the worker or node that finished it was
        lost before its result came back. The shard (renamed into place after the chunk's errors file) is kept as
        it is and its counts read back; rewriting it would change a file a reader may already have taken."""
        chunk, out_dir = row["chunk_id"], self.cfg.output_dir
        path = shards.shard_path(out_dir, chunk)
        errors = shards.error_path(out_dir, chunk)
        n_errors = len(errors.read_text().splitlines()) if errors.is_file() else 0
        log.info("chunk %s: its shard was already written (a retried task); kept, not rewritten", chunk)
        counts = shards.finished_counts(path)
        return {"chunk_id": chunk, "shard": path.name, "errors": n_errors, **counts, "seconds": time.perf_counter() - started}

    def _forward_rows(self, row: dict, todo: list[tuple[int, Tokenized]], errors: list[dict]) -> list[dict]:
        """Pack rows into forwards of <= forward_tokens tokens; a failing pack is retried row by row."""
        out, pack, budget = [], [], self.cfg.forward_tokens
        for item in todo + [None]:
            if item is not None and (not pack or sum(len(t.input_ids) for _, t in pack) + len(item[1].input_ids) <= budget):
                pack.append(item)
                continue
            try:
                out.extend(self._rows_of(row, pack))
            except Exception as err:  # noqa: BLE001 - isolated row by row; failures are recorded
                log.warning("forward of %d rows failed (%s); retrying row by row", len(pack), err)
                for one in pack:
                    try:
                        out.extend(self._rows_of(row, [one]))
                    except Exception as row_err:  # noqa: BLE001 - recorded, not dropped
                        errors.append(
                            json.loads(
                                _error(
                                    row["prompt_ids"][one[0]],
                                    row["chunk_id"],
                                    "hidden_states",
                                    type(row_err).__name__,
                                    str(row_err),
                                )
                            )
                        )
            pack = [item] if item is not None else []
        return out

    @torch.inference_mode()
    def _rows_of(self, row: dict, pack: list[tuple[int, Tokenized]]) -> list[dict]:
        from eagleray.platform.models.attention import AttentionMetadata

        if not pack:
            return []
        lens = [len(t.input_ids) for _, t in pack]
        dev = self.model.norm.weight.device
        ids = torch.tensor([x for _, t in pack for x in t.input_ids], device=dev)  # [sum T]
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])  # [sum T]
        final, aux = self.model(ids, pos, AttentionMetadata.build(lens), None)  # [sum T, H], [sum T, n_aux*H]
        out, start = [], 0
        for (i, t), n in zip(pack, lens):
            out.append(
                {
                    "prompt_id": row["prompt_ids"][i],
                    "source": row["sources"][i],
                    "response": row["responses"][i],
                    "num_tokens": n,
                    "truncated": t.truncated,
                    "input_ids": t.input_ids,
                    "loss_mask": t.loss_mask,
                    "aux_hidden": shards.encode_bf16(aux[start : start + n]),
                    "final_hidden": shards.encode_bf16(final[start : start + n]),
                }
            )
            start += n
        return out

    def _maybe_die(self, tmp: Path) -> None:
        """Testing hook: SIGKILL this worker once, mid-write (tmp written, not yet renamed)."""
        after = self.cfg.testing.kill_extract_worker_after_shards
        if after is None or self.written < after:
            return
        self.cfg.testing.kill_once(self.cfg.output_dir, f"before renaming {tmp.name}")
