"""Prompt stage: sources -> one prompt per assistant turn -> dedup -> hold-out -> shuffle/limit -> chunks.

A *chunk* is the unit of work and of resume: ``rows_per_shard`` prompts that become one Parquet
shard. Its id is a hash of the run's compatibility hash and its sorted prompt ids, so a retried
task rewrites the same file and never adds a second copy of a prompt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from eagleray.platform.config.schemas import DatagenConfig
from eagleray.platform.prompts import PromptRecord, iter_prompts, prompt_turns

log = logging.getLogger(__name__)

HOLDOUT_SOURCES = ("mtbench", "humaneval")
_WS = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Lower-case, whitespace-collapsed text used to match held-out prompts."""
    return _WS.sub(" ", text).strip().lower()


@dataclass
class PromptStats:
    """What the prompt stage read, split, dropped and kept."""

    records: int = 0  # conversations read from the sources
    turns: int = 0  # prompts after turn splitting
    duplicates: int = 0
    held_out: int = 0
    kept: int = 0
    per_source: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class HoldOut:
    """Prompt ids and normalised user texts of the evaluation sets."""

    ids: frozenset[str]
    texts: frozenset[str]

    @classmethod
    def load(cls, sources: Iterable[str] = HOLDOUT_SOURCES) -> "HoldOut":
        ids, texts = set(), set()
        for src in sources:
            for rec in iter_prompts(src, mtbench_turns="separate" if src == "mtbench" else None):
                ids.add(rec.prompt_id)
                ids.update(t.prompt_id for t in prompt_turns(rec))
                texts.update(normalise(m.content) for m in rec.messages if m.role == "user")
        return cls(frozenset(ids), frozenset(texts))

    def matches(self, rec: PromptRecord) -> bool:
        if rec.prompt_id in self.ids:
            return True
        return any(m.role == "user" and normalise(m.content) in self.texts for m in rec.messages)


def select_prompts(cfg: DatagenConfig, holdout: HoldOut | None = None) -> tuple[list[PromptRecord], PromptStats]:
    """The prompts of a run, in run order: split, deduplicated by id, held out, shuffled, limited."""
    stats = PromptStats()
    if cfg.hold_out_eval and holdout is None:
        holdout = HoldOut.load()
    seen: set[str] = set()
    out: list[PromptRecord] = []
    for src in cfg.prompts:
        for rec in iter_prompts(src):
            stats.records += 1
            for turn in prompt_turns(rec) if cfg.split_turns else [rec]:
                stats.turns += 1
                if turn.prompt_id in seen:
                    stats.duplicates += 1
                    continue
                seen.add(turn.prompt_id)
                if holdout is not None and holdout.matches(turn):
                    stats.held_out += 1
                    continue
                out.append(turn)
                stats.per_source[src] = stats.per_source.get(src, 0) + 1
    if cfg.shuffle_seed is not None:
        random.Random(cfg.shuffle_seed).shuffle(out)
    if cfg.limit is not None:
        out = out[: cfg.limit]
    stats.kept = len(out)
    return out, stats


def chunk_id_for(compat_hash: str, prompt_ids: Iterable[str]) -> str:
    """Content-derived chunk (shard) id: same prompts + same run settings -> same id."""
    h = hashlib.sha256(compat_hash.encode())
    for pid in sorted(prompt_ids):
        h.update(pid.encode())
    return h.hexdigest()[:20]


def make_chunks(records: list[PromptRecord], rows_per_shard: int, compat_hash: str) -> list[dict]:
    """Chunk rows (the input of the Ray Data pipeline).

    Schema: chunk_id str, prompt_ids list<str>, conversations list<str> (JSON OpenAI messages),
    sources list<str>.
    """
    chunks = []
    for start in range(0, len(records), rows_per_shard):
        part = records[start : start + rows_per_shard]
        ids = [r.prompt_id for r in part]
        chunks.append(
            {
                "chunk_id": chunk_id_for(compat_hash, ids),
                "prompt_ids": ids,
                "conversations": [json.dumps([m.to_dict() for m in r.messages], ensure_ascii=False) for r in part],
                "sources": [r.source for r in part],
            }
        )
    return chunks
