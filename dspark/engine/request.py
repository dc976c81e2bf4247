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


def _bump(hist: list[int], i: int, by: int = 1) -> None:
    if i >= len(hist):
        hist.extend([0] * (i + 1 - len(hist)))
    hist[i] += by


def _tail_counts(hist: list[int], width: int) -> list[int]:
    """[rounds whose count exceeds j for j in 0..width-1] from a histogram of counts."""
    out, above = [0] * width, 0
    for j in range(len(hist) - 1, 0, -1):  # above = rounds with count >= j
        above += hist[j]
        if j - 1 < width:
            out[j - 1] = above
    return out


def _add(hist: list[int], counts) -> None:
    if len(counts) > len(hist):
        hist.extend([0] * (len(counts) - len(hist)))
    for i, c in enumerate(counts):
        hist[i] += int(c)


@dataclass
class SpecStats:
    """Speculative-decoding counters of one request (or aggregated over many). Per round
    (a decoding step that had drafts) only histograms are updated: of the drafts verified, of
    those accepted and of the slots tested (verified with every earlier draft accepted:
    min(accepted + 1, verified)); the per-position counts are their tail sums (hot path: one
    record per request and step)."""

    num_steps: int = 0  # decoding rounds that had drafts available
    num_drafted_tokens: int = 0  # drafts proposed
    num_verified_tokens: int = 0  # drafts sent to the target (drafted - trimmed)
    num_accepted_tokens: int = 0  # drafts accepted
    width: int = 0  # most drafts proposed in one round (length of the per-position lists)
    verified_hist: list[int] = field(default_factory=list)  # rounds by drafts verified
    accepted_hist: list[int] = field(default_factory=list)  # rounds by drafts accepted
    reached_hist: list[int] = field(default_factory=list)  # rounds by slots tested

    def record(self, num_drafted: int, num_verified: int, num_accepted: int) -> None:
        self.record_counts({(num_drafted, num_verified, num_accepted): 1})

    def record_many(self, drafted, verified, accepted) -> None:
        """`record` for many rounds at once (the rows of a step), vectorized."""
        d, v, a = (np.asarray(x, dtype=np.int64) for x in (drafted, verified, accepted))
        if d.size == 0:
            return
        self.num_steps += int(d.size)
        self.num_drafted_tokens += int(d.sum())
        self.num_verified_tokens += int(v.sum())
        self.num_accepted_tokens += int(a.sum())
        self.width = max(self.width, int(d.max()))
        for hist, counts in ((self.verified_hist, v), (self.accepted_hist, a),
                             (self.reached_hist, np.minimum(a + 1, v))):  # fmt: skip
            _add(hist, np.bincount(counts))

    def record_counts(self, counts: dict[tuple[int, int, int], int]) -> None:
        """`record` for rounds counted by kind: {(drafted, verified, accepted): rounds}."""
        for (d, v, a), c in counts.items():
            self.num_steps += c
            self.num_drafted_tokens += d * c
            self.num_verified_tokens += v * c
            self.num_accepted_tokens += a * c
            if d > self.width:
                self.width = d
            for hist, i in ((self.verified_hist, v), (self.accepted_hist, a),
                            (self.reached_hist, min(a + 1, v))):  # fmt: skip
                _bump(hist, i, c)

    def merge(self, other: SpecStats) -> None:
        self.num_steps += other.num_steps
        self.num_drafted_tokens += other.num_drafted_tokens
        self.num_verified_tokens += other.num_verified_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.width = max(self.width, other.width)
        for mine, theirs in ((self.verified_hist, other.verified_hist),
                             (self.accepted_hist, other.accepted_hist),
                             (self.reached_hist, other.reached_hist)):  # fmt: skip
            _add(mine, theirs)

    @property
    def verified_per_pos(self) -> list[int]:  # rounds verifying >= pos+1 drafts
        return _tail_counts(self.verified_hist, self.width)

    @property
    def accepted_per_pos(self) -> list[int]:  # rounds accepting >= pos+1 drafts
        return _tail_counts(self.accepted_hist, self.width)

    @property
    def reached_per_pos(self) -> list[int]:  # rounds in which slot pos was tested
        return _tail_counts(self.reached_hist, self.width)

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
        self.num_hashed_blocks = 0  # of its blocks, those the block manager has registered
        self.num_preemptions = 0
        self.has_drafts = False  # drafts for the next verify live on the device
        # first position whose drafter context a skipped write left missing (None: none;
        # spec/context_gaps.py): rebuilt before the request drafts again
        self.context_gap: int | None = None
        self.slot: int = -1  # row in the runner's persistent per-request device buffers
        self.round = 0  # decoding rounds so far (an RNG key)
        self.stale_conf: np.ndarray | None = None  # confidences of an earlier round (host)
        # this request's speculative rounds counted by kind, (drafted, verified, accepted)
        # -> rounds (the `spec` property reads them): a dict update a round on the commit
        # path instead of SpecStats.record's ~0.9 µs; at most (K + 1)^3 kinds
        self.spec_rounds: dict[tuple[int, int, int], int] = {}
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.output_text = ""  # detokenized text of the outputs (maintained incrementally)
        self.prefix_offset = 0  # output index where the detokenizer's decode window starts
        self.read_offset = 0  # output tokens already turned into output_text

    @property
    def spec(self) -> SpecStats:
        """The request's speculative counters (a new SpecStats: its rounds so far)."""
        stats = SpecStats()
        stats.record_counts(self.spec_rounds)
        return stats

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

    def finish(self, status: RequestStatus) -> None:
        self.status = status
        self.finished_time = time.time()
        self.has_drafts = False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
