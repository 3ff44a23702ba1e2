"""Checks for lab 05 (see solutions/lab05_*.ipynb)."""

from __future__ import annotations

__all__: list[str] = []
