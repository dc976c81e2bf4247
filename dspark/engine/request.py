"""Request state. One counter rule drives everything:

    num_computed_tokens catches up with num_tokens (+ pending draft slots).

A prefill chunk, a decode token and a verify block are all "tokens to compute". After a
verify step the counter advances over the anchor and the accepted drafts only; rejected drafts
are rolled back simply by not counting them (their KV slots get overwritten later).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from dspark.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        # identity tests only: hot (several times per request and step), and hashing an Enum
        # member runs Python code
        return self is not RequestStatus.WAITING and self is not RequestStatus.RUNNING


@dataclass
class SpecStats:
    """Speculative-decoding counters of one request (or aggregated over many)."""

    num_steps: int = 0  # decoding rounds that had drafts available
    num_drafted_tokens: int = 0  # drafts proposed
    num_verified_tokens: int = 0  # drafts sent to the target (drafted - trimmed)
    num_accepted_tokens: int = 0  # drafts accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # rounds accepting >= pos+1
    verified_per_pos: list[int] = field(default_factory=list)  # rounds verifying >= pos+1
    # rounds in which slot pos was verified with every earlier draft accepted (it was "tested")
    reached_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_verified: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_drafted_tokens += num_drafted
        self.num_verified_tokens += num_verified
        self.num_accepted_tokens += num_accepted
        need = max(num_drafted, len(self.verified_per_pos))
        for lst in (self.accepted_per_pos, self.verified_per_pos, self.reached_per_pos):
            lst.extend([0] * (need - len(lst)))
        for j in range(num_verified):
            self.verified_per_pos[j] += 1
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1
        for j in range(min(num_accepted + 1, num_verified)):
            self.reached_per_pos[j] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_steps += other.num_steps
        self.num_drafted_tokens += other.num_drafted_tokens
        self.num_verified_tokens += other.num_verified_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        need = max(len(self.verified_per_pos), len(other.verified_per_pos))
        for mine, theirs in (
            (self.accepted_per_pos, other.accepted_per_pos),
            (self.verified_per_pos, other.verified_per_pos),
            (self.reached_per_pos, other.reached_per_pos),
        ):
            mine.extend([0] * (need - len(mine)))
            for j, v in enumerate(theirs):
                mine[j] += v

    def as_dict(self) -> dict:
        steps = max(self.num_steps, 1)
        # conditional acceptance at pos j: P(slot j accepted | slot j verified and every
        # earlier draft accepted); unconditional: P(at least j+1 drafts accepted) per round
        cond = [
            a / n if n else None for a, n in zip(self.accepted_per_pos, self.reached_per_pos)
        ]
        return {
            "num_steps": self.num_steps,
            "num_drafted_tokens": self.num_drafted_tokens,
            "num_verified_tokens": self.num_verified_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_trimmed_tokens": self.num_drafted_tokens - self.num_verified_tokens,
            "num_rejected_tokens": self.num_verified_tokens - self.num_accepted_tokens,
            "mean_acceptance_length": (
                (self.num_accepted_tokens + self.num_steps) / steps if self.num_steps else None
            ),
            "acceptance_per_position": [a / steps for a in self.accepted_per_pos]
            if self.num_steps
            else [],
            "conditional_acceptance_per_position": cond,
        }


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: list[int],
        seed: int,
        prompt: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + committed outputs
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids or [])
        self.seed = seed
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        # sampled by a step still in flight (async scheduling): counted in num_tokens, the
        # values are on the device until that step is committed (0 or 1)
        self.num_pending = 0
        self.max_total_tokens = 1 << 62  # set by the engine: the length at which it finishes
        self.num_cached_tokens = 0  # prefix-cache hit at the last admission
        self.num_preemptions = 0
        self.has_drafts = False  # drafts for the next verify live on the device
        self.slot: int = -1  # row in the runner's persistent per-request device buffers
        self.round = 0  # decoding rounds so far (an RNG key)
        self.stale_conf: np.ndarray | None = None  # confidences of an earlier round (host)
        self.spec = SpecStats()
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.output_text = ""  # detokenized text of the outputs (maintained incrementally)
        self.prefix_offset = 0  # output index where the detokenizer's decode window starts
        self.read_offset = 0  # output tokens already turned into output_text

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, pending ones included (token_ids holds the committed)."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
