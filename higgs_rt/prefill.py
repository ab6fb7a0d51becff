"""Prefill as a few CUDA graphs: prompts padded to (text, audio) buckets, so one graph serves many prompts.

An eager prefill of a 46-token prompt is ~600 small launches (37 ms on the H200, for ~2 ms of weight streaming); a
graph replays them without the host in the loop. Graph shapes are static, and so are the DualFFN's split sizes, so
a bucket is two-dimensional: the prompt's text positions and its audio positions (a cloned voice's reference),
each padded up to the next edge of `TEXT_BUCKETS` / `AUDIO_BUCKETS`.

Padding is exact for the real positions: the pad rows go after the prompt (text pads, then audio pads), so causal
attention never lets a real position see one; the routing op puts the text rows, pads included, before the audio
rows, which fills each split to its bucket; the logits are those of the last real position. Pad positions write
keys and values past the slot's length, where the decode step neither reads them (it reads `lengths` positions)
nor keeps them (it writes position `lengths` next). What padding changes is the matrix shapes, so the real rows
round like a prefill of the padded length: equal to the unpadded prefill up to float rounding, not bit for bit.

Batches (`many`, the batch engine's admission): prompts of one bucket go through one forward as rows of a batch,
each padded to the bucket as above. Each row is its own causal prompt (no row sees another). A bucket's forward
always has the same number of rows, `group_of` (about `GROUP_ROWS` positions, `GROUP_ROWS_CUDA` on CUDA; a group not
full repeats its first prompt, which writes the same values to the same slot): the matrix shapes, and so the kernels
and their rounding, never depend on how many prompts arrived together, and a prompt's keys and values are the same
bits alone as beside others. A group never has more prompts than the cache has slots: `TTS`'s 1-slot decoder
prefills a sentence alone, at its bucket's width. (Forwards as wide as what arrived, up to 16 prompts, rounded a
prompt's rows by how many came with it: on an H100 a request beside 63 others got other codes than alone in 2 of 8
probes.) On CUDA a forward of 512 rows (8 sentences of 46 positions) costs a lone sentence 6.3 ms against 4.0 at 128
rows (the arithmetic outgrows the weight read), and takes a burst of arrivals in a quarter of the weight reads: 11
sentences 14.5 ms against 24.2, and 64 requests arriving at once on an H100 reached their first audio at p50 304-313
ms against 391-405 (benchmarks/results/server_gpu_h100_35e247e*.json). On the CPU the arithmetic is what costs, so
its forwards stay at 128 rows.

Graphs are captured on first use of a bucket (an eager warm-up run, then the capture), at most `MAX_GRAPHS` per
cache; a prompt outside every bucket, or past the cache, or past that many graphs, runs the eager prefill (alone,
to float rounding of the bucketed one). Each graph writes the slots given by a device index, so one graph serves
every slot of its cache. The graphs share one memory pool (they never run at the same time), so more of them cost
capture time (once), not memory.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .cuda_graph import capture_graph
from .host_copy import copy_to
from .talker import KVCache, Talker

TEXT_BUCKETS = (32, 64, 96, 128, 192, 256, 384, 512)
AUDIO_BUCKETS = (0, 64, 128, 192, 256, 320, 384, 512, 640, 768, 1024)
MAX_GRAPHS = 24
MAX_GROUP = 16
# positions in one bucketed forward (`group_of`), on the CPU and on CUDA; $HIGGS_RT_PREFILL_GROUP_ROWS to measure others
GROUP_ROWS, GROUP_ROWS_CUDA = 128, 512
WARM_TEXT_BUCKETS = (32, 64)  # a sentence's prompt (46 tokens for 20 words): captured at a batch engine's start


def bucket_of(n: int, edges: tuple[int, ...]) -> int | None:
    """The smallest edge >= n (None: past the last)."""
    return next((e for e in edges if e >= n), None)


def group_of(key: tuple[int, int], rows: int = GROUP_ROWS) -> int:
    """Prompts in every forward of the (text, audio) bucket `key`: as many as fit `rows` positions, 1 to
    MAX_GROUP."""
    return max(1, min(MAX_GROUP, rows // sum(key)))


def group_rows(device: torch.device) -> int:
    """Positions per bucketed forward on `device` (GROUP_ROWS_CUDA on CUDA, else GROUP_ROWS), or
    $HIGGS_RT_PREFILL_GROUP_ROWS (a measurement switch: wider forwards take a burst of arrivals in fewer weight
    reads, and cost a lone prompt more arithmetic)."""
    value = os.environ.get("HIGGS_RT_PREFILL_GROUP_ROWS")
    if value is None:
        return GROUP_ROWS_CUDA if device.type == "cuda" else GROUP_ROWS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"HIGGS_RT_PREFILL_GROUP_ROWS must be a positive number of positions, got {value!r}")
    return int(value)


class BucketedPrefill:
    """`Talker.prefill` into one cache, padded to buckets; `graphs`: replayed as CUDA graphs (the model on CUDA).

    Called as the prefill: (cache, slot, ids [T], audio_frames [N, Q] or None) -> logits [Q, V] (fp32; on CUDA a
    fresh tensor, not the graph's output buffer). The cache must be the one given here.
    """

    def __init__(self, talker: Talker, cache: KVCache, graphs: bool = True):
        if graphs and talker.device.type != "cuda":
            raise ValueError("prefill graphs need the model on a CUDA device")
        self.talker, self.cache, self.graphs = talker, cache, graphs
        self.rows = group_rows(talker.device)  # positions per forward: a bucket's prompts all at this width
        cfg = talker.cfg
        self._audio_id = cfg.audio_token_ids[0]
        self._text_pad = next(i for i in range(cfg.vocab_size) if i not in cfg.audio_token_ids)
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = None

    def bucket(self, ids: Tensor) -> tuple[int, int] | None:
        """(text, audio) bucket of a prompt (ids on the host), or None for the eager prefill."""
        if ids.shape[0] == 0:
            return None
        n_audio = int(self.talker.audio_mask(ids).sum())
        key = bucket_of(ids.shape[0] - n_audio, TEXT_BUCKETS), bucket_of(n_audio, AUDIO_BUCKETS)
        if None in key or sum(key) > self.cache.max_len:
            return None
        return key if self._room(key) else None

    def group(self, ids: Tensor) -> tuple[tuple[int, int], int] | None:
        """(bucket, prompts per forward) of a prompt that shares batched forwards, or None (the eager prefill).
        `many` takes it back, so that an admission computes a prompt's bucket once."""
        key = self.bucket(ids.cpu())
        return None if key is None else (key, self._group_of(key))

    def _group_of(self, key: tuple[int, int]) -> int:
        """Prompts per forward of bucket `key` in this cache: `group_of` at this prefill's rows, at most the cache's
        slots (a 1-slot cache, `TTS`'s, never has a second prompt to seat)."""
        return min(group_of(key, self.rows), self.cache.batch)

    def _room(self, key: tuple[int, int]) -> bool:
        """The bucket's graph exists, or there is room for it (`MAX_GRAPHS`)."""
        return key in self._buckets or len(self._buckets) < MAX_GRAPHS

    @torch.no_grad()
    def __call__(self, cache: KVCache, slot: int, ids: Tensor, audio_frames: Tensor | None = None) -> Tensor:
        key, item = self._place(cache, slot, ids, audio_frames, self.group(ids))
        if key is None:
            return self.talker.prefill(cache, *item)
        return self._run(key, [item])[0]

    @torch.no_grad()
    def many(self, cache: KVCache, prompts: list[tuple[int, Tensor, Tensor | None]],
             groups: list[tuple[tuple[int, int], int] | None] | None = None) -> int:
        """Prefill several slots, (slot, ids, audio_frames) each (distinct slots): the prompts of one bucket in
        forwards of `group_of` prompts; the logits are not kept; returns the forwards run (an eager prefill is
        one). groups: each prompt's `group`, when the caller has it already (the batch engine's admission); None:
        computed here."""
        if groups is None:
            groups = [self.group(ids) for _, ids, _ in prompts]
        elif len(groups) != len(prompts):
            raise ValueError(f"BucketedPrefill: {len(groups)} groups for {len(prompts)} prompts")
        forwards: dict[tuple[int, int], list] = {}
        ran = 0
        for prompt, group in zip(prompts, groups):
            key, item = self._place(cache, *prompt, group)
            if key is None:
                self.talker.prefill(cache, *item)
                ran += 1
            else:
                forwards.setdefault(key, []).append(item)
        for key, items in forwards.items():
            if not self._room(key):  # other buckets of this call took the room
                for item in items:
                    self.talker.prefill(cache, *item)
                ran += len(items)
                continue
            g = self._group_of(key)
            for i in range(0, len(items), g):
                self._run(key, items[i: i + g])
                ran += 1
        return ran

    def _place(self, cache: KVCache, slot: int, ids: Tensor, frames: Tensor | None, group):
        """A prompt of `group` (its `group(ids)`) -> (bucket, (slot, ids, frames) checked, on the host), or (None,
        the arguments) for the eager prefill."""
        if cache is not self.cache:
            raise ValueError("BucketedPrefill: called with another cache than its own")
        ids = ids.cpu()  # prompts are built on the host: a no-op
        if group is None:
            return None, (slot, ids, frames)
        return group[0], (slot, *self.talker.check_prompt(ids, frames, cache.max_len, on_device=False))

    def warm(self, texts: tuple[int, ...] = WARM_TEXT_BUCKETS) -> None:
        """Capture now the graphs of text-only prompts of these bucket widths (a burst of arrivals would otherwise
        pay the captures in its time to first audio). Runs on slot 0, which must be idle; its length is 0 after."""
        if not self.graphs:
            return
        for text in texts:
            self.many(self.cache, [(0, torch.full((text,), self._text_pad, dtype=torch.int64), None)])
        self.cache.lengths.zero_()

    def _run(self, key: tuple[int, int], items: list[tuple[int, Tensor, Tensor | None]]) -> Tensor:
        """At most `_group_of(key)` checked prompts (slot, ids, frames) of one bucket through one forward
        of that many rows (the first prompt repeated to fill it) -> its logits [group, Q, V], the prompts' first."""
        text_b, audio_b = key
        group = self._group_of(key)
        if not 0 < len(items) <= group:
            raise ValueError(f"BucketedPrefill: {len(items)} prompts for a group of {group}")
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(self, text_b, audio_b, group)
        ids = torch.empty(group, text_b + audio_b, dtype=torch.int64)  # built on the host, copied once
        last, slots = [], []
        for j, (slot, prompt, audio) in enumerate(items + items[:1] * (group - len(items))):
            t, n_audio = prompt.shape[0], 0 if audio is None else audio.shape[0]
            ids[j, :t] = prompt
            ids[j, t: t + text_b - (t - n_audio)] = self._text_pad
            ids[j, t + text_b - (t - n_audio):] = self._audio_id
            if audio_b:  # frames may already be on the device (a cloned voice's reference)
                rows = b.frames[j * audio_b: (j + 1) * audio_b]
                if n_audio:
                    copy_to(rows[:n_audio], audio)
                rows[n_audio:].zero_()
            last.append(t - 1)
            slots.append(slot)
        copy_to(b.ids, ids)  # queued: the host never waits for the step in flight
        copy_to(b.last, torch.tensor(last))
        copy_to(b.slot, torch.tensor(slots))
        logits = b.run()
        for (slot, prompt, _) in items:
            self.cache.lengths[slot].fill_(prompt.shape[0])  # a kernel: `t[i] = n` copies n from pageable memory
        return logits


class _Bucket:
    """Static inputs and the forward of one (text, audio) bucket for `group` prompts; `run` replays its graph (or
    runs it eagerly). The graph is captured at the first run, with that run's inputs in place: its warm-up writes
    only the slots being prefilled, never another stream's."""

    def __init__(self, owner: BucketedPrefill, text: int, audio: int, group: int):
        talker = owner.talker
        dev, q = talker.device, talker.cfg.num_codebooks
        self.owner, self.width = owner, text + audio
        self.ids = torch.full((group, self.width), owner._text_pad, dtype=torch.int64, device=dev)
        self.frames = torch.zeros(group * audio, q, dtype=torch.int64, device=dev) if audio else None
        self.last = torch.zeros(group, dtype=torch.int64, device=dev)
        self.slot = torch.zeros(group, dtype=torch.int64, device=dev)
        self.graph = self.out = None

    def forward(self) -> Tensor:
        cache, width = self.owner.cache, self.width

        def store(i: int, k: Tensor, v: Tensor) -> None:
            cache.k[i, :, :, :width].index_copy_(0, self.slot, k)
            cache.v[i, :, :, :width].index_copy_(0, self.slot, v)

        return self.owner.talker.prompt_forward(self.ids, self.frames, store, always_route=self.frames is not None,
                                                last=self.last)

    def run(self) -> Tensor:
        owner = self.owner
        if not owner.graphs:
            return self.forward()
        if self.graph is None:
            if owner._pool is None:
                owner._pool = torch.cuda.graph_pool_handle()
            self.graph, self.out = capture_graph(self.forward, 1, owner._pool)
        self.graph.replay()
        return self.out.clone()
