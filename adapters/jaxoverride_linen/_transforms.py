"""Overrides of the neutral transforms inside bound Linen modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

OVERRIDES: dict[str, Callable[..., Any]] = {}
