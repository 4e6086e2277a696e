"""Baseline uncertainty scores people already use, each usable on its own.

Every score follows guarduq's convention: **higher = more uncertain**.

From the one forward pass guarduq already makes (read off
:class:`~guarduq.scoring.uncertainty.Scores`, never recomputed):

* ``max_prob``: the maximum-sequence-probability baseline, −log p(y|x) = −Σ_t log p_t.
* ``perplexity``: log-perplexity, −(1/T) Σ_t log p_t (monotone in perplexity, so same AUROC).
* ``mean_entropy``: mean over response positions of the entropy of the next-token distribution.

Needing more model calls:

* ``p_true`` (Kadavath et al., 2022): show the model the question and the proposed answer, ask
  whether it is true, and read P("True"/"Yes") normalised against P("False"/"No"). Score = 1 − that.
* ``consistency``: draw K sampled answers and count how many agree with the answer under test
  after SQuAD normalisation. Score = 1 − agreement. This is the cheap relative of semantic
  entropy (Kuhn et al., 2023): exact agreement after normalisation stands in for clustering the
  samples by bidirectional entailment, so paraphrases count as disagreement.

Build one with :func:`make_baseline` (a plain string key, YAML friendly). ``score`` takes any
object with ``model``, ``tokenizer`` and ``score(prompt, response, ended=...)`` (a ``Guard``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch

from guarduq import layout
from guarduq.answers import normalize_answer
from guarduq.errors import InputError, ScoringError
from guarduq.layout import PromptLike
from guarduq.scoring.uncertainty import Scores, model_lock


class ModelHolder(Protocol):
    """What a baseline needs (``guarduq.Guard`` satisfies it)."""

    model: Any
    tokenizer: Any

    def score(self, prompt: Any, response: str, *, ended: bool = True) -> Scores: ...


class Baseline(ABC):
    """One uncertainty score for a (prompt, response) pair; higher = more uncertain."""

    name: ClassVar[str]

    @abstractmethod
    def score(
        self,
        guard: ModelHolder,
        prompt: PromptLike,
        response: str,
        *,
        scores: Scores | None = None,
        ended: bool = True,
    ) -> float:
        """``scores``: guarduq's scores for this pair when already computed (saves a pass)."""


# --------------------------------------------------------------------------- from Scores


class _FromScores(Baseline):
    """Baselines that are a function of guarduq's one forward pass: free when ``scores`` is given."""

    def score(
        self,
        guard: ModelHolder,
        prompt: PromptLike,
        response: str,
        *,
        scores: Scores | None = None,
        ended: bool = True,
    ) -> float:
        if scores is None:
            scores = guard.score(prompt, response, ended=ended)
        return self.from_scores(scores)

    def from_scores(self, scores: Scores) -> float:
        """NaN for scores marked invalid: never a made-up number."""
        return self._compute(scores) if scores.valid else math.nan

    @abstractmethod
    def _compute(self, scores: Scores) -> float: ...


class MaxProbability(_FromScores):
    """−log p(y|x): the negative log-probability of the whole response."""

    name = "max_prob"

    def _compute(self, scores: Scores) -> float:
        return -scores.mean_logprob * scores.n_tokens


class Perplexity(_FromScores):
    """Log-perplexity −(1/T) Σ log p_t: length-normalised, unlike ``max_prob``."""

    name = "perplexity"

    def _compute(self, scores: Scores) -> float:
        return -scores.mean_logprob


class MeanEntropy(_FromScores):
    """Mean entropy (nats) of the next-token distribution over the response positions."""

    name = "mean_entropy"

    def _compute(self, scores: Scores) -> float:
        return scores.mean_entropy


# --------------------------------------------------------------------------- P(True)

P_TRUE_TEMPLATE = (
    "Question: {question}\n"
    "Proposed answer: {answer}\n"
    "Is the proposed answer true or false? Reply with one word: True or False.\n"
    "Answer:"
)
TRUE_WORDS: tuple[str, ...] = ("True", "true", "Yes", "yes")
FALSE_WORDS: tuple[str, ...] = ("False", "false", "No", "no")


def p_true_prompt(question: str, answer: str, template: str = P_TRUE_TEMPLATE) -> str:
    """The self-evaluation prompt: the question, the proposed answer, a True/False question."""
    if not isinstance(question, str) or not question.strip():
        raise InputError("P(True) needs a non-empty question")
    if not isinstance(answer, str) or not answer.strip():
        raise InputError("P(True) needs a non-empty proposed answer")
    return template.format(question=question.strip(), answer=answer.strip())


def word_variants(tokenizer: Any, words: Sequence[str]) -> list[tuple[int, ...]]:
    """Distinct token sequences for each word, bare and with a leading space.

    Chat models start their turn without a space ("True"), base models continue "Answer:" with
    one (" True"); both are counted.
    """
    seen: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word):
            ids = tuple(int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids:
                seen.setdefault(ids, None)
    return list(seen)


def continuation_logprobs(
    model: Any, prompt_ids: Sequence[int], continuations: Sequence[Sequence[int]]
) -> list[float]:
    """log p(continuation | prompt) for each continuation, forward passes only.

    One forward over the prompt serves every single-token continuation; a longer one costs one
    forward of prompt + continuation.
    """
    device = next(model.parameters()).device
    out: list[float] = []
    with model_lock(model), torch.no_grad():
        was_training = model.training
        model.eval()
        try:
            ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
            last = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), -1)
            for cont in continuations:
                if len(cont) == 1:
                    out.append(float(last[cont[0]]))
                    continue
                full = torch.tensor([list(prompt_ids) + list(cont)], dtype=torch.long, device=device)
                logits = model(input_ids=full).logits[0, len(prompt_ids) - 1 : -1].double()
                lp = torch.log_softmax(logits, -1)
                target = torch.tensor(cont, device=device).unsqueeze(-1)
                out.append(float(lp.gather(-1, target).sum()))
        finally:
            model.train(was_training)
    return out


def true_probability(true_logprobs: Sequence[float], false_logprobs: Sequence[float]) -> float:
    """P(true) = Σ p_true / (Σ p_true + Σ p_false), computed in log space."""
    if not true_logprobs or not false_logprobs:
        raise ScoringError("P(True) needs at least one 'true' and one 'false' continuation")
    lt = torch.logsumexp(torch.tensor(list(true_logprobs), dtype=torch.float64), 0)
    lf = torch.logsumexp(torch.tensor(list(false_logprobs), dtype=torch.float64), 0)
    return float(torch.sigmoid(lt - lf))


class PTrue(Baseline):
    """1 − P(True): the model's own doubt about the proposed answer.

    ``prompt`` must be the question as a string (the same one the answer responds to); for a
    few-shot base-model prompt pass the bare question as ``question=`` to :meth:`score`.
    """

    name = "p_true"

    def __init__(
        self,
        template: str = P_TRUE_TEMPLATE,
        true_words: Sequence[str] = TRUE_WORDS,
        false_words: Sequence[str] = FALSE_WORDS,
    ) -> None:
        self.template = template
        self.true_words = tuple(true_words)
        self.false_words = tuple(false_words)

    def score(
        self,
        guard: ModelHolder,
        prompt: PromptLike,
        response: str,
        *,
        scores: Scores | None = None,
        ended: bool = True,
        question: str | None = None,
    ) -> float:
        if question is None:
            if not isinstance(prompt, str):
                raise InputError("P(True) needs the question as a string (pass question=...)")
            question = prompt
        return 1.0 - self.true_prob(guard, question, response)

    def true_prob(self, guard: ModelHolder, question: str, answer: str) -> float:
        tok = guard.tokenizer
        ids = layout.prompt_ids(tok, p_true_prompt(question, answer, self.template))
        layout.check_fits(guard.model, len(ids) + 1)
        yes = word_variants(tok, self.true_words)
        no = word_variants(tok, self.false_words)
        shared = set(yes) & set(no)
        yes, no = [s for s in yes if s not in shared], [s for s in no if s not in shared]
        lps = continuation_logprobs(guard.model, ids, yes + no)
        return true_probability(lps[: len(yes)], lps[len(yes) :])


# --------------------------------------------------------------------------- consistency


def token_f1(a: str, b: str) -> float:
    """SQuAD token F1 between two answers, after SQuAD normalisation (0 if either is empty)."""
    ta, tb = normalize_answer(a).split(), normalize_answer(b).split()
    common = sum((Counter(ta) & Counter(tb)).values())
    if not ta or not tb or common == 0:
        return 0.0
    precision, recall = common / len(tb), common / len(ta)
    return 2 * precision * recall / (precision + recall)


AGREEMENT_MATCHES = ("exact", "f1")


def _check_match(match: str) -> None:
    if match not in AGREEMENT_MATCHES:
        raise InputError(f"match must be one of {AGREEMENT_MATCHES}, got {match!r}")


def agreement(
    reference: str, samples: Sequence[str], *, match: str = "exact", f1_threshold: float = 0.5
) -> float:
    """Fraction of ``samples`` that agree with ``reference``.

    ``match="exact"``: equal after SQuAD normalisation. ``match="f1"``: SQuAD token F1 of at
    least ``f1_threshold``, which lets sentence-long answers that say the same thing in other
    words agree. An empty normalised text agrees with nothing (two blank answers are not "the
    same answer").
    """
    if not samples:
        raise InputError("agreement needs at least one sample")
    _check_match(match)
    ref = normalize_answer(reference)
    if not ref:
        return 0.0
    if match == "f1":
        return sum(token_f1(reference, s) >= f1_threshold for s in samples) / len(samples)
    return sum(normalize_answer(s) == ref for s in samples) / len(samples)


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """The text before the first stop string (generation may run a little past it)."""
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[: min(cuts)] if cuts else text


def sample_answers(
    model: Any,
    tokenizer: Any,
    prompt: PromptLike,
    k: int,
    *,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop: Sequence[str] = (),
    seed: int | None = 0,
) -> list[str]:
    """``k`` sampled replies in one batched ``generate`` call, decoded like ``Guard.generate``.

    ``seed`` makes the draw repeatable without touching the caller's global RNG state.
    """
    if k < 1:
        raise InputError(f"k must be >= 1, got {k}")
    ids = layout.prompt_ids(tokenizer, prompt)
    layout.check_fits(model, len(ids) + max_new_tokens)
    stops_ids = layout.stop_token_ids(tokenizer)
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    gen: dict[str, Any] = {
        "do_sample": True,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": 0,
        "num_return_sequences": k,
        "max_new_tokens": max_new_tokens,
        "eos_token_id": stops_ids,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops_ids[0],
    }
    if stop:
        gen.update(stop_strings=list(stop), tokenizer=tokenizer)
    with model_lock(model), torch.no_grad(), torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        was_training = model.training
        model.eval()
        try:
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **gen
            )
        finally:
            model.train(was_training)
    texts = []
    stop_set = set(stops_ids)
    for row in out[:, len(ids) :].tolist():
        end = next((i for i, t in enumerate(row) if t in stop_set), len(row))
        text = tokenizer.decode(row[:end], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        texts.append(cut_at_stops(text, stop))
    return texts


class Consistency(Baseline):
    """1 − (fraction of K sampled answers that agree with the answer under test).

    The cheap relative of semantic entropy: agreement is exact match after SQuAD normalisation
    (``match="exact"``) or SQuAD token F1 >= 0.5 (``match="f1"``), not an entailment model, so
    it suits short answers (QA) and undercounts paraphrases.
    """

    name = "consistency"

    def __init__(
        self,
        k: int = 10,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 32,
        stop: Sequence[str] = (),
        seed: int | None = 0,
        match: str = "exact",
    ) -> None:
        if k < 1:
            raise InputError(f"k must be >= 1, got {k}")
        _check_match(match)
        self.k = k
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(stop)
        self.seed = seed
        self.match = match
        self.samples_: list[str] = []  # the last call's samples, for inspection

    def score(
        self,
        guard: ModelHolder,
        prompt: PromptLike,
        response: str,
        *,
        scores: Scores | None = None,
        ended: bool = True,
    ) -> float:
        self.samples_ = sample_answers(
            guard.model, guard.tokenizer, prompt, self.k, max_new_tokens=self.max_new_tokens,
            temperature=self.temperature, top_p=self.top_p, stop=self.stop, seed=self.seed,
        )
        return 1.0 - agreement(cut_at_stops(response, self.stop), self.samples_, match=self.match)


# --------------------------------------------------------------------------- factory

BASELINES: dict[str, type[Baseline]] = {
    cls.name: cls for cls in (MaxProbability, Perplexity, MeanEntropy, PTrue, Consistency)
}
SCORE_BASELINES = tuple(n for n, c in BASELINES.items() if issubclass(c, _FromScores))


def make_baseline(name: str, **params: Any) -> Baseline:
    """A baseline by its string key (``max_prob``, ``perplexity``, ``mean_entropy``,
    ``p_true``, ``consistency``) with its constructor parameters."""
    try:
        cls = BASELINES[name]
    except KeyError:
        raise InputError(f"unknown baseline {name!r}; choose from {sorted(BASELINES)}") from None
    try:
        return cls(**params)
    except TypeError as exc:
        raise InputError(f"bad parameters for baseline {name!r}: {exc}") from exc


def from_scores(scores: Scores) -> dict[str, float]:
    """Every baseline that guarduq's own forward pass already determines, by name."""
    return {n: BASELINES[n]().from_scores(scores) for n in SCORE_BASELINES}  # type: ignore[attr-defined]
