"""The data layer: documents in (sources.py), tokenizers (tokenizer.py), prepared datasets written once
(prepare.py, `fivefold prepare`) and read by memory map (tokens.py), what the [data] section names and
its checks (resolve.py), mixtures (mixture.py). Batching per rank is data/batches.py."""
