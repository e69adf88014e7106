"""Side-by-side measurements; ``benchmarks.training:synthetic_dataset`` is importable from here."""
