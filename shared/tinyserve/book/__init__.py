"""What the notebooks need beyond the engine: figures (``plots``), interactive
explorers (``widgets``), executing notebooks (``notebooks``), the batching demo,
and the tools that built the shipped tokenizer and ``tiny-zh`` weights."""
