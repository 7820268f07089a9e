"""What a loader did: records yielded, what it skipped and why, whether the file was cut short."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class LoadReport:
    """Filled in while a loader runs; nothing a loader drops goes uncounted.

    ``truncated_at_byte`` is the byte offset where the incomplete last record starts (everything
    from there to ``file_bytes`` was dropped); ``file_bytes`` is where the file ends, i.e. where it
    was cut.
    """

    source: str
    items: int = 0  # complete input items read (lines, rows, array items)
    records: int = 0  # records yielded
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> count of dropped inputs
    role_aliases: Counter[str] = field(default_factory=Counter)  # "bing->assistant" -> messages mapped
    truncated_at_byte: int | None = None
    file_bytes: int | None = None
    stopped_at_limit: bool = False  # the limit was reached; reading stopped there
    seconds: float = 0.0

    @property
    def truncated(self) -> bool:
        """True when the input ended inside a record (the partial record was dropped)."""
        return self.truncated_at_byte is not None

    def skip(self, reason: str) -> None:
        """Count one input dropped for ``reason``."""
        self.skipped[reason] += 1

    def summary(self) -> str:
        """One line for logs and CLIs."""
        parts = [f"{self.source}: {self.records} record(s) from {self.items} item(s) in {self.seconds:.1f}s"]
        if self.skipped:
            parts.append("skipped " + ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())))
        if self.role_aliases:
            parts.append("roles mapped " + ", ".join(f"{k}={v}" for k, v in sorted(self.role_aliases.items())))
        if self.truncated:
            parts.append(f"input truncated at byte {self.file_bytes}: partial record from byte {self.truncated_at_byte} dropped")
        if self.stopped_at_limit:
            parts.append("stopped at limit")
        return "; ".join(parts)
