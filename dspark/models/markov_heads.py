"""DSpark's sequential heads: the Markov transition bias and the confidence head.

Names and shapes follow DeepSpec (`deepspec/modeling/dspark/markov_head.py`), so checkpoint
tensors load one-to-one:

    markov_head.markov_w1.weight  [V, r]       W1, an embedding of the previous token
    markov_head.markov_w2.weight  [V, r]       W2, Linear(r -> V), no bias
    markov_head.gate_proj.{weight [r, d+r], bias [r]}         gated only
    markov_head.joint_proj.{weight [3r, 2r+d], bias [3r]}     rnn only
    confidence_head.proj.{weight [1, d(+r)], bias [1]}

Bias of slot k given the previous token x_{k-1} (the anchor for k = 1) and the backbone
hidden h_k:
    vanilla  B_k = W2 W1[x_{k-1}]
    gated    B_k = W2 (g_k * W1[x_{k-1}]),  g_k = sigmoid(gate_proj([h_k ; W1[x_{k-1}]]))
    rnn      [g ; c ; o] = joint_proj([s_{k-1} ; W1[x_{k-1}] ; h_k]),  s_0 = 0
             s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c),  B_k = W2 tanh(o)
Confidence logit of slot k: proj([h_k ; W1[x_{k-1}]]) (or proj(h_k) without the Markov input);
c_k = sigmoid(logit) is the survival of slot k given that slots < k were accepted.
"""

from __future__ import annotations

import torch
from torch import nn

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


class VanillaMarkovHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def init_state(self, num_reqs: int, ref: torch.Tensor) -> torch.Tensor | None:
        return None

    def prev_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:  # [R] -> [R, r]
        return self.markov_w1(prev_ids)

    def step(
        self,
        prev_emb: torch.Tensor,  # [R, r] W1[x_{k-1}]
        hidden: torch.Tensor,  # [R, d] h_k
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # bias [R, V], new state
        return self.markov_w2(prev_emb), state


class GatedMarkovHead(VanillaMarkovHead):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__(vocab_size, hidden_size, rank)
        self.gate_proj = nn.Linear(hidden_size + rank, rank, bias=True)

    def step(self, prev_emb, hidden, state):
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1)))
        return self.markov_w2(gate * prev_emb), state


class RNNMarkovHead(VanillaMarkovHead):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__(vocab_size, hidden_size, rank)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank, bias=True)

    def init_state(self, num_reqs: int, ref: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_reqs, self.rank, dtype=ref.dtype, device=ref.device)

    def step(self, prev_emb, hidden, state):
        proj = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1))
        gate, cand, out = proj.chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state


_HEADS = {"vanilla": VanillaMarkovHead, "gated": GatedMarkovHead, "rnn": RNNMarkovHead}


def build_markov_head(
    head_type: str, vocab_size: int, hidden_size: int, rank: int
) -> VanillaMarkovHead | None:
    """None for rank 0 (a DFlash-style drafter: base logits only)."""
    if rank == 0:
        return None
    return _HEADS[head_type](vocab_size, hidden_size, rank)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [R, F] -> [R] float32 logits
        return self.proj(features).squeeze(-1).float()
