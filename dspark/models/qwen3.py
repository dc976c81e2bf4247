"""Qwen3 and Llama decoder models (one implementation; the differences are config flags).

Qwen3: per-head q/k RMSNorm, optional attention bias. Llama 2/3: no q/k norm, optional
`llama3` RoPE scaling. Both: RMSNorm, RoPE, GQA, SwiGLU, tied or untied embeddings, and a
head_dim that may differ from hidden_size / num_heads.

The forward pass runs on a flat ragged token stream [T]; attention metadata comes from the
forward context. It can also return the residual stream after chosen decoder layers (the
DSpark drafter's context features, HF `hidden_states[l + 1]`).

Tensor parallel (dspark/layers/parallel.py): heads and the MLP width are split across ranks,
the embedding and LM head across the vocabulary; every rank ends a layer with the same full
residual stream and gets full-vocabulary logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark.forward_context import get_forward_context
from dspark.layers.norm import RMSNorm, fused_ops
from dspark.layers.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from dspark.layers.rotary import RotaryEmbedding
from dspark.models.config import ModelConfig


class Attention(nn.Module):
    """Tensor parallel: this rank's heads (num_heads / N, num_kv_heads / N); the output
    projection all-reduces."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias, "the attention width"
        )
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding):
        ctx = get_forward_context()
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        md, norms = ctx.attn_metadata, (self.q_norm, self.k_norm) if self.qk_norm else ()
        if getattr(ctx.backend, "attends_written_kv", False) and k_cache is not None:
            # CUDA: q/k norm + RoPE with keys and values stored into the cache, one kernel
            q_rot = rotary.forward_to_cache(positions, q, k, v, md.slot_mapping, k_cache,
                                            v_cache, *norms)  # fmt: skip
            if q_rot is not None:
                out = ctx.backend.attend(q_rot, k_cache, v_cache, md, self.scale)
                return self.o_proj(out.reshape(-1, self.q_size))
        if self.qk_norm:  # one fused kernel on CUDA
            q, k = rotary.norm_forward(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = rotary(positions, q, k)
        out = ctx.backend.forward(q, k, v, k_cache, v_cache, md, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter, inter], cfg.mlp_bias, "intermediate_size"
        )
        self.inter = self.gate_up_proj.local_sizes[0]  # this rank's share
        self.down_proj = RowParallelLinear(
            inter, cfg.hidden_size, cfg.mlp_bias, "intermediate_size"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = fused_ops(gate_up)  # fused Triton kernel on CUDA
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, rotary):
        """(mlp output, residual) as the next layer takes them, and this layer's input: the sum
        hidden + residual of the pair passed in, i.e. the previous layer's output (what the
        drafter's context is built from, taken here instead of added again)."""
        hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        layer_input = residual
        hidden = self.self_attn(positions, hidden, rotary)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual, layer_input


class CausalLM(nn.Module):
    """Qwen3ForCausalLM / LlamaForCausalLM."""

    # checkpoint tensor name fragment -> (our parameter fragment, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def shard_sizes(self, param_name: str) -> list[int] | None:
        """This rank's sizes of the parts of a packed parameter."""
        if param_name.endswith("qkv_proj.weight") or param_name.endswith("qkv_proj.bias"):
            attn = self.layers[0].self_attn
            return [attn.q_size, attn.kv_size, attn.kv_size]
        if param_name.endswith("gate_up_proj.weight") or param_name.endswith("gate_up_proj.bias"):
            return list(self.layers[0].mlp.gate_up_proj.local_sizes)
        return None

    @staticmethod
    def checkpoint_name_to_param(name: str) -> str:
        # HF: model.layers.0.self_attn.q_proj.weight -> layers.0.self_attn.q_proj.weight
        return name[len("model.") :] if name.startswith("model.") else name

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        aux_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the final-normed hidden states [T, d] and, if aux_layer_ids is given, the
        concatenated outputs of those decoder layers [T, len(aux_layer_ids) * d]."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        wanted, by_layer = set(aux_layer_ids), {}
        for i, layer in enumerate(self.layers):
            hidden, residual, layer_input = layer(positions, hidden, residual, self.rotary)
            if i - 1 in wanted:  # layer i - 1's output: the residual add that starts layer i
                by_layer[i - 1] = layer_input  # made it (no add of its own: a kernel less)
        hidden, last_output = self.norm.add_forward(hidden, residual)
        if not aux_layer_ids:
            return hidden, None
        by_layer[len(self.layers) - 1] = last_output
        return hidden, torch.cat([by_layer[i] for i in aux_layer_ids], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
