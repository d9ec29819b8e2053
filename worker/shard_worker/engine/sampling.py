"""Choosing the next tokens of a batch on the logits' device: greedy, temperature, min_p, top_k,
top_p, presence/frequency/repetition penalties and logit_bias, each row with its own parameters.

`Sampler` keeps per-row parameters as device tensors (uploaded once when a row changes, never per
step) and, only when a row asks for penalties, per-row token counts on the device. `sample` never
synchronises with the host: it returns device tensors, and `Sampled.to_host` is the step's one
device-to-host copy (the tokens, and the log-probabilities when a row asked for them); on a CUDA
rank it lands in pinned host memory (`HostStaging`): one asynchronous DMA the host then waits for,
instead of a copy through a pageable bounce buffer.

Randomness is counter-based: a row's draw at its t-th token is a hash of (seed, t, token id), an
exponential race (`argmax(log p + Gumbel)`, the Gumbel-max trick) over the kept tokens. So a seed
repeats on any device and any batch (the row's neighbours, its place in the batch and the batch's
size change nothing), every TP rank of the last stage picks the same token without exchanging it,
and one batched kernel chain serves every row (a torch.Generator per row would cost a launch a row).

Order, as vLLM's: logit_bias and the penalties change the logits (repetition over the prompt and
the generated tokens, presence and frequency over the generated ones); temperature; then min_p,
top_k and top_p keep the most likely tokens (each on what the one before kept). Greedy rows take the
argmax of the changed logits. Reported log-probabilities are the model's own (log-softmax of the
raw logits, in float32), as OpenAI's and vLLM's are.

Numerically safe over every accepted value: the work is in float64 on logits shifted so that the
most likely token's is 0, so a temperature of 1e-40 still gives a distribution (its limit: the most
likely tokens alone), top_p 1e-300 keeps the most likely token, and a penalty that overflows a
logit clamps it to float64's range. A sampled row whose logits are not finite gets FAILED (and every
sampling rank meets the same): the first stage ends that sequence alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shard_contract.wire import MAX_LOGPROBS, GenerateRequest

from ..log import first_line
from ..model.pinned import PinnedArena, arena_bytes
from . import grammar

FAILED = -1  # the token of a row whose sampling failed
NOT_FINITE = "choosing its next token failed: the model's logits for this sequence are not finite"
NO_TOKEN = "choosing its next token failed: its response_format allowed no token"

_MASK = 0xFFFFFFFF
_F64_MAX = torch.finfo(torch.float64).max

# Per-row float parameters, as the columns of one tensor (one upload for all).
_TEMP, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(6)
# Per-row integer parameters.
_TOP_K, _SEED_LO, _SEED_HI = range(3)
# The largest top_k kept as it is: the API and the contract take any k >= 0, and a k past int64
# could not be placed (torch.tensor overflows), which took down every sampling rank of a group
# (the last stage's: all followers under pipeline parallelism). Any k from the vocabulary's size
# on keeps every token, so larger ones are this one.
TOP_K_ALL = 2**31 - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32's shape) on int64 lanes holding [0, 2^32). The multipliers
    are below 2^31, so no product overflows int64 (signed overflow is undefined in C++)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x6B43A9B5) & _MASK
    return x ^ (x >> 16)


def gumbel(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [rows, vocab] (float64): a pure function of each row's seed (two 32-bit halves)
    and step, and of the token id."""
    row = _mix(_mix(_mix(seed_lo) ^ seed_hi) ^ (step & _MASK))[:, None]
    ids = _mix(torch.arange(vocab, device=step.device, dtype=torch.int64) * 0x9E3779B1 & _MASK)[None, :]
    h = _mix(_mix(row ^ ids) ^ (row >> 7))
    return (-torch.log(-torch.log(uniform(h)))).double()


def uniform(h: torch.Tensor) -> torch.Tensor:
    """Hashes [0, 2^32) as float32 in (0, 1), never 0 or 1: 23 bits plus a half, exact in float32
    (24 bits plus a half rounded the top value to 1.0, whose noise is +inf: a masked token's
    -inf + inf is NaN, which argmax takes, so a JSON schema's row drew a token its grammar
    refused). float32 because torch's CPU log is vectorised in float32 and some 40 times slower in
    float64 (17 ms at a 32k vocabulary)."""
    return ((h >> 9).float() + 0.5) * 2.0 ** -23


class HostStaging:
    """Pinned host memory where a CUDA rank's step copy lands: as many 8-byte values as the largest
    packed step of `rows` rows (token, its log-probability, MAX_LOGPROBS alternatives and theirs),
    and `rows` token ids on their way back to the device (`upload`: the next step's inputs, on a
    first stage that is not the one that sampled them, or that sampled on the host). One per
    device for the process's life (`staging_for`): pinning registers memory with CUDA, and each
    generate makes a new Sampler."""

    COLUMNS = 2 + 2 * MAX_LOGPROBS

    def __init__(self, rows: int, pin: bool = True, cudart: Any = None):
        self.rows = rows
        self.arena = PinnedArena(arena_bytes([(rows * self.COLUMNS * 8,), (rows * 8,)], torch.uint8), pin=pin,
                                 cudart=cudart)
        self.bytes = self.arena.take((rows * self.COLUMNS * 8,), torch.uint8)
        self.ids = self.arena.take((rows,), torch.int64)
        self._uploaded: Any = None  # the event after the last upload from `ids` (CUDA)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (8-byte values, at most `rows` x COLUMNS) copied into the pinned memory, the copy
        waited for: a contiguous view, valid until the next copy."""
        out = self.bytes[:t.numel() * 8].view(t.dtype).view(t.shape)
        out.copy_(t, non_blocking=True)
        if t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()
        return out

    def upload(self, tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Host int64 `tokens` (at most `rows`) on `device`, through the pinned memory: an
        asynchronous DMA (from pageable memory a copy waits for the host to stage it). The host
        waits only for the previous upload to have left the pinned memory before it rewrites it."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        staged = self.ids[:tokens.numel()].view(tokens.shape)
        staged.copy_(tokens)
        out = staged.to(device, non_blocking=True)
        if device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
        return out


_STAGING: dict[torch.device, HostStaging] = {}


def staging_for(device: torch.device, rows: int) -> HostStaging | None:
    """The process's pinned landing memory for `device` (None off CUDA), grown to `rows`."""
    if device.type != "cuda":
        return None
    held = _STAGING.get(device)
    if held is None or held.rows < rows:
        if held is not None:
            torch.cuda.synchronize(device)  # no copy may still be landing in the old one
            held.arena.close()
        held = _STAGING[device] = HostStaging(rows)
    return held


@dataclass
class Sampled:
    """One sampling step's results, on the logits' device. tokens [rows] (FAILED where a row
    failed); with logprobs, the chosen tokens' [rows] and the `top` most likely [rows, top].
    `staging`: the pinned memory the host copy lands in (a CUDA rank's)."""

    tokens: torch.Tensor
    logprob: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    staging: HostStaging | None = None

    def to_host(self) -> HostSampled:
        """Everything, in one device-to-host copy."""
        if self.logprob is None:
            return HostSampled(self._host(self.tokens).tolist())
        assert self.top_ids is not None and self.top_logprobs is not None
        top = self.top_ids.shape[1]
        # float64 holds every token id exactly.
        packed = self._host(torch.cat([self.tokens.double()[:, None], self.logprob.double()[:, None],
                                       self.top_ids.double(), self.top_logprobs.double()], dim=1))
        return HostSampled([int(t) for t in packed[:, 0].tolist()], packed[:, 1].tolist(),
                           [list(zip((int(i) for i in ids), lps, strict=True)) for ids, lps in
                            zip(packed[:, 2:2 + top].tolist(), packed[:, 2 + top:].tolist(), strict=True)])

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return self.staging.copy(t) if self.staging is not None else t.cpu()


@dataclass
class HostSampled:
    tokens: list[int]
    logprob: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None


class Sampler:
    """The sampling state of `capacity` rows: each row's parameters (set by `place`) and, for rows
    with penalties, which tokens its prompt holds and how often it generated each token."""

    def __init__(self, capacity: int, grammars: Callable[[], grammar.Grammars | None] = lambda: None):
        self.capacity, self.grammars = capacity, grammars
        self._mask: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's grammar mask
        self.matchers: dict[int, Any] = {}  # row -> llguidance matcher, for rows with a json_schema
        self.why: dict[int, str] = {}  # row -> why its sampling failed, for reasons other than NOT_FINITE
        self.requests: list[GenerateRequest | None] = [None] * capacity
        self._floats = torch.zeros(capacity, 6, dtype=torch.float64)  # host copies, uploaded when changed
        self._floats[:, _TOP_P] = self._floats[:, _REPETITION] = 1.0
        self._ints = torch.zeros(capacity, 3, dtype=torch.int64)
        self._bias: dict[int, dict[int, float]] = {}
        self._dirty = True
        self._device: torch.device | None = None
        self._staging: HostStaging | None = None
        self._dev_floats = self._dev_ints = torch.empty(0)
        self._dev_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.steps = torch.zeros(capacity, dtype=torch.int64)  # tokens each row has drawn
        self.counts: torch.Tensor | None = None  # [capacity, V] int32, once a row has penalties
        self.in_prompt: torch.Tensor | None = None  # [capacity, V] bool
        self._pending_prompts: dict[int, list[int]] = {}
        # per row: the tokens its sequence generated before a preemption, which end its prompt now
        # (its draws go on from the next count, and its penalties count them as generated)
        self.generated: list[list[int]] = [[] for _ in range(capacity)]

    def place(self, row: int, request: GenerateRequest, generated: int = 0) -> None:
        """Row `row` samples for `request` from its next token on; the last `generated` tokens of
        its prompt are the ones its sequence generated before it was preempted and recomputed, so
        a seed draws what it would have drawn without the preemption."""
        self.requests[row] = request
        self.generated[row] = list(request.prompt_ids[len(request.prompt_ids) - generated:]) if generated else []
        self._floats[row] = torch.tensor([request.temperature, request.top_p, request.min_p,
                                          request.presence_penalty, request.frequency_penalty,
                                          request.repetition_penalty], dtype=torch.float64)
        seed = request.seed & 0xFFFFFFFFFFFFFFFF  # two's complement: every signed 64-bit seed
        self._ints[row] = torch.tensor([min(request.top_k, TOP_K_ALL), seed & _MASK, seed >> 32], dtype=torch.int64)
        self._bias.pop(row, None)
        if request.logit_bias:
            self._bias[row] = dict(request.logit_bias)
        self._pending_prompts[row] = list(request.prompt_ids) if _penalised(request) else []
        self._dirty = True
        self.matchers.pop(row, None)
        self.why.pop(row, None)
        if request.json_schema is not None:
            try:
                grammars = self.grammars()
                if grammars is None:
                    raise ValueError("response_format needs the model's tokenizer.json")
                self.matchers[row] = grammars.matcher(request.json_schema)
                for token in self.generated[row]:
                    self.matchers[row].consume_token(token)
            except Exception as err:  # noqa: BLE001 -- this request fails alone, at its first token
                self.matchers[row] = None
                self.why[row] = f"choosing its next token failed: {first_line(err)}"

    def greedy(self, row: int) -> None:
        """Row `row` is greedy from now on (its sequence failed; what it gets goes unused)."""
        self._floats[row, _TEMP] = 0.0
        self._dirty = True
        self.matchers.pop(row, None)

    def accept(self, r0: int, tokens: Sequence[int]) -> None:
        """The host learnt the tokens of rows from r0: each constrained row's matcher takes its own."""
        for i, token in enumerate(tokens):
            matcher = self.matchers.get(r0 + i)
            if matcher is not None and token >= 0:
                matcher.consume_token(token)

    def failures(self, tokens: Sequence[int], r0: int = 0) -> dict[int, str]:
        """The rows (from r0) whose token came back FAILED, with why."""
        return {r0 + i: self.why.get(r0 + i, NOT_FINITE) for i, t in enumerate(tokens) if t == FAILED}

    # ------------------------------------------------------------ device state
    def _sync(self, device: torch.device, vocab: int) -> None:
        if self._device != device:
            self._device, self._dirty = device, True
            self._staging = staging_for(device, self.capacity)
            self.steps = self.steps.to(device)
            self.counts = self.in_prompt = None
            self._pending_prompts = {r: list(q.prompt_ids) for r, q in enumerate(self.requests)
                                     if q is not None and _penalised(q)}
        if not self._dirty:
            return
        self._dev_floats = self._floats.to(device)
        self._dev_ints = self._ints.to(device)
        for row in self._pending_prompts:
            self.steps[row] = len(self.generated[row])
        if any(self._pending_prompts.values()) and self.counts is None:
            self.counts = torch.zeros(self.capacity, vocab, dtype=torch.int32, device=device)
            self.in_prompt = torch.zeros(self.capacity, vocab, dtype=torch.bool, device=device)
        if self.counts is not None and self.in_prompt is not None:
            for row, prompt in self._pending_prompts.items():
                self.counts[row].zero_()
                self.in_prompt[row].zero_()
                ids = torch.tensor([t for t in prompt if 0 <= t < vocab], dtype=torch.int64)
                self.in_prompt[row, ids.to(device)] = True
                for token in self.generated[row]:  # a recomputed sequence's, generated before
                    if 0 <= token < vocab:
                        self.counts[row, token] += 1
        self._pending_prompts = {}
        entries = [(r, t, v) for r, bias in self._bias.items() for t, v in bias.items() if t < vocab]
        self._dev_bias = None
        if entries:
            rows, toks, vals = zip(*entries, strict=True)
            self._dev_bias = (torch.tensor(rows, device=device), torch.tensor(toks, device=device),
                              torch.tensor(vals, dtype=torch.float64, device=device))
        self._dirty = False

    # ------------------------------------------------------------ a step
    def sample(self, logits: torch.Tensor, r0: int = 0) -> Sampled:
        """The next tokens of rows [r0, r0 + len(logits)) from their logits [rows, V]; no host sync."""
        n, vocab = logits.shape
        self._sync(logits.device, vocab)
        reqs = self.requests[r0:r0 + n]
        live = [q for q in reqs if q is not None]
        top = max((q.logprobs for q in live if q.logprobs is not None), default=None)
        sampled = any(q.temperature > 0 for q in live)
        constrained = [r for r in range(r0, r0 + n) if r in self.matchers]
        changed = any(_penalised(q) or q.logit_bias for q in live) or bool(constrained)
        if not sampled and not changed:
            tokens = logits.argmax(dim=-1)
        else:
            self._mask = self._grammar_mask(logits, r0, n) if constrained else None
            tokens = self._choose(logits, r0, n, sampled, changed)
            if self._mask is not None:
                tokens = torch.where(self._mask[1], FAILED, tokens)
        self.steps[r0:r0 + n] += 1
        if self.counts is not None:
            self.counts[r0:r0 + n].scatter_add_(1, tokens.clamp(min=0)[:, None],
                                                 torch.ones(n, 1, dtype=torch.int32, device=logits.device))
        if top is None:
            return Sampled(tokens, staging=self._staging)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, tokens.clamp(min=0)[:, None])[:, 0]
        top = min(top, vocab)
        top_lp, top_ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], tokens[:, None][:, :0])
        return Sampled(tokens, chosen, top_ids, top_lp, self._staging)

    def _grammar_mask(self, logits: torch.Tensor, r0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The constrained rows' allowed tokens [rows, V] on the device, and which rows have none
        (one host-to-device copy of the bitmask)."""
        vocab = logits.shape[1]
        bitmask = torch.empty(n, (vocab + 31) // 32, dtype=torch.int32)
        matchers = [self.matchers.get(r0 + i) for i in range(n)]
        empty = grammar.fill(matchers, bitmask)
        empty += [i for i, m in enumerate(matchers) if m is None and r0 + i in self.matchers]  # never built
        for i in empty:
            self.why.setdefault(r0 + i, NO_TOKEN)
        stuck = torch.zeros(n, dtype=torch.bool)
        stuck[empty] = True
        return grammar.allowed(bitmask.to(logits.device), vocab), stuck.to(logits.device)

    def _choose(self, logits: torch.Tensor, r0: int, n: int, sampled: bool, changed: bool) -> torch.Tensor:
        x, scaled, keep = self._prepare(logits, r0, n, changed, filtered=sampled)
        greedy_tokens = x.argmax(dim=-1)
        if not sampled:
            return greedy_tokens
        ints = self._dev_ints[r0:r0 + n]
        noise = gumbel(ints[:, _SEED_LO], ints[:, _SEED_HI], self.steps[r0:r0 + n], x.shape[1])
        drawn = torch.where(keep, scaled + noise, -torch.inf).argmax(dim=-1)
        greedy = self._dev_floats[r0:r0 + n, _TEMP] <= 0
        tokens = torch.where(greedy, greedy_tokens, drawn)
        bad = ~torch.isfinite(logits).all(dim=-1) & ~greedy
        return torch.where(bad, FAILED, tokens)

    def _prepare(self, logits: torch.Tensor, r0: int, n: int, changed: bool,
                 filtered: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The changed logits (float64), those shifted to a maximum of 0 and divided by the
        temperature (1 for greedy rows), and which tokens a sampled row may draw."""
        floats, ints = self._dev_floats[r0:r0 + n], self._dev_ints[r0:r0 + n]
        x = logits.double()
        if changed:
            x = self._penalise(x, floats, r0, n)
        mask = self._mask
        if mask is not None:  # a row with no allowed token keeps its logits: it fails, without NaN
            x = torch.where(mask[0] | mask[1][:, None], x, -torch.inf)
        temp = floats[:, _TEMP]
        scaled = (x - x.max(dim=-1, keepdim=True).values) / torch.where(temp <= 0, 1.0, temp)[:, None]
        keep = self._keep(scaled, floats, ints, r0, n) if filtered else torch.ones_like(scaled, dtype=torch.bool)
        return x, scaled, keep

    def probabilities(self, logits: torch.Tensor, r0: int = 0) -> torch.Tensor:
        """The distribution [rows, V] (float64) that rows [r0, r0 + len(logits)) would draw their
        next token from (for a greedy row: its temperature-1 distribution). Changes nothing."""
        n, vocab = logits.shape
        self._sync(logits.device, vocab)
        constrained = any(r in self.matchers for r in range(r0, r0 + n))
        self._mask = self._grammar_mask(logits, r0, n) if constrained else None
        _, scaled, keep = self._prepare(logits, r0, n, changed=True, filtered=True)
        probs = torch.where(keep, scaled.exp(), 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)

    def _penalise(self, x: torch.Tensor, floats: torch.Tensor, r0: int, n: int) -> torch.Tensor:
        if self._dev_bias is not None:
            rows, toks, vals = self._dev_bias
            inside = (rows >= r0) & (rows < r0 + n)
            # Rows outside this unit get a bias of 0 at row 0: no host sync to select them.
            x = x.index_put((torch.where(inside, rows - r0, 0), toks), torch.where(inside, vals, 0.0),
                            accumulate=True)
        if self.counts is not None and self.in_prompt is not None:
            counts = self.counts[r0:r0 + n].double()
            seen = self.in_prompt[r0:r0 + n] | (counts > 0)
            rep = floats[:, _REPETITION, None]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
            x = x - floats[:, _FREQUENCY, None] * counts - floats[:, _PRESENCE, None] * (counts > 0)
        # A penalty may push a float32-range logit past float64's (say 3e38 / 1e-300): clamp, so
        # the row still has a most likely token and never inf - inf.
        return x.clamp(-_F64_MAX, _F64_MAX) if self.counts is not None else x

    def _keep(self, scaled: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor, r0: int,
              n: int) -> torch.Tensor:
        """Which tokens each row may draw: all, or what min_p, top_k and top_p keep (the most
        likely token always)."""
        live = [q for q in self.requests[r0:r0 + n] if q is not None]
        if not any(q.top_p < 1.0 or q.top_k > 0 or q.min_p > 0 for q in live):
            return torch.ones_like(scaled, dtype=torch.bool)
        probs = scaled.exp()  # the most likely token's is exp(0) = 1: the sum is never 0 or inf
        probs = probs / probs.sum(dim=-1, keepdim=True)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        vocab = scaled.shape[1]
        position = torch.arange(vocab, device=scaled.device)[None, :]
        top_k = torch.where(ints[:, _TOP_K] > 0, ints[:, _TOP_K], vocab)[:, None]
        kept = (sorted_probs >= floats[:, _MIN_P, None] * sorted_probs[:, :1]) & (position < top_k)
        sorted_probs = torch.where(kept, sorted_probs, 0.0)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # the mass of the more likely kept tokens
        top_p = floats[:, _TOP_P, None]
        kept &= (before < top_p * sorted_probs.sum(dim=-1, keepdim=True)) | (top_p >= 1.0)
        kept[:, 0] = True
        return torch.zeros_like(kept).scatter_(1, order, kept)


def _penalised(request: GenerateRequest) -> bool:
    return request.presence_penalty != 0 or request.frequency_penalty != 0 or request.repetition_penalty != 1

