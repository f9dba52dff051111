"""Token sampling for a batch of rows, each with its own settings and random stream.

Legend: R rows, V vocabulary. A seeded row draws its noise from its own torch.Generator, so its text
depends only on its seed, never on what it is batched with. Greedy rows are one argmax; log-probabilities
are computed only for rows that asked for them, from the model's logits (before any penalty or bias, as
vLLM reports them by default). A row whose settings cannot be sampled fails alone: the others are sampled
as if it were not there.

Order per row, as in vLLM: a structured output's grammar mask (tokens its grammar cannot take next are
impossible), logit_bias, min_tokens (EOS and stop_token_ids masked), repetition penalty
(prompt and output tokens), presence and frequency penalties (output tokens), then temperature, top-k,
top-p and min-p for sampled rows.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from moe_serve.engine.grammar import token_bitmask
from moe_serve.engine.sequence import Sequence
from moe_serve.kernels import ops


@dataclass(slots=True)
class Sampled:
    """One entry per row: its token, or its error."""

    token_ids: list[int | None] = field(default_factory=list)  # None: this row failed (see errors)
    logprobs: list[float | None] = field(default_factory=list)  # of the chosen token, for rows that asked
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    errors: dict[int, BaseException] = field(default_factory=dict)


def sample(
    logits: torch.Tensor | None,
    seqs: list[Sequence],
    eos_token_ids: Collection[int] = (),
    greedy: torch.Tensor | None = None,
) -> Sampled:
    """logits [R, V] fp32 -> one token per row (and its log-probability where asked for). No rows (a step
    that only prefills, scores or classifies: logits None): an empty result. `greedy`: each row's argmax of
    these logits where the caller has it (ops.greedy_rows), which greedy rows keep unless a row's logits
    are adjusted (a grammar, a bias, a penalty)."""
    if not seqs:
        return Sampled()
    assert logits is not None and logits.shape[0] == len(seqs), "one row of logits per sequence to sample"
    masks = _grammar_masks(logits, seqs)
    try:
        adjusted = _adjusted(logits, seqs, eos_token_ids, masks)
        chosen = _choose(adjusted, seqs, greedy if adjusted is logits else None)
        errors: dict[int, BaseException] = {}
    except Exception:  # one row's settings (an absurd top_k, say): sample row by row to find it
        chosen, errors = _choose_rows_apart(logits, seqs, eos_token_ids, masks)
    token_ids: list[int | None] = chosen.tolist()
    for row in errors:
        token_ids[row] = None
    out = Sampled(token_ids, [None] * len(seqs), [{} for _ in seqs], errors)
    wanted = [r for r, s in enumerate(seqs) if s.params.logprobs is not None and r not in errors]
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        logprobs = torch.log_softmax(logits[rows], dim=-1)  # [W, V]
        picked = logprobs.gather(1, chosen[rows][:, None])[:, 0].tolist()
        most = max(seqs[r].params.logprobs or 0 for r in wanted)
        values, ids = logprobs.topk(most, dim=-1) if most else (None, None)
        for i, row in enumerate(wanted):
            out.logprobs[row] = picked[i]
            n = seqs[row].params.logprobs or 0
            if n:
                out.top_logprobs[row] = dict(zip(ids[i, :n].tolist(), values[i, :n].tolist(), strict=True))  # type: ignore[index]
    return out


@dataclass(slots=True)
class GrammarMasks:
    """The grammar masks of a step's constrained rows (computed once a step, whatever happens to the others):
    `rows` their indices among the step's rows, `bitmask` one row of llguidance's bitmask each."""

    rows: list[int]
    bitmask: torch.Tensor | None = None

    def only(self, row: int) -> GrammarMasks:
        """The mask of one row, as row 0 (for sampling it alone)."""
        if row not in self.rows:
            return GrammarMasks([])
        assert self.bitmask is not None
        return GrammarMasks([0], self.bitmask[self.rows.index(row)][None])

    def apply(self, logits: torch.Tensor) -> None:
        if self.bitmask is not None:
            ops.mask_logits(logits, torch.tensor(self.rows, device=logits.device), self.bitmask)


def _grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> GrammarMasks:
    rows = [r for r, s in enumerate(seqs) if s.matcher is not None]
    if not rows:
        return GrammarMasks([])
    return GrammarMasks(rows, token_bitmask([seqs[r].matcher for r in rows], logits.shape[-1]))  # type: ignore[misc]


def _adjusted(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int], masks: GrammarMasks
) -> torch.Tensor:
    """The logits with the grammar masks, and each row's bias, min_tokens and penalties, applied (a copy, only
    if a row has any)."""
    rows = [r for r, s in enumerate(seqs) if s.params.adjusts_logits]
    if not rows and not masks.rows:
        return logits
    logits = logits.clone()
    masks.apply(logits)
    for row in rows:
        _adjust_row(logits[row], seqs[row], eos_token_ids)
    return logits


def _adjust_row(logits: torch.Tensor, seq: Sequence, eos_token_ids: Collection[int]) -> None:
    params, device = seq.params, logits.device
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=device)
        logits.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), device=device))
    output = seq.token_ids[seq.num_prompt_tokens :]
    if len(output) < params.min_tokens:
        banned = [*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]
        if banned:
            logits[torch.tensor(banned, device=device)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(seq.token_ids, device=device).unique()
        values = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=device), minlength=logits.shape[-1])[: logits.shape[-1]]
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _choose(logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None = None) -> torch.Tensor:
    chosen = logits.argmax(dim=-1) if greedy is None else greedy.clone()  # [R] greedy rows keep this
    sampled = [r for r, s in enumerate(seqs) if not s.params.is_greedy]
    if not sampled:
        return chosen
    device = logits.device
    rows = torch.tensor(sampled, device=device)
    params = [seqs[r].params for r in sampled]
    temperature = torch.tensor([p.temperature for p in params], device=device)  # [S]
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    scaled = logits[rows] / temperature.clamp(min=1e-5)[:, None]
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [S, V]
    rank = torch.arange(logits.shape[-1], device=device)[None, :]
    sorted_logits = sorted_logits.masked_fill((top_k[:, None] > 0) & (rank >= top_k[:, None]), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Nucleus: drop a token once the mass before it already exceeds top_p (the first always stays).
    drop = (torch.cumsum(probs, dim=-1) - probs) > top_p[:, None]
    # Min-p: drop a token less likely than min_p times the most likely one (sorted: the first).
    drop |= probs < min_p[:, None] * probs[:, :1]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    noise = torch.stack([_exponential(logits.shape[-1], seqs[r].generator, device) for r in sampled])  # [S, V]
    # argmax(p / Exp(1)) draws from p (the exponential-race form of Gumbel-max), one noise vector per row.
    pick = (probs / noise.gather(1, sorted_ids)).argmax(dim=-1)
    chosen[rows] = sorted_ids.gather(1, pick[:, None])[:, 0]
    return chosen


def _choose_rows_apart(
    logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int], masks: GrammarMasks
) -> tuple[torch.Tensor, dict[int, BaseException]]:
    chosen = logits.argmax(dim=-1)
    errors: dict[int, BaseException] = {}
    for row, seq in enumerate(seqs):
        try:
            one = _adjusted(logits[row : row + 1], [seq], eos_token_ids, masks.only(row))
            chosen[row] = _choose(one, [seq])[0]
        except Exception as exc:
            errors[row] = exc
    return chosen, errors


def _exponential(size: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    return torch.empty(size, device=device).exponential_(generator=generator)
