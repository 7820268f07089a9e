"""Regeneration alone, in one process, to a JSONL of conversations that end with the target's answer.

For machines that have a GPU but no Ray cluster, or for splitting a datagen run into its two
halves: regenerate the answers where decoding is fast (``eagleray regenerate``), then compute
hidden states where the data will be trained (``eagleray datagen`` with ``backend: given``, or
online training, which reads the same file).

Output ``<out>`` (JSONL, one object per prompt, appended batch by batch so a killed run resumes):
``{"prompt_id": <id of the prompt>, "source": str, "messages": [...prompt, {"role": "assistant",
"content": <answer>}], "num_tokens": <generated tokens, the end-of-turn token included when reached>}``.
Prompts that cannot be regenerated go to ``<out>.errors.jsonl`` (prompt_id, kind, message), never
dropped; a batch whose generate() call fails stops the run with its error and writes nothing for
that batch (rerun to resume). ``<out>.manifest.json`` records the target and tokenizer fingerprints, the generation
settings and the counts; ``backend: given`` checks the fingerprints against its own target.

``--prompts-only`` writes the selected prompts (after turn splitting, dedup, hold-out, shuffle,
limit and the prompt-length cap) as messages JSONL without generating, so a machine without the
prompt packages can regenerate them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagleray.datagen.backends import batch_seed, make_generator
from eagleray.datagen.chunks import select_prompts
from eagleray.platform.checkpoints.target import TargetSpec, resolve_target
from eagleray.platform.config.schemas import DatagenConfig
from eagleray.platform.errors import ConfigError, EaglerayError, Problem
from eagleray.platform.prompts import PromptRecord
from eagleray.platform.prompts.template import prompt_ids

MANIFEST_SUFFIX, ERRORS_SUFFIX = ".manifest.json", ".errors.jsonl"
PROVENANCE_KEYS = ("target_fingerprint", "backend", "device", "target", "generation", "rows", "this_run")


def manifest_path(out: str | Path) -> Path:
    return Path(f"{out}{MANIFEST_SUFFIX}")


def errors_path(out: str | Path) -> Path:
    return Path(f"{out}{ERRORS_SUFFIX}")


@dataclass
class Selected:
    """Prompts to regenerate (with their prompt token counts) and those refused for length."""

    todo: list[tuple[PromptRecord, int]]
    too_long: list[tuple[PromptRecord, int]]
    written: set[str]  # prompt ids already in the output (resume)
    failed: set[str]  # prompt ids already in the errors file

    @property
    def done(self) -> int:
        return len(self.written | self.failed)


def _read_ids(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    ids = set()
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                ids.add(json.loads(line)["prompt_id"])
            except (json.JSONDecodeError, KeyError) as err:
                raise EaglerayError(
                    f"{path}:{n}: not a regenerate output line ({err})\n"
                    f"    fix: remove the broken line (a run killed mid-write leaves at most the last one) "
                    f"or write to a new --out"
                ) from err
    return ids


def select(cfg: DatagenConfig, tok, out: Path | None) -> Selected:
    """The run's prompts minus those already written to ``out``, split by the prompt-length cap."""
    records, _ = select_prompts(cfg)
    written, failed = (_read_ids(out), _read_ids(errors_path(out))) if out is not None else (set(), set())
    todo, too_long = [], []
    for rec in records:
        if rec.prompt_id in written or rec.prompt_id in failed:
            continue
        n = len(prompt_ids(tok, [m.to_dict() for m in rec.messages]))
        (todo if n <= cfg.prompt_token_cap else too_long).append((rec, n))
    return Selected(todo, too_long, written, failed)


def write_prompts(cfg: DatagenConfig, out: Path, emit: Callable[[str], None] = print) -> dict[str, int]:
    """``--prompts-only``: the prompts of the run (length cap applied) as messages JSONL."""
    from transformers import AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    if cfg.answer_turns == "all":  # whole conversations; only their system and user turns are needed
        records, stats = select_prompts(cfg)
        records = [r for r in records if any(m.role == "user" for m in r.messages)]
        with out.open("w", encoding="utf-8") as fh:
            for rec in records:
                msgs = [m.to_dict() for m in rec.messages if m.role != "assistant"]
                fh.write(json.dumps({"messages": msgs}, ensure_ascii=False) + "\n")
        turns = sum(m.role == "user" for r in records for m in r.messages)
        emit(
            f"wrote {len(records)} conversations ({turns} user turns) to {out} "
            f"({stats.duplicates} duplicates and {stats.held_out} held-out conversations left out)"
        )
        return {"prompts": len(records), "turns": turns, "duplicates": stats.duplicates, "held_out": stats.held_out}
    tok = AutoTokenizer.from_pretrained(str(resolve_target(cfg.target.model, cfg.target.dtype)))
    sel = select(cfg, tok, None)
    with out.open("w", encoding="utf-8") as fh:
        for rec, _ in sel.todo:
            fh.write(json.dumps({"messages": [m.to_dict() for m in rec.messages]}, ensure_ascii=False) + "\n")
    counts = {"prompts": len(sel.todo), "too_long": len(sel.too_long)}
    emit(f"wrote {counts['prompts']} prompts to {out} ({counts['too_long']} longer than the prompt cap left out)")
    return counts


def _append_too_long(cfg: DatagenConfig, out: Path, rows: list[tuple[PromptRecord, int]]) -> None:
    with errors_path(out).open("a", encoding="utf-8") as fh:
        for rec, n in rows:
            fh.write(
                json.dumps(
                    {
                        "prompt_id": rec.prompt_id,
                        "source": rec.source,
                        "kind": "prompt_too_long",
                        "message": cfg.prompt_too_long(n),
                    }
                )
                + "\n"
            )


def regenerate(cfg: DatagenConfig, out: Path, device: str, emit: Callable[[str], None] = print) -> dict[str, Any]:
    """Regenerate every selected prompt's answer into ``out`` (resumable); returns the manifest."""
    from tqdm import tqdm

    if cfg.backend not in ("eagleray", "transformers"):
        raise EaglerayError(
            f"backend: {cfg.backend!r} cannot regenerate in one process\n"
            f"    fix: use backend 'transformers' or 'eagleray' (vLLM runs inside `eagleray datagen`)"
        )
    model_dir = str(resolve_target(cfg.target.model, cfg.target.dtype))
    spec = TargetSpec.from_dir(model_dir)
    gen = make_generator(cfg, model_dir, device)
    sel = select(cfg, gen.tokenizer, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _append_too_long(cfg, out, sel.too_long)
    emit(
        f"regenerate: {len(sel.todo)} prompts to run, {sel.done} already done, {len(sel.too_long)} too long "
        f"(recorded in {errors_path(out).name}); backend {cfg.backend} on {device}"
    )
    order = sorted(sel.todo, key=lambda x: x[1])  # similar lengths together: less padding per batch
    started, tokens, rows = time.perf_counter(), 0, 0
    bar = tqdm(total=len(order), unit="prompt", desc="regenerate", mininterval=cfg.progress_seconds)
    with out.open("a", encoding="utf-8") as fh:
        for b in range(0, len(order), cfg.batch_size):
            batch = [rec for rec, _ in order[b : b + cfg.batch_size]]
            outs = gen.generate(
                [[m.to_dict() for m in r.messages] for r in batch],
                cfg.generation,
                batch_seed(cfg.generation.seed, batch[0].prompt_id),
            )
            for rec, g in zip(batch, outs):
                msgs = [m.to_dict() for m in rec.messages] + [{"role": "assistant", "content": g.text}]
                fh.write(
                    json.dumps(
                        {"prompt_id": rec.prompt_id, "source": rec.source, "messages": msgs, "num_tokens": g.num_tokens},
                        ensure_ascii=False,
                    )
                    + "\n"
                )
                tokens += g.num_tokens
            fh.flush()
            rows += len(batch)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens / max(1e-9, time.perf_counter() - started):.0f}")
    bar.close()
    seconds = time.perf_counter() - started
    manifest = {
        **_provenance(cfg, spec, device),
        "rows": len(sel.written) + rows,
        "errors": len(sel.failed) + len(sel.too_long),
        "this_run": {"rows": rows, "generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / max(1e-9, seconds)},
    }
    manifest_path(out).write_text(json.dumps(manifest, indent=2))
    emit(
        f"regenerate: {rows} answers, {tokens} tokens in {seconds:.1f} s ({manifest['this_run']['tokens_per_s']:.0f} tokens/s); "
        f"{manifest['rows']} rows and {manifest['errors']} errors in {out}"
    )
    return manifest


def _provenance(cfg: DatagenConfig, spec: TargetSpec, device: str) -> dict[str, Any]:
    """How the answers were made (the manifest's head): what ``backend: given`` checks, and the settings."""
    return {
        "target_fingerprint": spec.fingerprint,
        "tokenizer_fingerprint": spec.tokenizer_fingerprint,
        "target": cfg.target.model_dump(),
        "backend": cfg.backend,
        "device": device,
        "generation": cfg.generation.model_dump(),
        "max_prompt_tokens": cfg.prompt_token_cap,
    }


def shard_of(prompt_id: str, num_shards: int) -> int:
    """The shard (0..num_shards-1) a prompt id belongs to: a content hash, so every process agrees."""
    return int(prompt_id[:8], 16) % num_shards


def regenerate_conversations(
    cfg: DatagenConfig, out: Path, device: str, emit: Callable[[str], None] = print, shard: tuple[int, int] = (0, 1)
) -> dict[str, Any]:
    """``answer_turns: all``: every user turn of every selected conversation, in order, answered on the target's
    own history (:mod:`eagleray.datagen.turns`), into ``out`` (one line per conversation; resumable). ``shard``
    (i, n): this process takes the conversations whose id hashes to i of n (several processes, one GPU or many)."""
    from tqdm import tqdm

    from eagleray.datagen.backends import EagleRayGenerator
    from eagleray.datagen.turns import TurnByTurn

    index, num_shards = shard
    model_dir = str(resolve_target(cfg.target.model, cfg.target.dtype))
    spec = TargetSpec.from_dir(model_dir)
    records, stats = select_prompts(cfg)
    done = _read_ids(out) | _read_ids(errors_path(out))
    mine = [r for r in records if shard_of(r.prompt_id, num_shards) == index]
    todo = [r for r in mine if r.prompt_id not in done]
    gen = EagleRayGenerator(cfg, model_dir, device)
    out.parent.mkdir(parents=True, exist_ok=True)
    emit(
        f"regenerate (every turn, own history): {len(todo)} conversations to run, {len(mine) - len(todo)} already done "
        f"(shard {index}/{num_shards}; {stats.duplicates} duplicate and {stats.held_out} held-out conversations left out); "
        f"{cfg.batch_size} in flight on {device}"
    )
    bar = tqdm(
        total=sum(1 for r in todo for m in r.messages if m.role == "user"),
        unit="turn",
        desc="regenerate",
        mininterval=cfg.progress_seconds,
    )
    try:
        with out.open("a", encoding="utf-8") as fh, errors_path(out).open("a", encoding="utf-8") as eh:

            def progress(st) -> None:
                done = st.answered + st.errors
                if done > bar.n:
                    bar.set_postfix(tok_s=f"{st.generated_tokens / max(st.seconds, 1e-9):.0f}", refresh=False)
                    bar.update(done - bar.n)  # tqdm prints at most every progress_seconds

            run = TurnByTurn(
                gen.engine,
                cfg.generation,
                cfg.prompt_token_cap,
                concurrency=cfg.batch_size,
                on_done=lambda conv: _append_line(fh, conv.to_row()),  # whole lines: a killed run resumes cleanly
                on_error=lambda e: _append_line(eh, e.__dict__),
                progress=progress,
            )
            st = run.run(todo)
    finally:
        bar.close()
        gen.close()
    manifest = {
        **_provenance(cfg, spec, device),
        "answer_turns": "all",
        "shard": [index, num_shards],
        "selection": {"conversations_read": stats.records, "duplicates": stats.duplicates, "held_out": stats.held_out},
        **count_output(out, {r.prompt_id: sum(m.role == "user" for m in r.messages) for r in mine}),
        "this_run": {**st.to_dict(), "tokens_per_s": st.generated_tokens / max(1e-9, st.seconds)},
    }
    manifest_path(out).write_text(json.dumps(manifest, indent=2))
    emit(
        f"regenerate: {st.answered} turns answered, {st.errors} errors, {st.truncated} truncated, {st.generated_tokens} tokens "
        f"in {st.seconds:.1f} s ({manifest['this_run']['tokens_per_s']:.0f} tokens/s); in {out}: {manifest['turns_in']} turns = "
        f"{manifest['answered']} answered + {manifest['errors']} errors, {manifest['lost']} lost, {manifest['duplicated']} duplicated"
    )
    return manifest


def _append_line(fh, obj: dict) -> None:
    fh.write(json.dumps(obj, ensure_ascii=False) + "\n")
    fh.flush()


def count_output(out: Path, expected: dict[str, int]) -> dict[str, int]:
    """Read a conversation-mode output back (its files, not the run's counters) against ``expected`` (conversation
    id -> its user turns): turns_in, answered, errors, truncated, lost (turns neither answered nor recorded as
    errors) and duplicated (turns written more than once)."""
    answered: dict[str, int] = {}
    truncated = duplicated = 0
    if out.is_file():
        with out.open(encoding="utf-8") as fh:
            for line in fh:
                row = json.loads(line)
                if row["prompt_id"] in answered:
                    duplicated += len(row["num_tokens"])
                    continue
                answered[row["prompt_id"]] = len(row["num_tokens"])
                truncated += row["truncated_turns"]
    errors: set[tuple[str, int]] = set()
    if errors_path(out).is_file():
        with errors_path(out).open(encoding="utf-8") as fh:
            errors = {(e["prompt_id"], e["turn"]) for e in map(json.loads, fh)}
    turns_in = sum(expected.values())
    got = sum(min(n, expected[pid]) for pid, n in answered.items() if pid in expected)
    failed = sum(1 for pid, turn in errors if pid in expected and answered.get(pid, 0) <= turn < expected[pid])
    return {
        "conversations": len(expected),
        "turns_in": turns_in,
        "answered": got,
        "errors": failed,
        "truncated": truncated,
        "lost": turns_in - got - failed,
        "duplicated": duplicated,
    }


def check_given_sources(cfg: DatagenConfig, spec: TargetSpec, emit: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """backend 'given': answers written by ``eagleray regenerate`` must come from this very target.

    A source with a ``<file>.manifest.json`` is checked (target and tokenizer fingerprints); a source
    without one cannot be checked, and the run says so (training on another model's answers teaches
    the draft the wrong distribution, silently). Returns, per source, what its manifest says of how the
    answers were made (``None`` fields where there is no manifest), for the datagen manifest.
    """
    problems, found = [], []
    for i, src in enumerate(cfg.prompts):
        path = manifest_path(src)
        if not path.is_file():
            found.append({"source": src, "manifest": None})
            emit(
                f"warning: prompts[{i}] {src} has no {path.name}: cannot check that its answers were generated by "
                f"this target ({spec.fingerprint}); write them with `eagleray regenerate` to have them checked"
            )
            continue
        m = json.loads(path.read_text())
        found.append({"source": src, "manifest": str(path), **{k: m.get(k) for k in PROVENANCE_KEYS}})
        for key, want in (("target_fingerprint", spec.fingerprint), ("tokenizer_fingerprint", spec.tokenizer_fingerprint)):
            if m.get(key) != want:
                problems.append(
                    Problem(
                        f"prompts[{i}]",
                        f"{src}: its answers were generated with {key} {m.get(key)} "
                        f"but target.model {cfg.target.model!r} has {want}",
                        "regenerate the answers with this target, or set target.model to the one that wrote them",
                    )
                )
    if problems:
        raise ConfigError(problems)
    emit(f"given answers: {len(cfg.prompts)} source(s); every manifest present matches target {spec.fingerprint}")
    return found
