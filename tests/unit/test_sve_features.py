"""The SVE second opinion as calibration features (issue 24): cached beside the scores like
P(True), resumed without recomputation, equal to a direct ``second_opinion``; their cost in
forward-pass equivalents; benchmarks/risk.py's sets; and the ``--sve`` flags of the CLI."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from guarduq.calibration import Calibrator
from guarduq.calibration.datasets import Item
from guarduq.calibration.evaluation import ScoreCache, ScoredItem, add_sve_opinion
from guarduq.calibration.features import FEATURE_SETS, SVE, SVEShape, forward_equivalents
from guarduq.cli import main
from guarduq.errors import InputError
from guarduq.sve import SVEnsemble
from guarduq.sve.results import SVEOpinion
from tests.conftest import load_benchmark, make_tokenizer, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "my_logs.jsonl"

PAIRS = [("Name a colour.", "Blue", True), ("What is 2+2?", "4", False), ("Capital of France?", "Paris.", True)]


def _item(i: int, prompt: str, response: str, ended: bool, stops: tuple[str, ...] = ()) -> Item:
    return Item(id=f"q{i}", dataset="d", kind="labelled", prompt=prompt, question=prompt, grader="given",
                response=response, label=i % 2, stop_strings=stops, meta={"ended": ended})


def _record(item: Item, ended: bool | None, label: int | None = 1, **scores: Any) -> ScoredItem:
    return ScoredItem(id=item.id, dataset=item.dataset, kind=item.kind, prompt_hash=item.prompt_hash,
                      model_fingerprint="f" * 32, response=item.response, label=label,
                      scores={"valid": True, "aleatoric": 0.2, **scores}, split=item.split, ended=ended)


class Counting:
    """An ensemble that counts its second opinions (to see what a resumed run recomputes)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def second_opinion(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.second_opinion(*args, **kwargs)

    def overhead(self) -> Any:
        return self.inner.overhead()


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory: pytest.TempPathFactory) -> SVEnsemble:
    return SVEnsemble.from_model(tiny_llama(seed=0), make_tokenizer(), members=3, sigma_init=0.3,
                                 last_n_blocks=1, cache_dir=tmp_path_factory.mktemp("svd"))


# --------------------------------------------------------------------------- add_sve_opinion


def test_features_equal_a_direct_second_opinion_and_resume_without_recomputation(
    ensemble: SVEnsemble, tmp_path: Path
) -> None:
    items = [_item(i, p, r, e) for i, (p, r, e) in enumerate(PAIRS)]
    records = [_record(it, e) for it, (*_, e) in zip(items, PAIRS, strict=True)]
    records.append(_record(_item(9, "Unlabelled?", "x", True), True, label=None))  # not usable: left alone
    cache = tmp_path / "cache.jsonl"
    out = add_sve_opinion(ensemble, items, records, cache, max_new_tokens=3, ensemble_id="members-a", progress=False)

    for rec, (prompt, response, ended) in zip(out, PAIRS, strict=False):
        op = ensemble.second_opinion(prompt, response, ended=ended, max_new_tokens=3)
        s = rec.scores or {}
        assert s["sve_mean_prob"] == pytest.approx(op.mean_prob, rel=1e-12)
        assert s["sve_variance"] == pytest.approx(op.variance, rel=1e-9, abs=1e-15)
        assert s["sve_mi"] == pytest.approx(op.mutual_information, rel=1e-9, abs=1e-15)
        assert s["sve_agree"] == float(op.agrees) and s["sve_answer"] == op.answer
        assert (s["sve_members"], s["sve_targeted_blocks"], s["sve_total_blocks"]) == (3, 1, 2)
        assert s["sve_answer_tokens"] == 3 and s["sve_id"] == "members-a" and s["aleatoric"] == 0.2
        assert 0 < s["sve_mean_prob"] < 1 and s["sve_variance"] > 0
    # The reply cut short was scored without end-of-turn, as the guard scored it.
    cut = ensemble.second_opinion(PAIRS[1][0], PAIRS[1][1], ended=True)
    assert (out[1].scores or {})["sve_mean_prob"] != pytest.approx(cut.mean_prob, rel=1e-9)
    assert out[3] == records[3]

    # Read back from the cache: the last line per item holds the features; a re-run adds nothing.
    before = cache.read_bytes()
    entries = ScoreCache(cache).entries
    reread = [entries.get(r.key, r) for r in records]
    assert [r.scores for r in reread[:3]] == [r.scores for r in out[:3]]
    counting = Counting(ensemble)
    again = add_sve_opinion(counting, items, reread, cache, max_new_tokens=3, ensemble_id="members-a", progress=False)
    assert counting.calls == 0 and again == reread and cache.read_bytes() == before
    # No greedy answer asked for: what is cached serves too.
    assert add_sve_opinion(counting, items, reread, cache, max_new_tokens=0, progress=False) == reread
    assert counting.calls == 0
    # Other members (a retrained file) or another answer budget: computed again.
    add_sve_opinion(counting, items, reread, cache, max_new_tokens=3, ensemble_id="members-b", progress=False)
    assert counting.calls == 3
    add_sve_opinion(counting, items, reread, None, max_new_tokens=5, ensemble_id="members-a", progress=False)
    assert counting.calls == 6
    assert (ScoreCache(cache).entries[records[0].key].scores or {})["sve_id"] == "members-b"


class FakeEnsemble:
    """Members that answer 'Paris' and run on into a made-up next question, as a few-shot base
    model's greedy answer does; a prompt marked TOO LONG is bad input."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, str, bool, int]] = []

    def second_opinion(self, prompt: Any, response: str, *, ended: bool = True, max_new_tokens: int = 0) -> SVEOpinion:
        if "TOO LONG" in prompt:
            raise InputError("prompt is longer than the model's context")
        self.seen.append((prompt, response, ended, max_new_tokens))
        answer = "Paris\nQ: And of Italy?\nA: Rome" if max_new_tokens else None
        return SVEOpinion([0.4, 0.6], 0.5, 0.01, 0.2, agrees=True if answer else None, answer=answer, n_tokens=2)

    def overhead(self) -> Any:
        return SimpleNamespace(members=2, targeted_blocks=1, total_blocks=4)


def test_fewshot_agreement_is_cut_at_the_stop_string_and_bad_input_is_skipped() -> None:
    stops = ("\n",)
    items = [_item(0, "Q: Capital of France?\nA:", " Paris\n", False, stops),
             _item(1, "Q: Capital of Italy?\nA:", " Rome\n", False, stops),
             _item(2, "TOO LONG", "x", True)]
    records = [_record(items[0], None), _record(items[1], False), _record(items[2], True)]
    fake = FakeEnsemble()
    out = add_sve_opinion(fake, items, records, max_new_tokens=8, progress=False)
    assert [(out[i].scores or {})["sve_agree"] for i in (0, 1)] == [1.0, 0.0]  # "Rome" is in the run-on only
    # An old record without `ended`: a few-shot answer ends at its stop string, not end-of-turn.
    assert [s[2] for s in fake.seen] == [False, False]
    assert out[2] == records[2]  # bad input: logged and left without the features
    # Without a greedy answer there is no sve_agree, and stale keys of other members go.
    stale = [_record(items[0], False, sve_mean_prob=0.9, sve_agree=1.0, sve_answer="x", sve_id="old")]
    s = add_sve_opinion(fake, items, stale, max_new_tokens=0, ensemble_id="new", progress=False)[0].scores or {}
    assert "sve_agree" not in s and "sve_answer" not in s
    assert s["sve_mean_prob"] == 0.5 and s["sve_id"] == "new" and s["sve_answer_tokens"] == 0


# --------------------------------------------------------------------------- cost


def test_forward_equivalents_per_feature_set() -> None:
    assert forward_equivalents(FEATURE_SETS["likelihood"]) == 1.0  # the forward alone
    assert forward_equivalents(FEATURE_SETS["paper"]) == 3.0  # forward + backward (≈ 2 forwards)
    assert forward_equivalents(FEATURE_SETS["same-pass+ptrue"]) == 4.0
    assert forward_equivalents(FEATURE_SETS["same-pass+sve"]) is None  # the shape is unknown
    shape = SVEShape(members=4, targeted_blocks=2, total_blocks=30, answer_tokens=32)
    sve = (30 - 2 + 4 * 2) / 30  # the 28 blocks below run once, the 2 SVE blocks 4 times
    assert forward_equivalents(FEATURE_SETS["same-pass+sve"], shape) == pytest.approx(3 + sve + 4)
    assert forward_equivalents(FEATURE_SETS["same-pass+ptrue+sve"], shape) == pytest.approx(4 + sve + 4)
    assert forward_equivalents(("aleatoric", "sve_mi"), shape) == pytest.approx(1 + sve)  # no greedy answer read
    outside = SVEShape(members=4, targeted_blocks=0, total_blocks=30)  # no block to share below
    assert forward_equivalents(("sve_mi",), outside) == 5.0
    stored = {"sve_members": 4, "sve_targeted_blocks": 2, "sve_total_blocks": 30, "sve_answer_tokens": 32}
    assert SVEShape.of(stored) == shape and SVEShape.of({"aleatoric": 0.1}) is None


def _risk_module() -> Any:
    return load_benchmark("risk")


def test_risk_benchmark_skips_sve_sets_on_a_cache_without_them_and_prices_them_on_one_with() -> None:
    from guarduq.calibration.analysis import available

    risk = _risk_module()
    assert set(SVE) <= set(risk.ALL_SIGNALS) and "sve_disagreement" not in risk.ALL_SIGNALS
    base = {"valid": True, "epistemic": 2.0, "aleatoric": 0.2, "mean_logprob": -1.0, "min_token_prob": 0.1,
            "mean_entropy": 1.0, "n_tokens": 3, "p_true": 0.7,
            "grad_profile": {"embed": 1.0, "head": 1.0, "block.0.attn": 1.0, "block.0.mlp": 1.0}}
    without = risk.measurable_sets(available([base], risk.ALL_SIGNALS))
    assert "same-pass+ptrue" in without and not {"same-pass+sve", "same-pass+ptrue+sve"} & set(without)
    with_sve = {**base, "sve_mean_prob": 0.5, "sve_variance": 0.01, "sve_mi": 0.1, "sve_agree": 1.0,
                "sve_members": 4, "sve_targeted_blocks": 2, "sve_total_blocks": 30, "sve_answer_tokens": 32}
    sets = risk.measurable_sets(available([with_sve], risk.ALL_SIGNALS))
    assert {"same-pass+sve", "same-pass+ptrue+sve"} <= set(sets)
    recs = [SimpleNamespace(scores=with_sve), SimpleNamespace(scores=base)]
    line = " ".join(risk.cost_lines(sets, risk.sve_shapes(recs)))
    assert "`same-pass` 3.00" in line and "`same-pass+ptrue` 4.00" in line
    assert f"`same-pass+sve` {3 + 36 / 30 + 4:.2f}" in line and "M = 4, N = 2 of L = 30" in line
    assert "?" in " ".join(risk.cost_lines(sets, risk.sve_shapes(recs[1:])))  # shape unknown: said so


# --------------------------------------------------------------------------- CLI


def _ns(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"sve": None, "sve_answer_tokens": 32, "ray": None, **kw})


def test_cli_refuses_sve_features_without_sve_before_any_model_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from guarduq.cli._scoring import _sve_plan

    with pytest.raises(InputError, match="give --sve FILE"):
        _sve_plan(_ns(), FEATURE_SETS["same-pass+sve"])
    with pytest.raises(InputError, match="--sve-answer-tokens must be > 0"):
        _sve_plan(_ns(sve=EXAMPLE, sve_answer_tokens=0), FEATURE_SETS["same-pass+sve"])
    with pytest.raises(InputError, match="cannot read"):
        _sve_plan(_ns(sve=tmp_path / "missing.safetensors"), ("sve_mi",))
    assert _sve_plan(_ns(sve=EXAMPLE), ("sve_mi",)).answer_tokens == 0  # nothing reads the greedy answer
    # The model named does not exist: the missing flag is reported first, before any loading.
    common = ["--model", "no-such-model", "--dataset", "jsonl", "--data", str(EXAMPLE),
              "--runs-dir", str(tmp_path / "runs"), "--no-progress"]
    assert main(["calibrate", *common, "--features", "same-pass+sve", "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "give --sve FILE" in err and "sve_mean_prob" in err and len(err.strip().splitlines()) == 1
    rng = np.random.default_rng(0)
    dicts = [{"aleatoric": float(a), "sve_mi": float(m), "valid": True} for a, m in rng.uniform(0, 0.25, (40, 2))]
    cal = Calibrator("aleatoric,sve_mi", C=1.0, model_name="tiny", model_fingerprint="f" * 32)
    cal.fit(dicts, np.arange(40) % 2)
    cal.save(tmp_path / "cal.json")
    assert main(["evaluate", "--calibrator", str(tmp_path / "cal.json"), *common]) == 2
    assert "give --sve FILE" in capsys.readouterr().err


def test_cli_computes_caches_and_reuses_sve_features_and_refuses_another_models_members(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from guarduq.models import load_model

    other = SVEnsemble.from_model(tiny_llama(seed=1), make_tokenizer(), members=2, last_n_blocks=1)
    other_file = other.save(tmp_path / "other.safetensors")
    ours = SVEnsemble.from_model(load_model(str(tiny_model_dir)), members=2, last_n_blocks=1, sigma_init=0.3)
    ours_file = ours.save(tmp_path / "ours.safetensors")
    runs = tmp_path / "runs"
    common = ["calibrate", "--model", str(tiny_model_dir), "--dataset", "jsonl", "--data", str(EXAMPLE),
              "--runs-dir", str(runs), "--no-progress", "--json", "--C", "1",
              "--features", "aleatoric,sve_mean_prob,sve_mi,sve_agree", "--sve-answer-tokens", "3",
              "--out", str(tmp_path / "cal.json"), "--allow-uncertified"]

    assert main([*common, "--sve", str(other_file)]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # (after the model's loading bar) one clean error line
    assert last.startswith("guarduq: error: SVE members in") and "not on this model" in last
    assert not list(runs.rglob("*.jsonl"))  # refused before scoring anything

    assert main([*common, "--sve", str(ours_file)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["sve"]["answer_tokens"] == 3 and res["sve"]["shape"]["members"] == 2
    assert res["forward_equivalents"] == pytest.approx(1 + (2 - 1 + 2 * 1) / 2 + 2)
    cache = next(runs.rglob("*.jsonl"))
    scores = [r.scores or {} for r in ScoreCache(cache).entries.values()]
    assert len(scores) == 20 and all({"sve_mean_prob", "sve_mi", "sve_agree"} <= set(s) for s in scores)
    assert Calibrator.load(tmp_path / "cal.json").costly_features == ("sve_mean_prob", "sve_mi", "sve_agree")
    size = cache.stat().st_size
    assert main([*common, "--sve", str(ours_file)]) == 0  # resumed: nothing scored or asked again
    capsys.readouterr()
    assert cache.stat().st_size == size
