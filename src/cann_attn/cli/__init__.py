"""Command-line tools: ``cann-attn verify | golden | compare | bench`` (entry point ``cann_attn.cli.main:main``)."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad command-line usage: ``main`` prints one line and exits with status 2."""
