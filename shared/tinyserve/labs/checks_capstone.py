"""Checks for lab 07 (see solutions/lab07_*.ipynb)."""

from __future__ import annotations

__all__: list[str] = []
