"""A Llama-style decoder (dense and mixture-of-experts), free of any parallelism.

Pre-norm blocks: h = x + Attention(RMSNorm(x)); out = h + FFN(RMSNorm(h)) (or post-norm and sandwich
blocks, model.norm.position: Block), where FFN is SwiGLU (GeGLU: model.activation) or
a top-k routed mixture of SwiGLU experts (optionally group-limited, DeepSeek-V3). Attention
(model/attention.py) is grouped-query, or multi-head latent when model.latent.kv_lora_rank > 0, with RoPE
applied at explicit token positions, so context parallel can hand each rank its true positions.

What the parallel code relies on (and why this file imports nothing from torch.distributed):
- blocks live in an nn.ModuleDict keyed "0".."L-1": a pipeline stage deletes the ones it does not
  own and the remaining names (and checkpoint keys) stay the same;
- embedding, final norm and head may be None: forward passes through whatever is absent;
- head counts are read from shapes (view(B, T, -1, head_dim)), so a tensor-parallel rank holding
  H/tp heads needs no change here;
- the attention core and the MoE dispatch are attributes holding callables; context parallel swaps
  in ring attention, expert parallel swaps in an all-to-all dispatch (latent attention has one
  more, `enter_heads`, where tensor parallel's region begins);
- the micro-batch's document ids (model/masks.py) are an argument of forward, handed through every
  block to its attention, which adds its window and sinks: the modules keep no per-batch state.

Shapes: B batch, T sequence, H query heads, K key/value heads, D head_dim, E experts, V vocabulary.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.model.attention import RMSNorm, attention, rms_norm
from fivefold.model.config import ModelConfig
from fivefold.model.ffn import FeedForward
from fivefold.model.head import OutputHead
from fivefold.model.masks import DocumentIds
from fivefold.model.moe import MoE
from fivefold.model.rope import layer_is_local, rope_cos_sin
from fivefold.model.seeded_init import init_tensor


def _optional(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


class Block(nn.Module):
    """One block, its norms where model.norm.position puts them, for each sub-layer f (attention, then
    the FFN): "pre" x + f(attn_norm(x)); "post" x + attn_post_norm(f(x)) (OLMo 2: no norm before);
    "sandwich" x + attn_post_norm(f(attn_norm(x))) (Gemma 3); ffn_norm / ffn_post_norm alike."""

    def __init__(self, cfg: ModelConfig, layer: int, head_dim: int):
        super().__init__()
        before, after = cfg.norm.position in ("pre", "sandwich"), cfg.norm.position in ("post", "sandwich")
        self.attn_norm = rms_norm(cfg.norm, cfg.dim) if before else None
        self.attn = attention(cfg, head_dim, layer)
        self.attn_post_norm = rms_norm(cfg.norm, cfg.dim) if after else None
        self.ffn_norm = rms_norm(cfg.norm, cfg.dim) if before else None
        routed = cfg.moe.n_experts > 0 and layer >= cfg.moe.first_dense_layers
        self.ffn = (MoE(cfg.moe, cfg.dim, cfg.ffn_dim, cfg.activation) if routed
                    else FeedForward(cfg.dim, cfg.ffn_dim, cfg.activation))
        self.ffn_post_norm = rms_norm(cfg.norm, cfg.dim) if after else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc: DocumentIds | torch.Tensor | None = None) -> torch.Tensor:
        h = x + _optional(self.attn_post_norm, self.attn(_optional(self.attn_norm, x), cos, sin, doc))  # (B, T, dim)
        return h + _optional(self.ffn_post_norm, self.ffn(_optional(self.ffn_norm, h)))


class MTPLayer(nn.Module):
    """One depth of multi-token prediction (DeepSeek-V3 sec. 2.2): from the depth before's hidden
    states h (B, T, dim) (the main model's, for the first) and the embeddings e of the tokens one
    further ahead, h' = norm(Block(eh_proj([enorm(e); hnorm(h)]))), which the shared head turns into
    logits for the token after those. The concatenation puts the embedding first and h is taken
    after its final norm, as the released checkpoints are served (vLLM's and Megatron-LM's MTP);
    `norm` is the checkpoints' shared_head.norm."""

    def __init__(self, cfg: ModelConfig, layer: int, head_dim: int):
        super().__init__()
        self.enorm, self.hnorm = rms_norm(cfg.norm, cfg.dim), rms_norm(cfg.norm, cfg.dim)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg, layer, head_dim)
        self.norm = rms_norm(cfg.norm, cfg.dim)

    def forward(self, h: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc: DocumentIds | torch.Tensor | None = None) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1))  # (B, T, 2 dim) -> (B, T, dim)
        return self.norm(self.block(x, cos, sin, doc))  # (B, T, dim)


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, V); a pipeline stage without embedding takes hidden states."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be resolved (> 0) before building the model")
        self.cfg = cfg
        self.head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        # MLA ropes a part of each head only
        self.rope_dim = cfg.latent.qk_rope_head_dim if cfg.latent.kv_lora_rank else self.head_dim
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, self.head_dim) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = rms_norm(cfg.norm, cfg.dim)
        self.output: OutputHead | None = OutputHead(cfg.dim, cfg.vocab_size)
        # model.mtp_layers depths of multi-token prediction, numbered after the blocks (their layer
        # index picks window and rotation as a block's does); training only, on the last stage
        self.mtp = nn.ModuleDict({str(k): MTPLayer(cfg, cfg.n_layers + k, self.head_dim)
                                  for k in range(cfg.mtp_layers)})
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, seed: int = 0) -> None:
        """Every parameter's seeded initial values (model/seeded_init.py): the same numbers any layout's
        ranks draw for their slices, here drawn whole."""
        for name, p in self.named_parameters():
            init_tensor(name, p, self.cfg, seed)

    def blocks(self) -> list[Block]:
        """Every block this model holds, the MTP depths' included: what each dimension splits."""
        return [*self.layers.values(), *(layer.block for layer in self.mtp.values())]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> embeddings (B, T, dim), times sqrt(dim) with model.embed_scale (Gemma; the
        factor cast to the embeddings' dtype first, as transformers' Gemma3TextScaledWordEmbedding does)."""
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        if self.cfg.embed_scale:
            # a 0-dim CPU tensor: a scalar to any device's kernel, no copy to the device
            h = h * torch.tensor(self.cfg.dim ** 0.5).to(h.dtype)
        return h

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, layers: Iterable[str] | None = None,
                embed: bool = True, head: bool = True, logits: bool = True,
                doc: DocumentIds | torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V), or a part of that for one pipeline stage.

        positions: RoPE positions (T,), or (B, T) per row (documents restarting at 0); default 0..T-1.
        layers: the names of the blocks to run, in order (default: every block this model holds);
        embed=False: x is already hidden states (B, T, dim); head=False: return the last block's
        output (B, T, dim) without the final norm and head; logits=False: after the final norm, without
        the head (the loss applies it: OutputHead, chunk by chunk). An absent embedding, norm or head (a
        pipeline stage deleted it) is passed through. Each block gets the rotation of its layer
        (model/rope.py: sliding-window layers may have their own base). doc: None, or the (B, T) document ids of whole
        rows (data.document_mask, model/masks.py; DocumentIds when a host copy comes along), passed
        as an argument so the blocks hold no per-batch state.
        """
        h = self.embed(x) if embed and self.tok_embeddings is not None else x  # (B, T, dim)
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)  # (T,)
        names = list(self.layers if layers is None else layers)
        local = {name: self._is_local(int(name)) for name in names}  # local or global base
        # Each distinct rotation once per forward: (cos, sin), each (T, D) or (B, T, D).
        rotations = {kind: rope_cos_sin(positions, self.rope_dim, self.cfg.rope, kind) for kind in set(local.values())}
        for name in names:
            h = self.layers[name](h, *rotations[local[name]], doc)
        if head and self.norm is not None:
            h = self.norm(h)
        if head and logits and self.output is not None:
            h = self.output(h)  # (B, T, V)
        return h

    def _is_local(self, layer: int) -> bool:
        return layer_is_local(self.cfg.rope, self.cfg.attention.layer_window(layer))

    def predict_ahead(self, h: torch.Tensor, tokens: list[torch.Tensor], positions: torch.Tensor,
                      doc: DocumentIds | torch.Tensor | None = None) -> list[torch.Tensor]:
        """The MTP depths' hidden states, each (B, T, dim) after its norm: depth k (0-based) from the
        depth before's (h: the main model's after its final norm) and the embeddings of tokens[k],
        the ids k + 1 ahead (model/mtp.py shifts them), at the same positions and documents."""
        outs = []
        for k, layer in self.mtp.items():
            cos, sin = rope_cos_sin(positions, self.rope_dim, self.cfg.rope, self._is_local(self.cfg.n_layers + int(k)))
            h = layer(h, self.embed(tokens[int(k)]), cos, sin, doc)  # (B, T, dim)
            outs.append(h)
        return outs


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token losses over whole logits; targets of -100 (padding) count nothing. The
    plain reference the tests and benchmarks compare with: training's loss is the head's own
    (model/head.py), which never holds the whole micro-batch's logits.

    The caller divides by the step's global token count, so every token weighs the same however
    the batch is split into micro-batches, ranks and padded sequences.
    """
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=-100, reduction="sum")


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
