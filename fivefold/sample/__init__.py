"""Text from a trained model in one process: `generate()` (generate.py) and `fivefold sample` (cli.py)."""
