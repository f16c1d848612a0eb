"""benchmarks/gpu_check.py's parts: records.py (the JSONL files and summary.md), training.py (one
training case, fivefold's or a plain loop's), correct.py (the correct stage), speed.py (the speed stage)."""
