"""Offline API: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from dspark.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.outputs import RequestOutput
from dspark.sampling_params import SamplingParams


class LLM:
    def __init__(
        self,
        model: str,
        *,
        tokenizer: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        speculative_config: dict | None = None,
        **kwargs,
    ):
        config = EngineConfig(
            model=model,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            speculative_config=speculative_config,
            **kwargs,
        )
        self.engine = LLMEngine(config)
        self.engine.stream_outputs = False  # generate() uses finished outputs only
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes and give the device memory (weights, KV
        cache, CUDA graphs) back, so that another LLM can start in this process; generate()
        fails afterwards. Worker processes also stop when the LLM is garbage-collected or the
        interpreter exits, but memory is only returned here."""
        self.engine.runner.release_memory()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        if self.engine.runner.released:
            raise RuntimeError("this LLM was shut down; create a new one")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} sampling_params for {len(prompts)} prompts"
                )
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, cache_salt=cache_salt)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm or (use_tqdm is None and len(ids) >= 32):
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finals[rid] for rid in ids]
