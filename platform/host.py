"""This machine: which torch device to run on, and a free TCP port."""

from __future__ import annotations

import socket

import torch

from eagleray.platform.errors import EaglerayError


def pick_device(device: str = "auto", field: str = "target.device") -> torch.device:
    """'auto' -> CUDA when visible, else CPU; 'cuda' without a visible GPU is an error naming ``field``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise EaglerayError(f"{field}='cuda' but no CUDA device is visible\n    fix: set {field} to 'cpu' or 'auto'")
    return torch.device(device)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it; another process may still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
