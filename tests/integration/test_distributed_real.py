"""Scoring over Ray actors writes the same records as one process (local Ray, 2 actors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guarduq.calibration.datasets import load_dataset
from guarduq.calibration.evaluation import ScoreCache, score_dataset

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'guarduq[ray]')")

NUMERIC = ("epistemic", "aleatoric", "mean_token_prob", "mean_logprob", "min_token_prob", "mean_entropy")


def _items(tmp_path: Path) -> list:
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "q1", "question": "What is the capital of France?", "answers": ["Paris"]},
        {"id": "q2", "question": "How many legs does a spider have?", "answers": ["eight", "8"]},
        {"id": "q3", "question": "Who wrote Hamlet?", "answers": ["Shakespeare"]},
    ]))
    lab = tmp_path / "lab.jsonl"
    lab.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": f"l{i}", "prompt": f"What is {i} + {i}?", "response": f"It is {2 * i}.", "label": 1} for i in range(3)
    ]))
    return [*load_dataset("triviaqa", qa).items, *load_dataset("jsonl", lab).items]


@pytest.mark.long
def test_ray_records_equal_single_process(tmp_path: Path) -> None:
    """A tiny random Llama saved to a folder keeps this well under a minute on 2 cores."""
    from guarduq import Guard
    from guarduq.distributed import RayScorer
    from tests.conftest import make_tokenizer, tiny_llama

    model_dir = tmp_path / "tiny"
    tiny_llama(seed=0, tie=False).save_pretrained(model_dir)
    make_tokenizer(chat_template=True).save_pretrained(model_dir)
    real_guard = Guard(str(model_dir))
    items = _items(tmp_path)
    local = score_dataset(real_guard, items, tmp_path / "local.jsonl", batch_size=2, progress=False,
                          max_new_tokens=12)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        with RayScorer(str(model_dir), cpus_per_actor=1) as pool:
            assert len(pool.actors) == 2 and pool.info.fingerprint == real_guard.info.fingerprint
            remote = score_dataset(pool, items, tmp_path / "ray.jsonl", batch_size=2, progress=False,
                                   max_new_tokens=12)
            pairs = [(it.prompt, it.response) for it in items if it.response]
            pair_scores = pool.score_pairs(pairs, [True] * len(pairs), batch_size=2)
    finally:
        ray.shutdown()
    # Only the driver wrote the cache: one line per item, resumable like any other.
    assert len(ScoreCache(tmp_path / "ray.jsonl").entries) == len(items)
    for a, b in zip(local, remote, strict=True):
        assert (a.id, a.response, a.label, a.ended, a.model_fingerprint) == (b.id, b.response, b.label, b.ended,
                                                                           b.model_fingerprint)
        for k in NUMERIC:
            assert b.scores[k] == pytest.approx(a.scores[k], rel=1e-6, abs=1e-12), (a.id, k)
    by_id = {r.id: r for r in local}
    for (it_id, s) in zip([it.id for it in items if it.response], pair_scores, strict=True):
        assert s.epistemic == pytest.approx(by_id[it_id].scores["epistemic"], rel=1e-6)
