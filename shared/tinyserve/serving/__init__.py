"""Serving over HTTP: the OpenAI-compatible server, a load-generating client, a
router over replicas, and replay of an arrival trace against the engine."""
