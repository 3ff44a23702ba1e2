"""Checks for lab 06 (see solutions/lab06_*.ipynb)."""

from __future__ import annotations

__all__: list[str] = []
