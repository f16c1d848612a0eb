"""The parallel-free model: the ground floor, importing nothing of fivefold outside this folder.

- config.py       ModelConfig, the [model] section: the network's shape, nothing about its split
- presets.py      named shapes from published model cards, and their published parameter counts
- transformer.py  the decoder: blocks of attention and a feed-forward, embedding, head, MTP depths
- head.py         the output head and its cross-entropy, a chunk of tokens' logits at a time
- mtp.py          multi-token prediction's inputs and targets, shifted within rows and documents
- ffn.py          the dense feed-forward (gated: SwiGLU)
- moe.py          mixture of experts: routing, stacked experts, the local dispatch (expert parallel swaps it)
- attention.py    grouped-query and multi-head latent attention, RoPE, and which kernel attends
- masks.py        what a query may see (documents, sliding windows, sinks), as data per micro-batch
- blockwise.py    exact masked attention in tiles through kernels that return their log-sum-exp
- flex.py         masked attention through FlexAttention (CUDA)
- seeded_init.py  every parameter a pure function of (seed, name, row block): any layout, same weights
- counts.py       parameters and FLOPs by formula, split the way the parallel code splits them
- mask_counts.py  the (query, key) pairs and tiles a mask keeps, for the FLOPs
"""
