"""The DSpark drafter (DeepSpec `Qwen3DSparkModel` checkpoints; DFlash = markov_rank 0).

Per decoding round and request, with anchor x0 at absolute position a (= number of context
tokens before it) and block size G:

  write_context  H_ctx = hidden_norm(fc([target layer outputs])) for each newly computed
                 target token; every drafter layer i writes k_norm(k_proj_i(H_ctx)) (RoPE at
                 the token's position) and v_proj_i(H_ctx) into its own paged cache. Done
                 once per target-computed token, never per step.
  propose        one parallel backbone pass over the block [x0, MASK x (G-1)] at positions
                 a + 0..G-1: block queries see the cached context at positions < a and every
                 key of their own block (bidirectional); block K/V never enter the cache.
                 Final norm -> h [R, G, d], base logits U_k = lm_head(h_k) for the first K
                 slots. Then a sequential loop k = 1..K (vectorized over requests) adds the
                 Markov bias B_k(x_{k-1}) to U_k, picks x_k (argmax or a seeded sample) and
                 scores the slot with the confidence head. Slot k predicts position a + k.

The embedding and LM head are the target's modules (aliased, not registered here, so they
are neither saved nor loaded twice). Tensor parallel: attention and MLP are sharded like the
target's (this rank's heads, all-reduced outputs); `fc`, the norms and the Markov and confidence
heads are small and replicated; the aliased LM head returns full-vocabulary logits.
Checkpoint names follow DeepSpec (see markov_heads.py and `expected_checkpoint_names`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.attention.base import AttentionBackend
from dspark.layers.norm import RMSNorm, fused_ops
from dspark.layers.parallel import QKVParallelLinear, RowParallelLinear
from dspark.layers.rotary import RotaryEmbedding
from dspark.models.config import parse_dtype
from dspark.models.drafter_config import (  # noqa: F401 (re-exported for callers)
    DRAFTER_ARCHITECTURES,
    DrafterConfig,
    check_compatible,
)
from dspark.models.drafter_context import LayerKVCaches, fused_context_for
from dspark.models.markov_heads import ConfidenceHead, build_markov_head
from dspark.models.qwen3 import MLP, CausalLM
from dspark.sampling import rng
from dspark.sampling.processors import GREEDY_EPS, processed_probs, sample_from_probs

logger = logging.getLogger(__name__)

# Copies of the target's tensors that DeepSpec saves with the drafter; never used here.
SHARED_TENSORS = ("embed_tokens.weight", "lm_head.weight")


# --------------------------------------------------------------------------- model


@dataclass
class DraftOutput:
    token_ids: torch.Tensor  # [R, K] int64
    probs: torch.Tensor | None  # [R, K, V] float32 at the request temperature (probabilistic)
    conf_logits: torch.Tensor | None  # [R, K] float32; c_k = sigmoid(logit)
    max_probs: torch.Tensor | None  # [R, K] float32, max of the T = 1 draft law (if asked)


class DrafterAttention(nn.Module):
    """Qwen3 attention whose keys/values are [projected context ; projected block]."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.qkv_proj = QKVParallelLinear(  # tensor parallel: this rank's heads
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias, "the attention width"
        )
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def context_kv(self, h_ctx: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding):
        # h_ctx [T, d] -> k, v [T, Hkv, D]; only the k/v rows of the packed projection.
        w = self.qkv_proj.weight[self.q_size :]
        b = None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size :]
        k, v = F.linear(h_ctx, w, b).split([self.kv_size, self.kv_size], dim=-1)
        k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
        return rotary.apply_one(positions, k), v.view(-1, self.num_kv_heads, self.head_dim)

    def forward(self, x, positions, rotary, kv_cache, ctx_lens, block_tables, max_ctx_len,
                backend: AttentionBackend):
        num_reqs, block_len = x.shape[:2]  # x [R, G, d], positions [R, G]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(num_reqs, block_len, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(num_reqs, block_len, self.num_kv_heads, self.head_dim))
        v = v.view(num_reqs, block_len, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = backend.draft_forward(
            q, k, v, kv_cache[0], kv_cache[1], ctx_lens, block_tables, max_ctx_len, self.scale
        )  # [R, G, H, D]
        return self.o_proj(out.reshape(num_reqs, block_len, self.q_size))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, *attn_args):
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class DSparkDrafter(nn.Module):
    # checkpoint name fragment -> (our packed parameter fragment, shard index). Prefixed,
    # unlike the target's, because the gated Markov head has its own `markov_head.gate_proj`.
    packed_modules = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }
    checkpoint_name_to_param = CausalLM.checkpoint_name_to_param  # same naming as the target

    def __init__(self, cfg: DrafterConfig, target: CausalLM):
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        # Aliases of the target's modules, kept out of _modules on purpose: not parameters of
        # the drafter, not in its state_dict, not moved or cast by drafter.to().
        object.__setattr__(self, "embed_tokens", target.embed_tokens)
        object.__setattr__(self, "lm_head", target.lm_head)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.markov_head = build_markov_head(
            cfg.markov_head_type or "vanilla", cfg.vocab_size, d, cfg.markov_rank
        )
        self._fused_context = None  # built on the first fused context write
        self.confidence_head = None
        if cfg.enable_confidence_head:
            extra = cfg.markov_rank if cfg.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(d + extra)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:  # this tensor-parallel rank's
        return self.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    # ---------------------------------------------------------------- context

    @torch.no_grad()
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        elem = next(self.parameters()).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def new_kv_caches(self, num_blocks: int, block_size: int, device) -> list[tuple]:
        """The drafter's paged context cache, one (K, V) pair per layer (same paging as the
        target's)."""
        shape = (self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        dtype = next(self.parameters()).dtype
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros(shape, dtype=dtype, device=device)
        return LayerKVCaches(k, v)

    def write_context(
        self,
        aux_hidden: torch.Tensor,  # [T, m*d] target layer outputs at target_layer_ids
        positions: torch.Tensor,  # [T] int64
        slot_mapping: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
    ) -> None:
        h_ctx = self.hidden_norm(self.fc(aux_hidden))  # [T, d]
        fused = fused_context_for(self, h_ctx, kv_caches)
        if fused is not None:  # every layer in one GEMM and one kernel (drafter_context.py)
            fused.write(h_ctx, positions, slot_mapping, kv_caches, self.rotary.inv_freq.float())
            return
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            k, v = layer.self_attn.context_kv(h_ctx, positions, self.rotary)
            backend.write_kv(k, v, k_cache, v_cache, slot_mapping)

    # ---------------------------------------------------------------- drafting

    @torch.no_grad()
    def propose(
        self,
        anchor_ids: torch.Tensor,  # [R] int64
        anchor_pos: torch.Tensor,  # [R] int64, = context length before the anchor
        block_tables: torch.Tensor,  # [R, max_blocks] int32
        max_ctx_len: int,  # CPU upper bound of anchor_pos
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        num_tokens: int,  # K <= block_size
        temperature: torch.Tensor,  # [R] float32
        seeds: torch.Tensor,  # [R] int64
        rounds: torch.Tensor,  # [R] int64
        sample_method: str = "greedy",  # "greedy" | "probabilistic"
        need_max_probs: bool = True,  # max of the T=1 draft law (the online estimator's input)
    ) -> DraftOutput:
        cfg = self.config
        num_reqs, block_len, k_max = anchor_ids.shape[0], cfg.block_size, num_tokens
        if not 1 <= k_max <= block_len:
            raise ValueError(f"num_tokens must be in [1, block_size={block_len}], got {k_max}")
        if sample_method not in ("greedy", "probabilistic"):
            raise ValueError(
                f"sample_method must be 'greedy' or 'probabilistic', got {sample_method!r}"
            )
        device = anchor_ids.device
        # Parallel stage: [anchor, MASK x (G-1)] at positions anchor_pos + 0..G-1.
        offsets = torch.arange(block_len, device=device)
        ids = torch.full((num_reqs, block_len), cfg.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = anchor_ids
        positions = anchor_pos.unsqueeze(1) + offsets  # [R, G]
        ctx_lens = anchor_pos.to(torch.int32)
        x = self.embed_tokens(ids)  # [R, G, d]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rotary, kv_cache, ctx_lens, block_tables, max_ctx_len,
                      backend)
        h = self.norm(x[:, :k_max])  # [R, K, d]
        base_logits = self.lm_head(h)  # [R, K, V]

        # Sequential stage: Markov bias, token choice and confidence, slot by slot.
        probabilistic = sample_method == "probabilistic"
        token_ids = torch.empty(num_reqs, k_max, dtype=torch.long, device=device)
        max_probs = None  # a full pass over the vocabulary per slot: only when asked for
        if need_max_probs:
            max_probs = torch.empty(num_reqs, k_max, dtype=torch.float32, device=device)
        probs = None
        if probabilistic:
            probs = torch.empty(num_reqs, k_max, cfg.vocab_size, dtype=torch.float32,
                                device=device)
        conf_logits = None
        if self.confidence_head is not None:
            conf_logits = torch.empty(num_reqs, k_max, dtype=torch.float32, device=device)
        head = self.markov_head
        state = None if head is None else head.init_state(num_reqs, h)
        prev = anchor_ids
        # greedy drafts without max_probs need only the argmax: one fused pass over the
        # vocabulary per slot on CUDA (layers/argmax_triton.py) instead of fp32 copies
        fused = max_probs is None and fused_ops(base_logits) is not None
        if fused and probabilistic:  # ... and sampled ones one fused softmax + draw per slot
            from dspark.sampling import softmax_sample_triton
        elif fused:
            from dspark.layers.argmax_triton import biased_argmax
        for k in range(k_max):
            h_k = h[:, k]
            prev_emb = bias = None
            if head is not None:
                prev_emb = head.prev_embedding(prev)
                bias, state = head.step(prev_emb, h_k, state)
            if conf_logits is not None:
                feats = h_k if prev_emb is None or not cfg.confidence_head_with_markov else (
                    torch.cat([h_k, prev_emb.to(h_k.dtype)], dim=-1)
                )
                conf_logits[:, k] = self.confidence_head(feats)
            if fused and probabilistic:  # (the uniform drawn in the kernel where it can)
                softmax_sample_triton.sample_draft_slot(
                    base_logits[:, k], bias, temperature, seeds, anchor_pos, k + 1, rounds,
                    rng.DRAFT, GREEDY_EPS, token_ids[:, k], probs[:, k])  # fmt: skip
                prev = token_ids[:, k]
                continue
            if fused and (bias is None or bias.dtype == base_logits.dtype):
                biased_argmax(base_logits[:, k], bias, token_ids[:, k])
                prev = token_ids[:, k]
                continue
            logits = base_logits[:, k].float()
            if bias is not None:
                logits = logits + bias.float()
            top = logits.max(dim=-1)
            if max_probs is not None:
                max_probs[:, k] = torch.exp(top.values - torch.logsumexp(logits, dim=-1))
            if probabilistic:
                p = processed_probs(logits, temperature)  # one-hot rows for T <= 1e-5
                u = rng.uniform(seeds, anchor_pos + (k + 1), rounds, rng.DRAFT)
                tok = sample_from_probs(p, u)
                probs[:, k] = p
            else:
                tok = top.indices
            token_ids[:, k] = tok
            prev = tok
        return DraftOutput(token_ids, probs, conf_logits, max_probs)

    # ---------------------------------------------------------------- loading

    def shard_sizes(self, param_name: str) -> list[int] | None:
        if param_name.endswith("qkv_proj.weight") or param_name.endswith("qkv_proj.bias"):
            attn = self.layers[0].self_attn
            return [attn.q_size, attn.kv_size, attn.kv_size]
        if param_name.endswith("gate_up_proj.weight") or param_name.endswith("gate_up_proj.bias"):
            return list(self.layers[0].mlp.gate_up_proj.local_sizes)
        return None

    def expected_checkpoint_names(self) -> list[str]:
        """Every tensor name a DeepSpec checkpoint must hold for this config (no copies)."""
        names = []
        for name, _ in self.named_parameters():
            shards = [name.replace(packed, frag) for frag, (packed, _) in
                      self.packed_modules.items() if f".{packed}." in f".{name}"]
            names.extend(shards or [name])
        return sorted(set(names))

    @classmethod
    def from_pretrained(
        cls, path: str, target: CausalLM, dtype: torch.dtype | str, device: torch.device | str,
        dummy: bool = False,
    ) -> DSparkDrafter:
        """Load a DeepSpec-layout checkpoint. `dummy`: only config.json is read and the weights
        keep their random initialisation (benchmarks on random-weight targets)."""
        from dspark.models.loader import load_weights

        cfg = DrafterConfig.from_pretrained(path)
        check_compatible(cfg, target.config, 1)
        dtype = parse_dtype(dtype)
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = cls(cfg, target)
        finally:
            torch.set_default_dtype(prev_dtype)
        if dummy:
            return model.eval().requires_grad_(False)

        found = {cls.checkpoint_name_to_param(n) for n in _checkpoint_tensor_names(path)}
        expected = set(model.expected_checkpoint_names())
        missing = sorted(expected - found)
        if missing:
            raise ValueError(f"drafter checkpoint {path!r} is missing tensor(s): {missing}")
        unexpected = sorted(found - expected - set(SHARED_TENSORS))
        if unexpected:
            raise ValueError(f"unexpected tensor(s) in drafter checkpoint {path!r}: {unexpected}")

        def shared_copy(name: str, tensor: torch.Tensor) -> bool:
            name = cls.checkpoint_name_to_param(name)
            if name not in SHARED_TENSORS:
                return False
            module = model.embed_tokens if name.startswith("embed") else model.lm_head
            ours = module.weight
            if getattr(module, "tp", None) is not None and module.tp.size > 1:
                if tensor.shape[0] == module.org_vocab_size:  # compare this rank's rows
                    tensor = module.shard_of(tensor)
            _warn_if_different(name, tensor, ours, path)
            return True

        load_weights(model, path, cls.checkpoint_name_to_param, cls.packed_modules,
                     model.shard_sizes, ignore=shared_copy)
        return model.eval().requires_grad_(False)


def _checkpoint_tensor_names(path: str) -> list[str]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    from dspark.models.loader import checkpoint_files

    names = []
    for file in checkpoint_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                names.extend(f.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"cannot read weight file {file!r}: {e}") from None
    return names


def _warn_if_different(name: str, copy: torch.Tensor, ours: torch.Tensor, path: str) -> None:
    if tuple(copy.shape) != tuple(ours.shape):
        logger.warning("drafter checkpoint %s: %s has shape %s but the target's is %s; "
                       "using the target's", path, name, tuple(copy.shape), tuple(ours.shape))
        return
    # Loose tolerance: a bf16 copy of an fp32 target is "the same" tensor.
    copy = copy.to(device=ours.device, dtype=torch.float32)
    diff = (copy - ours.detach().float()).abs()
    if not bool((diff <= 1e-3 + 1e-2 * ours.detach().float().abs()).all()):
        logger.warning("drafter checkpoint %s: %s differs from the target's (max abs diff "
                       "%.3g); using the target's", path, name, float(diff.max()))
