"""Per-request sampling parameters (vLLM spelling). Invalid values raise ValueError naming
the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        def num(name, value, lo=None, hi=None, lo_open=False):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if math.isnan(value) or math.isinf(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
            if lo is not None and (value <= lo if lo_open else value < lo):
                raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
            if hi is not None and value > hi:
                raise ValueError(f"{name} must be <= {hi}, got {value}")

        num("temperature", self.temperature, 0.0)
        num("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        num("min_p", self.min_p, 0.0, 1.0)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
                raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            if not -(2**63) <= self.seed < 2**63:
                raise ValueError("seed must fit in 64 bits")
        stop = self.stop
        if stop is None:
            stops = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stops = list(stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stop_list = stops
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {ids!r}")
        self.stop_token_ids = list(ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-5
