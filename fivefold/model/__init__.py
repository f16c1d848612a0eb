"""The parallel-free model: the ground floor, importing nothing of fivefold outside this folder.

- config.py       ModelConfig, the [model] section: the network's shape, nothing about its split
- presets.py      named shapes from published model cards, and their published parameter counts
- transformer.py  the Llama-style decoder (dense and MoE) with injected attention and dispatch
- attention.py    grouped-query and multi-head latent attention, RoPE
- masks.py        packed documents kept apart: masks and per-document positions, built per micro-batch
- seeded_init.py  every parameter a pure function of (seed, name, row block): any layout, same weights
- counts.py       parameters and FLOPs by formula, split the way the parallel code splits them
"""
