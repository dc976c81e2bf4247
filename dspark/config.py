"""Validated engine and speculative-decoding configuration (vLLM spelling of the keys)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

_POLICIES = ("lagged", "early_stop", "threshold", "fixed")


def env_switch(name: str) -> bool:
    """An on-by-default DSPARK_* switch: off when set to 0, false, off or no (any case)."""
    return os.environ.get(name, "1").lower() not in ("0", "false", "off", "no")


def parse_speculative_json(text: str) -> dict:
    """The value of a --speculative-config flag: a JSON object (ValueError otherwise)."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config must be a JSON object")
    return spec


@dataclass
class SpeculativeConfig:
    model: str
    method: str = "dspark"
    num_speculative_tokens: int = 7
    draft_sample_method: str = "probabilistic"  # "greedy" | "probabilistic"
    rejection_sample_method: str = "standard"  # "standard" | "block"
    enable_adaptive_verification: bool = False
    adaptive_policy: str | None = None  # "lagged" | "early_stop" | "threshold" | "fixed"
    cost_table_path: str | None = None
    min_predicted_gain: float = 0.04
    confidence_source: str = "auto"  # "auto" | "head" | "online"
    confidence_calibration_path: str | None = None
    confidence_threshold: float = 0.5
    snap_budget_to_graphs: bool = False
    # learn the non-trimmable per-step cost (host work, sampling, ...) from measured step
    # times; applies to tables profiled on this machine (start-up or `dspark profile`)
    online_cost_correction: bool = True
    # lagged policy: skip drafting entirely while no verify length would pay for the drafter
    draft_skipping: bool = True
    # ... and while drafting, run 12 steps without it now and then to measure plain steps
    # (without them plain decoding is priced with the speculative steps' fixed term, which in
    # a server also holds what only they pay: drafting never stopped at c = 128 on the 8B
    # shape, 20% below no speculation; spec/drafting.py, BENCHMARKS.md twelfth session)
    plain_probes: bool = True
    # ... and while drafting is off, skip the drafter's context write on plain decode steps,
    # rebuilding a request's missing context (the target run again over those tokens) before
    # it drafts again (spec/context_gaps.py). Off by default: on an H100 it brought the trained
    # 33.6 M pair's plain steps to no speculation's device time, but its eager rebuilds before
    # every draft probe cost more end to end (BENCHMARKS.md, fifty-first session)
    skip_idle_context_write: bool = False
    # benchmarking only (NOT lossless): with rejection_sample_method "synthetic", draft j is
    # accepted with probability synthetic_acceptance_rates[j] given the earlier ones were
    synthetic_acceptance_rates: list[float] | None = None

    def __post_init__(self):
        if self.method not in ("dspark", "dflash"):
            raise ValueError(f"speculative_config.method must be 'dspark', got {self.method!r}")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config.model must be the path of a drafter checkpoint")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be >= 1, got {k!r}")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(
                "speculative_config.draft_sample_method must be 'greedy' or 'probabilistic', "
                f"got {self.draft_sample_method!r}"
            )
        if self.rejection_sample_method not in ("standard", "block", "synthetic"):
            raise ValueError(
                "speculative_config.rejection_sample_method must be 'standard', 'block' or "
                f"'synthetic' (benchmarks only), got {self.rejection_sample_method!r}"
            )
        rates = self.synthetic_acceptance_rates
        if self.rejection_sample_method == "synthetic":
            k = self.num_speculative_tokens
            if (
                not isinstance(rates, (list, tuple))
                or len(rates) < k
                or not all(isinstance(r, (int, float)) and 0 <= r <= 1 for r in rates)
            ):
                raise ValueError(
                    "speculative_config.synthetic_acceptance_rates must list at least "
                    f"num_speculative_tokens={k} probabilities in [0, 1]"
                )
        elif rates is not None:
            raise ValueError(
                "speculative_config.synthetic_acceptance_rates needs "
                "rejection_sample_method 'synthetic'"
            )
        if self.adaptive_policy is None:
            self.adaptive_policy = "lagged" if self.enable_adaptive_verification else "fixed"
        if self.adaptive_policy not in _POLICIES:
            raise ValueError(
                f"speculative_config.adaptive_policy must be one of {_POLICIES}, "
                f"got {self.adaptive_policy!r}"
            )
        if self.confidence_source not in ("auto", "head", "online"):
            raise ValueError(
                "speculative_config.confidence_source must be 'auto', 'head' or 'online', "
                f"got {self.confidence_source!r}"
            )
        if not 0.0 <= float(self.min_predicted_gain) < 10:
            raise ValueError("speculative_config.min_predicted_gain must be in [0, 10)")
        if not 0.0 <= float(self.confidence_threshold) <= 1.0:
            raise ValueError("speculative_config.confidence_threshold must be in [0, 1]")

    @property
    def is_adaptive(self) -> bool:
        return self.adaptive_policy != "fixed"

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError("speculative_config must be a dict")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}")
        if "model" not in d:
            raise ValueError("speculative_config.model (the drafter checkpoint path) is required")
        return cls(**d)


# the step's token budget when none is given; with speculation, every row's K draft slots
# are added to it (EngineConfig.__post_init__)
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    # None: DEFAULT_MAX_NUM_BATCHED_TOKENS, plus max_num_seqs * K with speculation (verify
    # rows take 1 + K tokens each: at 256 rows and K = 7 they alone filled 2048, and a new
    # prompt was admitted only in what finishing rows freed)
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None  # override the computed cache size
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_gb: float = 0.25
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"
    enforce_eager: bool = False
    # schedule step N+1 while step N runs on the device (speculative engines: after steps
    # that verify and draft nothing; see schedules_ahead)
    async_scheduling: bool = True
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights, benchmarks)
    tensor_parallel_size: int = 1  # processes (GPUs) the model is sharded over
    speculative_config: SpeculativeConfig | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.max_num_batched_tokens is None and isinstance(self.max_num_seqs, int):
            sc = self.speculative_config
            drafts = 0 if sc is None else self.max_num_seqs * sc.num_speculative_tokens
            self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS + drafts
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "tensor_parallel_size"):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError("gpu_memory_utilization must be in [0.05, 0.99]")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError("load_format must be 'auto' or 'dummy'")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("attention_backend must be 'auto', 'torch' or 'triton'")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")


def schedules_ahead(config: EngineConfig) -> bool:
    """Whether an engine schedules a step before the previous one is committed (async
    scheduling): one process (speculative engines schedule ahead after steps that verify and
    draft nothing). The model runner then feeds pending tokens on the device."""
    return config.async_scheduling and config.tensor_parallel_size == 1
