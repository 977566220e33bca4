"""Semantic versions (semver.org 2.0.0): parsing and precedence, for anti-rollback."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import total_ordering

__all__ = ["Version", "parse_version"]

# semver.org's recommended regular expression (numbers without leading zeros).
_SEMVER = re.compile(
    r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(?:-((?:0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?\Z"
)


@total_ordering
@dataclass(frozen=True, eq=False)
class Version:
    """A parsed version. Ordering and equality follow semver precedence: build metadata is ignored,
    a pre-release sorts before its release, numeric identifiers numerically, below alphanumeric ones."""

    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    build: str = ""

    def _key(self):
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.prerelease)
        # a release (no pre-release) outranks every pre-release of the same numbers
        return (self.major, self.minor, self.patch, 1 if not pre else 0, pre)

    def __eq__(self, other):
        return isinstance(other, Version) and self._key() == other._key()

    def __lt__(self, other):
        if not isinstance(other, Version):
            return NotImplemented
        return self._key() < other._key()

    def __hash__(self):
        return hash(self._key())

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        return text + (f"+{self.build}" if self.build else "")


def parse_version(text: str) -> Version:
    """Parse ``MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD]``.

    Raises:
        ValueError: not a semantic version (the message shows the expected form).
    """
    m = _SEMVER.match(text) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"must be a semantic version such as 1.2.0 or 1.3.0-rc.1, got {text!r}")
    major, minor, patch, pre, build = m.groups()
    return Version(int(major), int(minor), int(patch), tuple(pre.split(".")) if pre else (), build or "")
