"""User-facing errors: one clear line, never a stack trace at the command line."""

from __future__ import annotations


class RelayError(Exception):
    """An error whose message is complete for a user; the CLI prints it and exits 1."""
