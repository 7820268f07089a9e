"""Prompt loaders: ShareGPT, MT-bench, HumanEval and JSONL/Parquet/JSON files, as one record type."""

from eagleray.platform.prompts.records import Message, PromptRecord, dedup, make_record, prompt_id_for, prompt_turns
from eagleray.platform.prompts.report import LoadReport
from eagleray.platform.prompts.sources import BUILTIN_SOURCES, LoadResult, iter_prompts, load_prompts

__all__ = [
    "BUILTIN_SOURCES",
    "LoadReport",
    "LoadResult",
    "Message",
    "PromptRecord",
    "dedup",
    "iter_prompts",
    "load_prompts",
    "make_record",
    "prompt_id_for",
    "prompt_turns",
]
