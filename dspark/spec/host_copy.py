"""Device -> host copies read without waiting: the planner's stale confidences.

Every drafting step copies the drafts' confidences to the host (non-blocking), and a plan
reads the newest copy that has landed among those older than the newest one queued: that one
holds the confidences of the drafts the step being planned verifies, which its budget may
not read (step_planning._stale; it landed before the plan on the CPU always, and on a GPU
whenever the host took longer than the drafter). The copies go round-robin into `depth` pinned
staging buffers, each with its own event; a read takes the newest buffer whose event has
completed. One buffer with one re-recorded event is not enough: on a GPU the drafter runs
after the step's outputs are copied, so when the next plan reads, the newest copy is usually
still in flight; re-recording the event for the following copy then hides every completed
one, and the host would read the initial values forever (measured on the H200: the planner
saw survival 1.0 at every position).

Invariant: a staging buffer is read only while its latest copy is complete; a newer copy into
it re-records its event first, so a read never races a copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class LandedCopies:
    def __init__(self, shape: tuple[int, ...], device: torch.device, depth: int = 2,
                 fill: float = 1.0, event_factory: Callable | None = None):  # fmt: skip
        pin = device.type == "cuda"
        if event_factory is None and device.type == "cuda":
            event_factory = torch.cuda.Event
        self._new_event = event_factory  # None: copies complete on return (CPU)
        self.host = torch.full(shape, fill, dtype=torch.float32)
        self._staging = [torch.full(shape, fill, dtype=torch.float32, pin_memory=pin)
                         for _ in range(depth)]  # fmt: skip
        self._events: list = [None] * depth
        # numpy views for the host-side copy (np.copyto: ~1 µs; torch's copy_ costs several)
        self._host_np = self.host.numpy()
        self._staging_np = [t.numpy() for t in self._staging]
        self._pushed = 0  # generations handed out
        self._host_gen = 0  # generation `host` holds

    def push(self, src: torch.Tensor) -> None:
        """Queue a copy of `src` (on the current stream) into the next staging buffer: copy
        (generation) g goes to buffer (g - 1) % depth."""
        i = self._pushed % len(self._staging)
        self._pushed += 1
        self._staging[i].copy_(src, non_blocking=True)
        if self._new_event is not None:
            if self._events[i] is None:
                self._events[i] = self._new_event()
            self._events[i].record()

    def read(self, before: int | None = None) -> np.ndarray:
        """The newest landed copy (or the previous read's, or the fill), never waiting;
        with `before`, the newest landed one of an older generation than that."""
        depth = len(self._staging)
        newest = self._pushed if before is None else min(self._pushed, before - 1)
        for gen in range(newest, max(self._host_gen, self._pushed - depth), -1):
            i = (gen - 1) % depth  # newest first; older than the host's copy: nothing new
            ev = self._events[i]
            if ev is None or ev.query():
                np.copyto(self._host_np, self._staging_np[i])
                self._host_gen = gen
                break
        return self._host_np

    @property
    def next_generation(self) -> int:
        """The generation the next `push` queues."""
        return self._pushed + 1

    @property
    def newest_generation(self) -> int:
        """The generation the last `push` queued (0: none yet)."""
        return self._pushed

    @property
    def landed_generation(self) -> int:
        """The generation the last `read` returned (0: the fill)."""
        return self._host_gen

    @property
    def lag(self) -> int:
        """Copies queued since the one the host holds (0: up to date)."""
        return self._pushed - self._host_gen
