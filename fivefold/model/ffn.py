"""The dense feed-forward block and the gated activations it shares with the experts (model/moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GPT_OSS_ALPHA = 1.702  # gpt-oss's SwiGLU: gate * sigmoid(1.702 gate), the sigmoid approximation of GELU


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", limit: float = 0.0) -> torch.Tensor:
    """The gated unit act(gate) * up of a GLU feed-forward (Shazeer 2020), elementwise on (..., hidden).

    "silu": SwiGLU (Llama, Qwen, Mistral, DeepSeek); "gelu_tanh": GeGLU with the tanh approximation of
    GELU (Gemma). limit > 0: gpt-oss's clamped form, gate clamped above at limit and up to [-limit, limit],
    then gate sigmoid(1.702 gate) (up + 1) (gpt-oss model card, 2025).
    """
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return gate * torch.sigmoid(GPT_OSS_ALPHA * gate) * (up + 1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


class FeedForward(nn.Module):
    """A gated feed-forward: down(act(gate(x)) * up(x)), SwiGLU or GeGLU (`gated`)."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.activation = activation
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gated(self.gate(x), self.up(x), self.activation))
