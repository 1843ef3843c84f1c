"""ModelRunner: turns a `SchedulerOutput` (ids and counts) into tensors, runs the model over
the paged KV cache and samples (vLLM V1's GPUModelRunner, in small).

The runner keeps each request's tokens, block ids and sampling parameters across steps; the
scheduler only sends what changed. The batch is flattened in the order of
`SchedulerOutput.num_scheduled_tokens`: request `i` brings `n_i` tokens, from its
`num_computed_tokens` on. A request samples when its new tokens reach the end of its known
tokens; a partial (chunked) prefill samples nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from engine.attention.backend import AttentionMetadata
from engine.core.kv_layout import KVCacheLayout, single_group
from engine.core.outputs import (
    LogprobsEntry,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache_sizing import mapped_caches, zeroed_cache
from engine.parallel.group import then
from engine.request_state import RequestState
from engine.sample.prompt_logprobs import prompt_logprobs
from engine.sample.sampler import Sampler
from engine.sample.step import SampleStep, sample_step
from engine.spec.decoder import SpecDecoder
from engine.structured.bitmask import GrammarBitmask

if TYPE_CHECKING:
    from engine.connector.base import KVConnectorWorker


class CausalLM(Protocol):
    """What the runner needs from a model (engine.model.causal_lm.CausalLM)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        before_layer: Callable[[int], None] | None = None,
        after_layer: Callable[[int], None] | None = None,
        layer_metadata: list[AttentionMetadata] | None = None,
    ) -> torch.Tensor: ...  # [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [n, vocab] float32


@dataclass
class _Batch:
    """One step's flattened inputs (host side) and the rows that sample."""

    req_ids: list[str]
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata  # the first KV cache group's
    layer_metadata: list[AttentionMetadata] | None  # per layer, its group's (hybrid models)
    sample_req_idx: list[int]  # batch indices of the requests that sample
    # [num_rows] int64: each sampling request's last token row, preceded by its drafts' rows
    logits_rows: torch.Tensor
    starts: np.ndarray  # [num_reqs] int64: each one's first scheduled position (computed before)
    row_starts: np.ndarray  # [num_reqs] int64: each one's first row in the flattened batch


class ModelRunner:
    """Owns the KV caches and per-request state; `execute_model` runs one step."""

    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        eos_token_id: int | None,
        seed: int,
        layout: KVCacheLayout | None = None,
        kv_cache_fd: int | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.eos_token_id = eos_token_id
        self.vocab_size = model.vocab_size
        self.requests: dict[str, RequestState] = {}
        self._prompt_logprobs_reqs: set[str] = set()  # requests that asked for prompt_logprobs
        self.sampler = Sampler(seed, self.device)
        self.layout = layout or single_group(model.num_layers)
        if len(self.layout.layer_group) != model.num_layers:
            raise ValueError(f"the KV cache layout has {len(self.layout.layer_group)} layers, the "
                             f"model {model.num_layers}")
        shape = (num_blocks, 2, block_size, model.num_kv_heads, model.head_dim)
        # each [num_blocks, 2, block_size, num_kv_heads, head_dim]; in the shared memory of
        # `kv_cache_fd` where given (a tensor-parallel rank's, which rank 0's connector moves)
        shared = ([zeroed_cache(shape, dtype, self.device) for _ in range(self.layout.layers_per_block)]
                  if kv_cache_fd is None else mapped_caches(kv_cache_fd, self.layout.layers_per_block,
                                                            shape, dtype))
        # per layer: the tensor of its slot (a hybrid model's groups share them, by block id)
        self.kv_caches = [shared[slot] for slot in self.layout.layer_slot]
        pin = self.device.type == "cuda"
        max_blocks = -(-max_model_len // block_size)
        self._tokens_buf = torch.zeros(2 + self.layout.num_groups, max_num_batched_tokens,
                                       dtype=torch.int64, pin_memory=pin)  # ids, positions, slots
        self._table_bufs = [torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, pin_memory=pin)
                            for _ in self.layout.groups]
        # host buffers are rewritten only after the last step's async copies left them
        self._copies_done: torch.cuda.Event | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.connector: KVConnectorWorker | None = None
        # False on tensor-parallel ranks other than 0: they run the forward and the logits
        # (collectives) and sample nothing; rank 0's tokens reach them with the next step.
        self.samples = True
        # Tensor parallelism, a step with layer-wise KV loads: called before each layer on every
        # rank (after rank 0 waited for the layer's load), so no rank reads a layer before rank
        # 0's connector wrote it into every rank's cache.
        self.layer_sync: Callable[[int], None] | None = None
        self.spec: SpecDecoder | None = None  # speculative decoding's proposer (rank 0 only)

    def set_connector(self, connector: KVConnectorWorker) -> None:
        """The worker half of a KV connector; it sees the KV caches and every step."""
        connector.register_kv_caches(self.kv_caches, list(self.layout.layer_group))
        self.connector = connector

    def capture_decode_graphs(self, max_num_seqs: int) -> None:
        """CUDA only: capture pure decode steps of up to `max_num_seqs` requests as graphs."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        graphs = DecodeGraphs(self.model, self.kv_caches, max_num_seqs, self.max_model_len,
                              self.block_size, self.device, self.layout.layer_group)
        graphs.capture()
        self.decode_graphs = graphs

    # --- state ------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        if self.spec is not None:
            self.spec.forget(so.finished_req_ids | so.preempted_req_ids,
                             {r: self.requests[r].output_token_ids for r in so.finished_req_ids
                              if r in self.requests})
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._prompt_logprobs_reqs.discard(req_id)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = self._new_state(new)
            if new.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs_reqs.add(new.req_id)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.num_kept_blocks is not None:  # the scheduler freed rejected drafts' blocks
                for ids, kept in zip(state.block_ids, cached.num_kept_blocks, strict=True):
                    del ids[kept:]
            for ids, new_ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                ids.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def append_sampled(self, sampled: dict[str, list[int]]) -> None:
        """Tensor-parallel ranks other than 0: the tokens rank 0 emitted in the last step."""
        for req_id, tokens in sampled.items():
            state = self.requests.get(req_id)
            if state is not None:
                for token in tokens:
                    state.append_token(token)

    def _new_state(self, new: NewRequestData) -> RequestState:
        num_tokens = len(new.token_ids)
        buf = np.zeros(max(self.max_model_len + 1, num_tokens + 1), dtype=np.int64)
        buf[:num_tokens] = new.token_ids
        return RequestState(
            req_id=new.req_id,
            sampling_params=new.sampling_params,
            prompt_token_ids=list(new.token_ids[: new.num_prompt_tokens]),
            output_token_ids=list(new.token_ids[new.num_prompt_tokens:]),
            block_ids=[list(ids) for ids in new.block_ids],
            num_computed_tokens=new.num_computed_tokens,
            token_buf=buf,
            num_tokens=num_tokens,
        )

    # --- one step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Runs one step: updates request state, runs the model on the scheduled tokens, and
        samples one token for each request whose scheduled tokens reach its last token (those in
        `grammar` among the tokens its bitmask allows)."""
        self._update_states(scheduler_output)
        connector = self.connector
        if connector is not None:
            connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            connector.start_load_kv()
        try:
            out = self._execute(scheduler_output, grammar)
        finally:
            if connector is not None:
                connector.wait_for_save()
                out_kv = connector.get_finished(scheduler_output.finished_req_ids)
                connector.clear_connector_metadata()
        if connector is not None:
            out.kv_connector_output = out_kv
        return out

    def _execute(self, scheduler_output: SchedulerOutput,
                 grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        if not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput([], [], [])
        drafts = scheduler_output.scheduled_spec_decode_tokens
        batch = self._prepare_batch(scheduler_output.num_scheduled_tokens, drafts)
        graphs = self.decode_graphs
        connector = self.connector
        meta = scheduler_output.kv_connector_metadata
        # Graph replays run no per-layer hooks: not while this step saves or loads KV.
        saving = connector is not None and bool(getattr(meta, "saves", None)
                                                or getattr(meta, "loads", None))
        if (graphs is not None and batch.metadata.is_pure_decode and not saving
                and graphs.can_run(batch.metadata.num_reqs)):
            hidden = graphs.run(batch.input_ids, batch.positions, batch.metadata,
                                batch.layer_metadata)
        elif connector is not None:
            caches = self.kv_caches
            hidden = self.model(batch.input_ids, batch.positions, caches, batch.metadata,
                                before_layer=then(connector.wait_for_layer_load, self.layer_sync),
                                after_layer=lambda i: connector.save_kv_layer(i, caches[i]),
                                layer_metadata=batch.layer_metadata)
        else:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata,
                                before_layer=self.layer_sync,
                                layer_metadata=batch.layer_metadata)  # [num_tokens, hidden]
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        logprobs: list[list[LogprobsEntry] | None] = [None] * len(batch.req_ids)
        spec_tokens: dict[str, list[int]] = {}
        if batch.sample_req_idx and not self.samples:
            self.model.compute_logits(hidden[batch.logits_rows])  # its part of the gather
        elif batch.sample_req_idx:
            logits = self.model.compute_logits(hidden[batch.logits_rows])  # [num_rows, vocab]
            step = SampleStep([batch.req_ids[i] for i in batch.sample_req_idx], self.requests,
                              drafts, self.eos_token_id, self.vocab_size, self.device)
            emitted = sample_step(self.sampler, logits, step, grammar, self.spec)
            for i, (tokens, entries) in zip(batch.sample_req_idx, emitted, strict=True):
                sampled[i], logprobs[i] = tokens, entries
            if self.spec is not None:
                spec_tokens = self.spec.propose([self.requests[r] for r in step.req_ids],
                                                len(batch.req_ids))
        any_logprobs = any(lp is not None for lp in logprobs)
        result = ModelRunnerOutput(batch.req_ids, sampled, logprobs if any_logprobs else [],
                                   spec_token_ids=spec_tokens)
        if self._prompt_logprobs_reqs:  # most steps have none: no per-request pass
            for i, req_id in enumerate(batch.req_ids):
                if req_id in self._prompt_logprobs_reqs:
                    start = int(batch.starts[i])
                    entries = prompt_logprobs(self.model, hidden, self.requests[req_id], start,
                                              int(batch.row_starts[i]),
                                              batch.metadata.query_lens_cpu[i])
                    if entries:
                        result.prompt_logprobs[req_id] = (start, entries)
        return result

    def _prepare_batch(self, num_scheduled: dict[str, int],
                       drafts: dict[str, list[int]] | None = None) -> _Batch:
        if self._copies_done is not None:
            self._copies_done.synchronize()
        req_ids = list(num_scheduled)
        states = [self.requests[r] for r in req_ids]
        for req_id, d in (drafts or {}).items():  # after the known tokens, until verified
            self.requests[req_id].put_drafts(d)
        num_reqs = len(req_ids)
        query_lens = np.fromiter(num_scheduled.values(), dtype=np.int64, count=num_reqs)
        computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        seq_lens = computed + query_lens
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        total = int(cu[-1])
        req_idx = np.repeat(np.arange(num_reqs), query_lens)  # [num_tokens]
        ids, pos, slots = self._token_arrays(total)
        np.subtract(np.arange(total), cu[:-1][req_idx], out=pos)
        pos += computed[req_idx]
        chunks = [s.token_buf[c:c + n]
                  for s, c, n in zip(states, computed, query_lens, strict=True)]
        np.concatenate(chunks, out=ids)
        block_of, offset = pos // self.block_size, pos % self.block_size
        group_meta = []
        for g in range(self.layout.num_groups):
            table = self._block_table(states, g)  # [num_reqs, max_blocks] int32
            np.add(table[req_idx, block_of].astype(np.int64) * self.block_size, offset,
                   out=slots[g])
            if g == 0:
                group_meta.append(self._attention_metadata(slots[0], cu, query_lens, seq_lens,
                                                           table))
            else:  # the same batch over the group's own pages
                group_meta.append(replace(
                    group_meta[0], slot_mapping=self._to_device(torch.from_numpy(slots[g])),
                    block_table=self._to_device(torch.from_numpy(table))))
        layer_meta = ([group_meta[g] for g in self.layout.layer_group]
                      if self.layout.is_hybrid else None)
        sample_idx = [i for i, s in enumerate(states)
                      if query_lens[i] > 0 and seq_lens[i] >= s.num_tokens]
        rows: list[int] = []
        for i in sample_idx:  # the drafts' rows, then the last token's
            end = int(cu[i + 1])
            rows.extend(range(end - 1 - len(drafts.get(req_ids[i], ())) if drafts else end - 1, end))
        logits_rows = torch.tensor(rows, dtype=torch.int64)
        batch = _Batch(req_ids, self._to_device(torch.from_numpy(ids)),
                       self._to_device(torch.from_numpy(pos)), group_meta[0], layer_meta,
                       sample_idx, logits_rows.to(self.device), computed, cu[:-1])
        if self.device.type == "cuda":
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()
        return batch

    def _attention_metadata(self, slots: np.ndarray, cu: np.ndarray, query_lens: np.ndarray,
                            seq_lens: np.ndarray, table: np.ndarray) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._to_device(torch.from_numpy(slots)),
            query_start_loc=self._to_device(torch.from_numpy(cu.astype(np.int32))),
            seq_lens=self._to_device(torch.from_numpy(seq_lens.astype(np.int32))),
            block_table=self._to_device(torch.from_numpy(table)),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )

    def _token_arrays(self, total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host arrays of `total` entries for token ids, positions and (one row per KV cache
        group) slots."""
        if total > self._tokens_buf.shape[1]:
            self._tokens_buf = torch.zeros(self._tokens_buf.shape[0], total, dtype=torch.int64,
                                           pin_memory=self._tokens_buf.is_pinned())
        buf = self._tokens_buf.numpy()
        return buf[0, :total], buf[1, :total], buf[2:, :total]

    def _block_table(self, states: list[RequestState], group: int) -> np.ndarray:
        num_reqs = len(states)
        width = max(len(s.block_ids[group]) for s in states)
        buf = self._table_bufs[group]
        rows, cols = buf.shape
        if num_reqs > rows or width > cols:
            buf = self._table_bufs[group] = torch.zeros(
                max(num_reqs, rows), max(width, cols), dtype=torch.int32,
                pin_memory=buf.is_pinned())
        table = buf.numpy()[:num_reqs, :width]
        table.fill(0)
        for i, s in enumerate(states):
            ids = s.block_ids[group]
            table[i, : len(ids)] = ids
        return table

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.to(self.device, non_blocking=True)
