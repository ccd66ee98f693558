"""Targets verify draft trees; `LocalTarget` runs the model in this process.

Per session the target holds a KV cache of every committed token but the last one (the `tail`),
so each verify forward is [tail] + draft nodes: row 0 of its logits judges the root's children.
Invariant, asserted after every step: cached positions == committed tokens - len(tail).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

import torch

from specbench.decode import clock, fast_forward, packed_attention
from specbench.decode.kv import (cached_length, check_full_attention, crop_to, keep_positions, new_cache,
                                  plain_layers, tree_attention_mask)
from specbench.decode.kv_pool import PooledCache, pool_for
from specbench.models.loaded import LoadedModel
from specbench.sampling.verify import verify
from specbench.types import DraftTree, SamplingParams, SpecbenchError, Timing, Verdict


class PendingVerdict(Protocol):
    """A verify under way: `ready()` without waiting, `result()` waits for it."""

    def ready(self) -> bool: ...

    def result(self) -> Verdict: ...


class Target(Protocol):
    """What `run` and every method need from a verifier, local or remote: the vocabulary, where
    generation stops, the tokenizer where one is known, and sessions to prefill and verify."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    tokenizer: Optional[Any]

    def prefill(self, session: str, token_ids: Sequence[int]) -> int: ...

    def verify_begin(self, session: str, tree: DraftTree, sampling: SamplingParams, seed: int) -> PendingVerdict:
        """Start a verify; a remote target returns at once, a local one when it is done."""

    def verify(self, session: str, tree: DraftTree, sampling: SamplingParams, seed: int) -> Verdict: ...

    def close(self, session: str) -> None: ...


@dataclass(frozen=True)
class Finished:
    """A verdict already reached: what a target that verifies in place returns from verify_begin."""

    verdict: Verdict

    def ready(self) -> bool:
        return True

    def result(self) -> Verdict:
        return self.verdict


class UnknownSessionError(SpecbenchError):
    pass


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> list[int]:
    """Return the ids as ints, refusing non-integers and ids outside [0, vocab_size)."""
    ids = []
    for position, token in enumerate(token_ids):
        try:
            if isinstance(token, bool):
                raise TypeError
            token = operator.index(token)
        except TypeError:
            raise SpecbenchError(f"{what}[{position}] = {token!r} is not an integer token id") from None
        if not 0 <= token < vocab_size:
            raise SpecbenchError(
                f"{what}[{position}] = {token} is out of vocabulary (valid ids are 0..{vocab_size - 1})")
        ids.append(token)
    return ids


def check_tree(tree: DraftTree, vocab_size: int, sampling: SamplingParams) -> None:
    """Refuse, before any work, a tree the verification could only fail on halfway through."""
    check_token_ids(tree.tokens, vocab_size, "draft tree token")
    if tree.draft_dists is not None:
        for node, dist in enumerate(tree.draft_dists):
            check_token_ids(dist.ids, vocab_size, f"q id of draft node {node}")
    if sampling.effective_rule != "rejection" or not len(tree):
        return
    if tree.draft_dists is None:
        raise SpecbenchError("rejection sampling needs the draft distribution q of every node; this drafter "
                             "sends none, so use rule='sample-match' (lossless without q)")
    for node, (token, dist) in enumerate(zip(tree.tokens, tree.draft_dists)):
        if not any(i == token and p > 0 for i, p in zip(dist.ids, dist.probs)):
            raise SpecbenchError(f"draft node {node} has token {token} outside its own q")


@dataclass
class SessionState:
    """One session on a target: its cache and committed tokens; what a batch verifies against (`decode/batch.py`)."""

    cache: object
    committed: list[int]
    tail: list[int] = field(default_factory=list)
    features: Optional[list] = None  # a row per cached position, for a session a draft head reads (heads/)

    def check_invariant(self) -> None:
        cached = cached_length(self.cache)
        if cached != len(self.committed) - len(self.tail):
            raise AssertionError(
                f"KV invariant broken: {cached} cached positions for {len(self.committed)} committed "
                f"tokens with a tail of {len(self.tail)}")


class PrefillJob:
    """A session's prefill, fed `max_tokens` at a time; the session (if it existed) keeps serving its
    old state until the last chunk is in, and only then is replaced. Chunks through one cache give
    the same keys and values as one forward (causal attention), up to float rounding."""

    def __init__(self, target: "LocalTarget", session: str, ids: list[int]):
        self.target, self.session, self.ids, self.fed = target, session, ids, 0
        self.state = SessionState(cache=target.new_cache(), committed=list(ids), tail=ids[-1:],
                                  features=[] if session in target.featured else None)

    @property
    def remaining(self) -> int:
        """Prompt tokens still to feed (the last one is not fed: it is the session's tail)."""
        return len(self.ids) - 1 - self.fed

    def next_chunk(self, max_tokens: int) -> list[int]:
        return self.ids[:-1][self.fed:self.fed + max_tokens]

    def advance(self, max_tokens: int) -> bool:
        """Feed up to `max_tokens` more prompt tokens; True once the session is ready. A shared target
        may also feed chunks inside a batched verify (`decode/batch.py`), counted in `fed`."""
        chunk = self.next_chunk(max_tokens)
        if chunk:
            self.target.forward(self.state, chunk, position_ids=None, attention_mask=None, logits_to_keep=1)
            if self.state.features is not None:
                self.state.features += self.target.tap.rows(range(len(chunk)))
            clock.synchronize(self.target.device)  # a caller timing the prefill times the work, not its launch
            self.fed += len(chunk)
        if self.remaining:
            return False
        self.state.check_invariant()
        replaced = self.target.sessions.get(self.session)
        self.target.sessions[self.session] = self.state
        if replaced is not None and self.target.fast is not None:
            self.target.fast.forget(replaced.cache)
        return True


class LocalTarget:
    """The target model in this process; sessions are independent sequences with their own caches."""

    def __init__(self, loaded: LoadedModel, max_context: int | None = None,
                 eos_token_ids: Optional[Sequence[int]] = None, kv_pool: bool = True,
                 fast: bool | str | None = None, fast_capacity: int | None = None):
        self.loaded = loaded
        self.model = loaded.model
        # read once (a model's dtype walks its parameters: ~40 us, per row of every batch before); the pools
        # below are made on this device, so the model is not meant to move after this
        self.dtype, self.device = self.model.dtype, self.model.get_input_embeddings().weight.device
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = tuple(loaded.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.tokenizer = loaded.tokenizer
        self.max_context = max_context or getattr(self.model.config, "max_position_embeddings", None)
        self.sessions: dict[str, SessionState] = {}
        self.tap = None  # a draft head's FeatureTap (`heads/features.py`), attached by `keep_features`
        self.featured: set[str] = set()  # sessions whose features are kept (a head drafts for them)
        self.plain = plain_layers(self.model.config)  # full attention only (no sliding window)
        # fast: fixed-shape compiled / graph-captured forwards over a static cache per session
        # (`decode/fast_forward.py`); True picks the device's backend, a string names one; None: on where it
        # pays (CUDA), `fast_forward.chosen_backend`
        self.fast = None
        fast = fast_forward.chosen_backend(fast, self.model)
        if fast:
            capacity = fast_forward.fast_capacity(self.max_context, fast_capacity)
            self.fast = fast_forward.FastForward(self.model, capacity, fast)
            self.max_context = min(self.max_context or capacity, capacity)
            kv_pool = False
        # None: Hugging Face's own cache per session (the model's layers need it, or the caller asked)
        self.pool = pool_for(self.model) if kv_pool else None
        # batches of pooled sessions run packed (no padding) where the model's attention allows it
        self.packed = self.pool is not None and packed_attention.install(self.model)

    def new_cache(self):
        """An empty cache for one session: a static one on the fast path, else a row of the shared pool
        where the model allows it."""
        if self.fast is not None:
            return self.fast.new_cache()
        if self.pool is None:
            return new_cache(self.model.config)
        return PooledCache(self.pool)

    def prefill(self, session: str, token_ids: Sequence[int]) -> int:
        """Start (or restart) `session` from `token_ids` in one forward; returns the committed length."""
        job = self.prefill_job(session, token_ids)
        job.advance(len(job.ids))
        return len(job.ids)

    def prefill_job(self, session: str, token_ids: Sequence[int]) -> "PrefillJob":
        """A prefill to run chunk by chunk (`advance`), so a shared target can verify other sessions'
        drafts between chunks of a long prompt."""
        return PrefillJob(self, session, self.check_prompt(token_ids))

    def check_prompt(self, token_ids: Sequence[int]) -> list[int]:
        """The prompt's ids as ints, or an error naming what is wrong (empty, out of vocabulary, too long)."""
        ids = check_token_ids(token_ids, self.vocab_size, "prompt")
        if not ids:
            raise SpecbenchError("empty prompt: at least one token is needed to condition on")
        self.check_context(len(ids))
        return ids

    def verify(self, session: str, tree: DraftTree, sampling: SamplingParams, seed: int) -> Verdict:
        """One forward over [tail] + tree, verification by `sampling`'s rule, then commit the path."""
        start = clock.device_time(self.device)
        state = self.state(session)
        check_tree(tree, self.vocab_size, sampling)
        self.check_context(len(state.committed) + len(tree) + 1)
        past = cached_length(state.cache)
        num_prefix = len(state.tail)
        inputs = state.tail + list(tree.tokens)
        if tree.is_chain:
            position_ids, attention_mask = None, None
        else:
            check_full_attention(self.model, "verifying a tree")
            depths = tree.depths()
            positions = list(range(past, past + num_prefix)) + [past + num_prefix - 1 + d for d in depths]
            position_ids = torch.tensor([positions], device=self.device)
            attention_mask = tree_attention_mask(tree.parents, num_prefix, past, self.dtype, self.device)
        forward_start = clock.device_time(self.device)
        try:
            logits = self.forward(state, inputs, position_ids, attention_mask)
            forward_s = clock.device_time(self.device) - forward_start
            generator = torch.Generator().manual_seed(seed)
            path, bonus = verify(tree, logits[num_prefix - 1:], sampling, generator,  # on the device
                                 position=len(state.committed))
            if state.features is not None:
                state.features += self.tap.rows(list(range(num_prefix)) + [num_prefix + i for i in path])
        except BaseException:
            crop_to(state.cache, past)  # a failed step leaves the session exactly as it was
            raise
        keep_positions(state.cache, list(range(past + num_prefix)) + [past + num_prefix + i for i in path])
        state.committed += [tree.tokens[i] for i in path] + [bonus]
        state.tail = [bonus]
        state.check_invariant()
        timing = Timing(target_forward_s=forward_s, verify_s=clock.device_time(self.device) - start)
        return Verdict(tuple(path), bonus, timing)

    def verify_begin(self, session: str, tree: DraftTree, sampling: SamplingParams, seed: int) -> Finished:
        return Finished(self.verify(session, tree, sampling, seed))

    def keep_features(self, session: str, layer_ids: Sequence[int]) -> None:
        """Keep the inputs of `layer_ids` per cached position of `session` from its next prefill on (what a
        draft head reads, `features`); other sessions keep none."""
        from specbench.heads.features import attach

        attach(self, layer_ids)
        self.featured.add(session)

    def features(self, session: str) -> list:
        """The feature rows of `session`'s cached positions (`keep_features` before its prefill)."""
        rows = self.state(session).features
        if rows is None:
            raise SpecbenchError(f"session {session!r} keeps no features: it was prefilled before a draft head "
                                 f"asked for them (keep_features)")
        return rows

    def close(self, session: str) -> None:
        self.featured.discard(session)
        state = self.sessions.pop(session, None)
        if state is not None and self.fast is not None:
            self.fast.forget(state.cache)

    def committed(self, session: str) -> list[int]:
        return list(self.state(session).committed)

    def state(self, session: str) -> SessionState:
        try:
            return self.sessions[session]
        except KeyError:
            raise UnknownSessionError(f"unknown session {session!r}; call prefill first") from None

    def check_context(self, length: int) -> None:
        if self.max_context and length > self.max_context:
            raise SpecbenchError(
                f"sequence of {length} tokens exceeds the target's context of {self.max_context}")

    @torch.inference_mode()
    def forward(self, state: SessionState, inputs: list[int], position_ids, attention_mask,
                 logits_to_keep: int = 0) -> torch.Tensor:
        """Logits [len(inputs), vocab_size] (or the last `logits_to_keep` rows) for `inputs` appended
        to the session's cache; prefill keeps one row, since a vocab-wide row per prompt token is waste."""
        if self.fast is not None:
            return self.fast(state.cache, inputs, position_ids, attention_mask, logits_to_keep)
        input_ids = torch.tensor([inputs], device=self.device)
        output = self.model(input_ids=input_ids, past_key_values=state.cache, position_ids=position_ids,
                            attention_mask=attention_mask, use_cache=True, logits_to_keep=logits_to_keep)
        return output.logits[0]
