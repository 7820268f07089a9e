"""Drafts in the MLflow model registry (:mod:`.client`) and the one draft-source resolver (:mod:`.source`)."""

from eagleray.platform.registry.client import (
    DraftVersion,
    configure,
    default_tracking_uri,
    download_draft,
    find_draft_dir,
    get_alias,
    get_version,
    is_registry_uri,
    lookup,
    register_directory,
    register_draft,
    set_alias,
)
from eagleray.platform.registry.source import ResolvedDraft, registry_version, resolve_draft

__all__ = [
    "DraftVersion",
    "ResolvedDraft",
    "configure",
    "default_tracking_uri",
    "download_draft",
    "find_draft_dir",
    "get_alias",
    "get_version",
    "is_registry_uri",
    "lookup",
    "register_directory",
    "register_draft",
    "registry_version",
    "resolve_draft",
    "set_alias",
]
