"""Errors of the sweep, all in the K2EdgeError family."""

from __future__ import annotations

from ..errors import K2EdgeError


class SweepError(K2EdgeError):
    """A sweep cannot start or continue: bad grid, mismatched --resume, unwritable output."""


class NoRecommendation(SweepError):
    """Nothing meets the goal or constraints; the measurements were still written."""
