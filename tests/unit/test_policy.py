"""Policy files: schema errors located by line and field, first-match rules, operators, actions."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from guarduq.errors import PolicyError
from guarduq.policy import (
    OPERATORS,
    Policy,
    SecondOpinion,
    make_signals,
    render_template,
    validate_policy_text,
)

REPO = Path(__file__).resolve().parents[2]

HEAD = """\
name: test
version: 1
calibrator: cal.json
alpha: 0.3
"""


def write(tmp_path: Path, body: str, head: str = HEAD, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(head + textwrap.dedent(body))
    return path


def load(tmp_path: Path, body: str, head: str = HEAD) -> Policy:
    return Policy.from_yaml(write(tmp_path, body, head))


def sig(risk: float | None = 0.1, threshold: float | None = 0.3, **more: float) -> dict:
    return {"risk": risk, "risk_threshold": threshold, **more}


def marked_line(text: str) -> int:
    """The 1-based line that carries the `# HERE` marker: the expectation, found independently."""
    hits = [i + 1 for i, line in enumerate(text.splitlines()) if "# HERE" in line]
    assert len(hits) == 1
    return hits[0]


# ------------------------------------------------------------------ schema errors

SCHEMA_CASES = {
    "unknown top-level key": (
        "ruless: []  # HERE\nrules:\n  - {name: a, action: allow}\n",
        "ruless", "unknown key 'ruless' (did you mean 'rules'?)",
    ),
    "unknown nested key": (
        "rules:\n  - name: a\n    action: abstain\n    mesage: hi  # HERE\n",
        "rules[0].mesage", "did you mean 'message'?",
    ),
    "unknown operator": (
        "rules:\n  - name: a\n    when:\n      risk: {gtt: 0.5}  # HERE\n    action: allow\n",
        "rules[0].when.risk.gtt", "unknown key 'gtt'",
    ),
    "unknown signal": (
        "rules:\n  - name: a\n    when:\n      riskk: {gt: 0.5}  # HERE\n    action: allow\n",
        "rules[0].when.riskk", "unknown key 'riskk'",
    ),
    "missing rule name": (
        "rules:\n  - action: allow  # HERE\n",
        "rules[0].name", "missing required key 'name'",
    ),
    "unknown action": (
        "rules:\n  - name: a\n    action: alow  # HERE\n",
        "rules[0].action", "unknown action 'alow'",
    ),
    "missing action": (
        "rules:\n  - name: a  # HERE\n",
        "rules[0].action", "missing required key 'action'",
    ),
    "bound is not a number": (
        "rules:\n  - name: a\n    when:\n      epistemic: {gt: big}  # HERE\n    action: allow\n",
        "rules[0].when.epistemic.gt", "expected a number or one of 'threshold', 'so.threshold', 'band', got 'big'",
    ),
    "bad mode": (
        "mode: enforced  # HERE\nrules:\n  - {name: a, action: allow}\n",
        "mode", "'enforce' or 'shadow'",
    ),
    "alpha out of range": (
        "rules:\n  - {name: a, action: allow}\n",  # alpha comes from the head, overridden below
        "alpha", "less than 1",
    ),
    "empty comparison": (
        "rules:\n  - name: a\n    when:\n      n_tokens: {}  # HERE\n    action: allow\n",
        "rules[0].when.n_tokens", "needs at least one operator",
    ),
    "empty condition": (
        "rules:\n  - name: a\n    when: {}  # HERE\n    action: allow\n",
        "rules[0].when", "empty condition",
    ),
    "no rules": ("rules: []  # HERE\n", "rules", "at least 1 item"),
    "unquoted yes/no": (
        "rules:\n  - name: no  # HERE\n    action: allow\n",
        "rules[0].name", "quote the word",
    ),
    "attribute access in a message": (
        "rules:\n  - name: a\n    action: abstain\n    message: '{risk.__class__}'  # HERE\n",
        "rules[0].message", "unknown placeholder {risk.__class__}",
    ),
    "conversion in a message": (
        "rules:\n  - name: a\n    action: abstain\n    message: '{risk!r}'  # HERE\n",
        "rules[0].message", "may only carry a format spec",
    ),
    "bad format spec": (
        "rules:\n  - name: a\n    action: abstain\n    message: '{risk:.2q}'  # HERE\n",
        "rules[0].message", "bad format spec",
    ),
    "webhook with a file url": (
        "sinks:\n  hook: {type: webhook, url: 'file:///etc/passwd'}  # HERE\n"
        "rules:\n  - {name: a, action: allow}\n",
        "sinks.hook.url", "http:// or https://",
    ),
    "unknown sink type": (
        "sinks:\n  hook: {type: smtp, url: x}  # HERE\nrules:\n  - {name: a, action: allow}\n",
        "sinks.hook.type", "unknown type 'smtp'",
    ),
    # checks across fields (run after the schema passes)
    "threshold without alpha": (
        "rules:\n  - name: a\n    when:\n      risk: {lt: threshold}  # HERE\n    action: allow\n",
        "rules[0].when.risk.lt", "'threshold' needs 'alpha'",
    ),
    "threshold on another signal": (
        "rules:\n  - name: a\n    when:\n      aleatoric: {lt: threshold}  # HERE\n    action: allow\n",
        "rules[0].when.aleatoric.lt", "compare it with risk only",
    ),
    "calibrated signal without calibrator": (
        "rules:\n  - name: a\n    when:\n      epistemic_z: {gt: 1}  # HERE\n    action: allow\n",
        "rules[0].when.epistemic_z", "comes from the calibrator",
    ),
    "second-opinion field outside second_opinion": (
        "rules:\n  - name: a\n    when:\n      so.variance: {lt: 0.1}  # HERE\n    action: allow\n",
        "rules[0].when.so.variance", "only known inside a second_opinion",
    ),
    "undeclared sink": (
        "rules:\n  - name: a\n    action: escalate\n    sink: nowhere  # HERE\n",
        "rules[0].sink", "sink 'nowhere' is not declared",
    ),
    "catch-all before other rules": (
        "rules:\n  - name: a  # HERE\n    action: allow\n  - name: b\n    action: abstain\n",
        "rules[0]", "rule 'b' after it can never fire",
    ),
    "duplicate rule names": (
        "rules:\n  - name: a\n    when: {n_tokens: {gt: 3}}\n    action: allow\n"
        "  - name: a  # HERE\n    action: abstain\n",
        "rules[1].name", "used twice",
    ),
    "between reversed": (
        "rules:\n  - name: a\n    when:\n      risk: {between: [0.9, 0.2]}  # HERE\n    action: allow\n"
        "  - {name: b, action: abstain}\n",
        "rules[0].when.risk.between", "needs [low, high]",
    ),
    "boolean compared with lt": (
        "rules:\n  - name: a\n    action: second_opinion\n    rules:\n      - name: b\n"
        "        when:\n          so.agrees: {lt: 1}  # HERE\n        action: allow\n",
        "rules[0].rules[0].when.so.agrees.lt", "compare it with eq/ne and a boolean",
    ),
    "number compared with a boolean": (
        "rules:\n  - name: a\n    when:\n      epistemic: {eq: true}  # HERE\n    action: allow\n",
        "rules[0].when.epistemic.eq", "compare it with a number",
    ),
    "duplicate key": (
        "rules:\n  - name: a\n    action: allow\n    action: abstain  # HERE\n",
        "action", "duplicate key 'action'",
    ),
}

HEAD_OVERRIDES = {
    "alpha out of range": "name: test\nversion: 1\ncalibrator: c.json\nalpha: 1.5  # HERE\n",
    "threshold without alpha": "name: test\nversion: 1\ncalibrator: c.json\n",
    "calibrated signal without calibrator": "name: test\nversion: 1\n",
}


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_schema_error_names_file_line_and_field(tmp_path: Path, case: str) -> None:
    body, field, message = SCHEMA_CASES[case]
    head = HEAD_OVERRIDES.get(case, HEAD)
    text = head + body
    path = write(tmp_path, body, head)
    config, issues = validate_policy_text(text, str(path))
    assert config is None
    assert [i.line for i in issues if i.field == field] == [marked_line(text)], issues
    assert any(message in i.message for i in issues if i.field == field), issues
    with pytest.raises(PolicyError) as err:
        Policy.from_yaml(path)
    assert f"{path}:" in str(err.value)


def test_several_errors_are_all_reported(tmp_path: Path) -> None:
    text = HEAD + "mode: x\nrules:\n  - name: a\n    action: nope\n  - {name: b, action: allow, foo: 1}\n"
    _, issues = validate_policy_text(text, "f.yaml")
    assert {i.field for i in issues} == {"mode", "rules[0].action", "rules[1].foo"}
    with pytest.raises(PolicyError, match=r"and 2 more problem"):
        Policy.from_yaml(write(tmp_path, text, head=""))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: [unclosed\n", "not valid YAML"),
        ("- just\n- a list\n", "must be a YAML mapping"),
        ("", "must be a YAML mapping"),
    ],
)
def test_not_a_policy_mapping(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError, match=message):
        Policy.from_yaml(path)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read policy file"):
        Policy.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(PolicyError, match="not UTF-8"):
        Policy.from_yaml(bad)


def test_yaml_tags_are_not_executed(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("name: !!python/object/apply:os.system ['echo pwned']\nversion: 1\nrules: []\n")
    with pytest.raises(PolicyError, match="not valid YAML"):
        Policy.from_yaml(path)


@pytest.mark.parametrize("path", sorted((REPO / "policies").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_policies_are_valid(path: Path) -> None:
    policy = Policy.from_yaml(path)
    # A policy named for a model (`make calibrator-qwen-*`) uses that model's calibrator; of
    # SmolLM2's, within.yaml uses the within-dataset fit, cascade.yaml the pooled fit its second
    # stage was fitted on (sha-bound, cascade.yaml says why), every other policy the pooled one
    which = {"within": "within.", "cascade": "cascade-first."}.get(path.stem, "")
    named = path.parent / "calibrators" / f"{path.stem}.json"
    expected = named if named.is_file() else path.parent / f"calibrators/smollm2-135m-instruct.{which}json"
    assert policy.calibrator_path == expected
    assert not named.is_file() or policy.config.model == path.stem
    assert policy.calibrator_path.is_file()
    # alpha is optional (default.yaml uses a plain calibrated-risk cutoff); when set it is a rate
    assert policy.alpha is None or 0 < policy.alpha < 1


def test_shipped_policy_set_is_complete() -> None:
    names = {p.stem for p in (REPO / "policies").glob("*.yaml")}
    assert {"default", "strict", "permissive", "cascade", "two_dimensional", "within"} <= names


# ------------------------------------------------------------------ properties


def test_paths_identity_and_model_check(tmp_path: Path) -> None:
    path = write(tmp_path, "model: smollm2-135m-instruct\nrules:\n  - {name: a, action: allow}\n")
    policy = Policy.from_yaml(path)
    assert policy.calibrator_path == tmp_path / "cal.json"
    import hashlib

    assert policy.identity() == {
        "name": "test", "version": "1", "sha256": hashlib.sha256(path.read_bytes()).hexdigest()
    }
    policy.check_model("smollm2-135m-instruct", "abcdef0123456789")
    with pytest.raises(PolicyError, match="is for model 'smollm2-135m-instruct'"):
        policy.check_model("gpt2", "abcdef0123456789")
    by_fp = load(tmp_path, "model: ABCDEF012345\nrules:\n  - {name: a, action: allow}\n")
    by_fp.check_model(["anything", "else"], "abcdef0123456789")
    with pytest.raises(PolicyError):
        by_fp.check_model("anything", "ffffff0123456789")


def test_make_signals_reads_score_attributes() -> None:
    scores = SimpleNamespace(epistemic=2.0, aleatoric=0.2, mean_token_prob=0.7, n_tokens=5, risk=9)
    s = make_signals(scores, risk=0.4, risk_threshold=0.3)
    assert s == {"epistemic": 2.0, "aleatoric": 0.2, "mean_token_prob": 0.7, "n_tokens": 5,
                 "risk": 0.4, "risk_threshold": 0.3}


def test_uncertified_threshold_is_unknown_and_fails_closed(tmp_path: Path) -> None:
    policy = load(tmp_path, "rules:\n  - name: ok\n    when: {risk: {le: threshold}}\n"
                            "    action: allow\n  - {name: rest, action: abstain}\n")
    d = policy.decide(sig(risk=0.01, threshold=None), response="r")
    assert (d.rule, d.action) == ("rest", "abstain")
    assert "risk=0.01 le threshold unknown: unknown" in d.explanation


RISKY_MESSAGE = ("rules:\n  - name: ok\n    when: {risk: {le: threshold}}\n    action: allow\n"
                 "  - name: rest\n    action: abstain\n    message: 'Not sure (chance of a wrong answer: {risk:.0%}).'\n")


def test_a_reply_withheld_for_want_of_a_certificate_says_so_and_quotes_no_risk(tmp_path: Path) -> None:
    policy = load(tmp_path, RISKY_MESSAGE)
    d = policy.decide(sig(risk=0.01, threshold=None), response="Paris.")
    assert (d.rule, d.action, d.shown) == ("rest", "abstain", False)
    assert "no certified risk threshold" in d.text and "%" not in d.text and "0.01" not in d.text
    assert "withheld because no threshold is certified" in d.explanation and "(ok could not decide)" in d.explanation


def test_with_a_certified_threshold_the_rule_keeps_its_own_message(tmp_path: Path) -> None:
    policy = load(tmp_path, RISKY_MESSAGE)
    d = policy.decide(sig(risk=0.9, threshold=0.3), response="Paris.")
    assert d.text == "Not sure (chance of a wrong answer: 90%)."


# ------------------------------------------------------------------ first match, operators, logic


def test_first_match_wins_and_order_matters(tmp_path: Path) -> None:
    rules = [
        "  - name: low_risk\n    when: {risk: {lt: 0.5}}\n    action: allow\n",
        "  - name: short\n    when: {n_tokens: {lt: 10}}\n    action: abstain\n",
    ]
    tail = "  - {name: rest, action: abstain}\n"
    a = load(tmp_path, "rules:\n" + rules[0] + rules[1] + tail)
    b = load(tmp_path, "rules:\n" + rules[1] + rules[0] + tail)
    both = sig(risk=0.2, n_tokens=3)
    assert (a.decide(both).rule, a.decide(both).action) == ("low_risk", "allow")
    assert (b.decide(both).rule, b.decide(both).action) == ("short", "abstain")
    assert a.decide(sig(risk=0.9, n_tokens=30)).rule == "rest"


def test_no_rule_matches_fails_closed(tmp_path: Path) -> None:
    policy = load(tmp_path, "rules:\n  - name: a\n    when: {risk: {lt: 0.5}}\n    action: allow\n")
    d = policy.decide(sig(risk=0.7), response="answer")
    assert (d.action, d.shown, d.rule) == ("abstain", False, None)
    assert d.text != "answer" and "no rule matched" in d.explanation


# (operator, bound, value, expected): boundaries included on purpose
OPERATOR_CASES = [
    ("lt", 0.5, 0.4, True), ("lt", 0.5, 0.5, False),
    ("le", 0.5, 0.5, True), ("le", 0.5, 0.6, False),
    ("gt", 0.5, 0.6, True), ("gt", 0.5, 0.5, False),
    ("ge", 0.5, 0.5, True), ("ge", 0.5, 0.4, False),
    ("eq", 3, 3, True), ("eq", 3, 4, False),
    ("ne", 3, 4, True), ("ne", 3, 3, False),
    ("between", [0.2, 0.4], 0.2, True), ("between", [0.2, 0.4], 0.4, True),
    ("between", [0.2, 0.4], 0.41, False), ("between", [0.2, 0.4], 0.19, False),
    ("outside", [0.2, 0.4], 0.1, True), ("outside", [0.2, 0.4], 0.5, True),
    ("outside", [0.2, 0.4], 0.2, False), ("outside", [0.2, 0.4], 0.3, False),
]


def test_operator_cases_cover_every_operator() -> None:
    assert {c[0] for c in OPERATOR_CASES} == set(OPERATORS)


@pytest.mark.parametrize(("op", "bound", "value", "expected"), OPERATOR_CASES)
def test_every_operator(tmp_path: Path, op: str, bound, value: float, expected: bool) -> None:
    body = (
        f"rules:\n  - name: hit\n    when: {{n_tokens: {{{op}: {json.dumps(bound)}}}}}\n"
        "    action: allow\n  - {name: miss, action: abstain}\n"
    )
    d = load(tmp_path, body).decide(sig(n_tokens=value))
    assert d.rule == ("hit" if expected else "miss")


def test_threshold_comes_from_the_signals(tmp_path: Path) -> None:
    policy = load(tmp_path, "rules:\n  - name: ok\n    when: {risk: {le: threshold}}\n"
                            "    action: allow\n  - {name: no, action: abstain}\n".replace("no,", "'no',"))
    assert policy.decide(sig(risk=0.25, threshold=0.3)).action == "allow"
    assert policy.decide(sig(risk=0.25, threshold=0.2)).action == "abstain"
    d = policy.decide(sig(risk=0.25, threshold=0.3))
    assert "risk=0.25 le threshold 0.3: yes" in d.explanation
    assert d.threshold == 0.3 and d.risk == 0.25


def test_several_operators_in_one_mapping_all_hold(tmp_path: Path) -> None:
    policy = load(tmp_path, "rules:\n  - name: band\n    when: {risk: {gt: 0.2, le: 0.4}}\n"
                            "    action: allow\n  - {name: rest, action: abstain}\n")
    assert [policy.decide(sig(risk=r)).rule for r in (0.2, 0.3, 0.4, 0.5)] == ["rest", "band", "band", "rest"]


@pytest.mark.parametrize(
    ("when", "truth"),
    [
        # truth table over (a = risk < 0.5, b = n_tokens < 10), inputs in this order: TT, TF, FT, FF
        ("{all: [{risk: {lt: 0.5}}, {n_tokens: {lt: 10}}]}", [True, False, False, False]),
        ("{any: [{risk: {lt: 0.5}}, {n_tokens: {lt: 10}}]}", [True, True, True, False]),
        ("{not: {risk: {lt: 0.5}}}", [False, False, True, True]),
        ("{risk: {lt: 0.5}, n_tokens: {lt: 10}}", [True, False, False, False]),
        ("{any: [{not: {risk: {lt: 0.5}}}, {all: [{n_tokens: {lt: 10}}]}]}", [True, False, True, True]),
    ],
)
def test_combinators(tmp_path: Path, when: str, truth: list[bool]) -> None:
    policy = load(tmp_path, f"rules:\n  - name: hit\n    when: {when}\n    action: allow\n"
                            "  - {name: miss, action: abstain}\n")
    inputs = [(0.1, 5), (0.1, 50), (0.9, 5), (0.9, 50)]
    got = [policy.decide(sig(risk=r, n_tokens=n)).rule == "hit" for r, n in inputs]
    assert got == truth


def test_missing_signal_is_a_clear_error(tmp_path: Path) -> None:
    policy = load(tmp_path, "rules:\n  - name: a\n    when: {epistemic: {lt: 1}}\n    action: allow\n"
                            "  - {name: b, action: abstain}\n")
    with pytest.raises(PolicyError, match=r"needs signal\(s\) \['epistemic'\]"):
        policy.decide(sig())


@pytest.mark.parametrize("bad", [math.nan, math.inf, "0.3", True])
def test_non_finite_or_non_numeric_signal_fails_closed(tmp_path: Path, bad) -> None:
    policy = load(tmp_path, "rules:\n  - name: a\n    when: {epistemic: {gt: -1}}\n    action: allow\n")
    d = policy.decide(sig(epistemic=bad), response="answer")
    assert (d.action, d.shown, d.rule) == ("abstain", False, "on_error")
    assert d.errors and "epistemic" in d.errors[0] and d.text != "answer"


# ------------------------------------------------------------------ actions


def test_allow_shows_the_answer(tmp_path: Path) -> None:
    d = load(tmp_path, "rules:\n  - {name: a, action: allow}\n").decide(sig(), response="Paris")
    assert (d.action, d.text, d.shown, d.rule) == ("allow", "Paris", True, "a")


def test_abstain_message_cites_numbers(tmp_path: Path) -> None:
    policy = load(tmp_path, "rules:\n  - name: a\n    action: abstain\n"
                            "    message: 'Risk {risk:.0%} over {threshold:.0%} ({n_tokens} tokens)'\n")
    d = policy.decide(sig(risk=0.734, threshold=0.3, n_tokens=7), response="Paris")
    assert (d.action, d.shown) == ("abstain", False)
    assert d.text == "Risk 73% over 30% (7 tokens)"


def test_template_renders_unknown_values_as_na() -> None:
    assert render_template("r={risk:.2f} t={threshold}", {"risk": None}) == "r=n/a t=n/a"


def test_escalate_hold_and_release(tmp_path: Path) -> None:
    body = """\
    sinks:
      queue: {type: jsonl, path: out/queue.jsonl}
    rules:
      - name: hold
        when: {risk: {gt: 0.8}}
        action: escalate
        sink: queue
        message: "Held for review (risk {risk:.0%})."
      - name: release
        action: escalate
        sink: queue
        hold: false
    """
    policy = load(tmp_path, body)
    held = policy.decide(sig(risk=0.9), prompt="Q?", response="A.", request_id="r-1",
                         model_fingerprint="fp")
    assert (held.action, held.shown, held.text) == ("escalate", False, "Held for review (risk 90%).")
    assert held.escalation is not None and held.escalation.delivered and held.escalation.hold
    released = policy.decide(sig(risk=0.5), prompt="Q?", response="A.", request_id="r-2")
    assert (released.action, released.shown, released.text) == ("escalate", True, "A.")
    lines = [json.loads(x) for x in (tmp_path / "out/queue.jsonl").read_text().splitlines()]
    assert [c["request_id"] for c in lines] == ["r-1", "r-2"]
    assert lines[0]["prompt"] == "Q?" and lines[0]["response"] == "A."
    assert lines[0]["scores"]["risk"] == 0.9 and lines[0]["model_fingerprint"] == "fp"
    assert lines[0]["decision"]["rule"] == "hold" and lines[0]["decision"]["hold"] is True
    assert lines[0]["policy"]["sha256"] == policy.sha256


class Ensemble:
    """A stand-in second opinion that records its calls."""

    def __init__(self, **result) -> None:
        self.result = SimpleNamespace(**result)
        self.calls: list[tuple] = []

    def second_opinion(self, prompt, response):
        self.calls.append((prompt, response))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


CASCADE = """\
sinks:
  queue: {type: jsonl, path: q.jsonl}
rules:
  - name: confident
    when: {risk: {le: threshold}}
    action: allow
  - name: borderline
    when: {risk: {between: [threshold, 0.8]}}
    action: second_opinion
    rules:
      - name: confirmed
        when:
          all:
            - so.agrees: {eq: true}
            - so.variance: {le: 0.01}
            - so.mean_prob: {ge: 0.5}
        action: allow
      - name: contested
        when: {any: [{so.agrees: {eq: false}}, {so.mutual_information: {gt: 0.2}}]}
        action: abstain
        message: "The second opinion disagrees (p={so_mean_prob:.2f})."
      - name: review
        action: escalate
        sink: queue
  - name: risky
    action: abstain
"""


def test_second_opinion_runs_only_when_its_rule_fires(tmp_path: Path) -> None:
    ens = Ensemble(mean_prob=0.9, variance=0.001, mutual_information=0.01, agrees=True)
    policy = load(tmp_path, CASCADE).bind(second_opinion=ens)
    assert policy.decide(sig(risk=0.1), prompt="p", response="r").action == "allow"
    assert policy.decide(sig(risk=0.95), prompt="p", response="r").rule == "risky"
    assert ens.calls == []
    d = policy.decide(sig(risk=0.5), prompt="p", response="r")
    assert ens.calls == [("p", "r")]
    assert (d.action, d.rule, d.text) == ("allow", "borderline/confirmed", "r")
    assert d.second_opinion == SecondOpinion(0.9, 0.001, 0.01, True, ())
    assert "so.variance=0.001 le 0.01: yes" in d.explanation


@pytest.mark.parametrize(
    ("result", "rule", "action"),
    [
        ({"mean_prob": 0.9, "variance": 0.001, "mutual_information": 0.0, "agrees": True}, "confirmed", "allow"),
        ({"mean_prob": 0.9, "variance": 0.05, "mutual_information": 0.0, "agrees": True}, "review", "escalate"),
        ({"mean_prob": 0.3, "variance": 0.001, "mutual_information": 0.0, "agrees": False}, "contested", "abstain"),
        ({"mean_prob": 0.9, "variance": 0.05, "mutual_information": 0.5, "agrees": True}, "contested", "abstain"),
        # first match: confirmed precedes contested, so a high MI alone does not overrule it
        ({"mean_prob": 0.9, "variance": 0.001, "mutual_information": 0.5, "agrees": True}, "confirmed", "allow"),
        # agrees unknown: "eq true" is unknown, so confirmed cannot fire; MI high -> contested
        ({"mean_prob": 0.9, "variance": 0.001, "mutual_information": 0.5, "agrees": None}, "contested", "abstain"),
        ({"mean_prob": 0.9, "variance": 0.001, "mutual_information": 0.0, "agrees": None}, "review", "escalate"),
    ],
)
def test_nested_second_opinion_rules(tmp_path: Path, result: dict, rule: str, action: str) -> None:
    policy = load(tmp_path, CASCADE).bind(second_opinion=Ensemble(**result))
    d = policy.decide(sig(risk=0.5), prompt="p", response="r")
    assert (d.rule, d.action) == (f"borderline/{rule}", action)
    if rule == "contested":
        assert d.text == f"The second opinion disagrees (p={result['mean_prob']:.2f})."


def test_second_opinion_no_nested_match_fails_closed(tmp_path: Path) -> None:
    body = ("rules:\n  - name: so\n    action: second_opinion\n    rules:\n"
            "      - name: ok\n        when: {so.mean_prob: {gt: 0.5}}\n        action: allow\n")
    policy = load(tmp_path, body)
    d = policy.decide(sig(), second_opinion=Ensemble(mean_prob=0.1, variance=0, mutual_information=0),
                      response="r")
    assert (d.action, d.rule, d.shown) == ("abstain", None, False)


def test_a_plain_callable_can_be_the_provider(tmp_path: Path) -> None:
    policy = load(tmp_path, CASCADE)
    d = policy.decide(sig(risk=0.5), lambda p, r: SimpleNamespace(
        mean_prob=0.9, variance=0.0, mutual_information=0.0, agrees=True), response="r")
    assert d.rule == "borderline/confirmed"


def test_second_opinion_without_provider_is_refused(tmp_path: Path) -> None:
    policy = load(tmp_path, CASCADE)
    with pytest.raises(PolicyError, match="no second-opinion provider is configured"):
        policy.bind()
    # even when the risk is low and the rule would not fire: never silently allow
    with pytest.raises(PolicyError, match="no second-opinion provider"):
        policy.decide(sig(risk=0.1), response="r")
    with pytest.raises(PolicyError, match="second_opinion must have"):
        policy.bind(second_opinion=42)


# ------------------------------------------------------------------ on_error and shadow


@pytest.mark.parametrize(
    "result",
    [
        RuntimeError("ensemble crashed"),
        {"mean_prob": math.nan, "variance": 0.0, "mutual_information": 0.0},
        {"variance": 0.0, "mutual_information": 0.0},  # mean_prob missing
        {"mean_prob": 0.5, "variance": 0.0, "mutual_information": 0.0, "agrees": "yes"},
    ],
    ids=["raises", "nan", "missing-field", "agrees-not-bool"],
)
def test_failing_second_opinion_fails_closed(tmp_path: Path, result) -> None:
    ens = Ensemble()
    ens.result = result if isinstance(result, Exception) else SimpleNamespace(**result)
    d = load(tmp_path, CASCADE).bind(second_opinion=ens).decide(sig(risk=0.5), response="r")
    assert (d.action, d.rule, d.shown) == ("abstain", "on_error", False)
    assert d.errors[0].startswith("second_opinion:")


def test_failing_sink_fails_closed(tmp_path: Path) -> None:
    (tmp_path / "q.jsonl").mkdir()  # a directory where the queue file should be: writes fail
    policy = load(tmp_path, CASCADE).bind(
        second_opinion=Ensemble(mean_prob=0.9, variance=0.5, mutual_information=0.0, agrees=True))
    d = policy.decide(sig(risk=0.5), response="r")
    assert (d.action, d.rule, d.shown) == ("abstain", "on_error", False)
    assert d.errors[0].startswith("escalation:") and "cannot write" in d.errors[0]
    assert d.escalation is not None and d.escalation.sink == "queue" and not d.escalation.delivered
    assert "cannot write" in d.escalation.error


def test_failing_scorer_uses_on_error(tmp_path: Path) -> None:
    policy = load(tmp_path, "rules:\n  - {name: a, action: allow}\n")
    d = policy.on_error_decision("scoring", RuntimeError("CUDA exploded"), response="r")
    assert (d.action, d.shown, d.rule) == ("abstain", False, "on_error")
    assert d.errors == ("scoring: RuntimeError: CUDA exploded",)


def test_on_error_can_be_configured_to_fail_open(tmp_path: Path) -> None:
    body = ("on_error: allow\nrules:\n  - name: a\n    when: {epistemic: {gt: 0}}\n    action: allow\n"
            "  - {name: b, action: abstain}\n")
    d = load(tmp_path, body).decide(sig(epistemic=math.nan), response="r")
    assert (d.action, d.shown, d.text, d.rule) == ("allow", True, "r", "on_error")
    assert d.errors


def test_on_error_message(tmp_path: Path) -> None:
    body = "on_error: {action: abstain, message: 'Checks are down.'}\nrules:\n  - {name: a, action: allow}\n"
    d = load(tmp_path, body).on_error_decision("scoring", "boom", response="r")
    assert d.text == "Checks are down."


def test_shadow_mode_computes_but_always_shows(tmp_path: Path) -> None:
    policy = load(tmp_path, "mode: shadow\n" + CASCADE).bind(
        second_opinion=Ensemble(mean_prob=0.9, variance=0.5, mutual_information=0.0, agrees=True))
    risky = policy.decide(sig(risk=0.95), response="r")
    assert (risky.action, risky.shown, risky.text, risky.shadow) == ("abstain", True, "r", True)
    escalated = policy.decide(sig(risk=0.5), response="r")
    assert (escalated.action, escalated.shown, escalated.text) == ("escalate", True, "r")
    assert escalated.escalation is not None and not escalated.escalation.delivered
    assert not (tmp_path / "q.jsonl").exists()  # shadow mode sends nothing to humans
    failed = policy.decide(sig(risk=math.nan), response="r")
    assert (failed.action, failed.shown, failed.text) == ("abstain", True, "r")


def test_decision_to_dict_is_json(tmp_path: Path) -> None:
    d = load(tmp_path, CASCADE).bind(second_opinion=Ensemble(
        mean_prob=0.9, variance=0.0, mutual_information=0.0, agrees=True)).decide(sig(risk=0.5), response="r")
    data = json.loads(json.dumps(d.to_dict()))
    assert data["rule"] == "borderline/confirmed" and data["second_opinion"]["agrees"] is True
    assert data["checks"][0].startswith("risk=0.5 between")


# ------------------------------------------------------------------ CLI: guarduq policy check


def test_cli_check_ok_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from guarduq.cli import main

    good = REPO / "policies/default.yaml"
    assert main(["policy", "check", str(good)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {good}: policy 'default'") and "confident->allow" in out
    bad = write(tmp_path, "rules:\n  - name: a\n    action: allow\n    colour: red\n", name="bad.yaml")
    assert main(["policy", "check", str(good), str(bad)]) == 2
    captured = capsys.readouterr()
    assert f"{bad}:8: rules[0].colour: unknown key 'colour'" in captured.err
    assert main(["policy", "check", str(tmp_path / "none.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_condition_schema_covers_every_signal() -> None:
    from guarduq.policy import BASE_SIGNALS, SO_BOOL, SO_NUMERIC, TEMPLATE_NAMES, Condition

    keys = {info.alias or name for name, info in Condition.model_fields.items()}
    assert keys == {"all", "any", "not", *BASE_SIGNALS, *SO_NUMERIC, *SO_BOOL}
    assert {"risk", "threshold", "so_mean_prob"} <= TEMPLATE_NAMES


# ------------------------------------------------------------------ binding a calibrator


class CalibratorStandIn:
    """The calibrator interface bind() reads (guarduq.calibration.Calibrator has these names)."""

    def __init__(self, thresholds: dict[float, float | None], features=("log_epistemic", "aleatoric")):
        self.thresholds_ = [SimpleNamespace(alpha=a, threshold=t) for a, t in thresholds.items()]
        self.features = tuple(features)

    def threshold_for(self, alpha: float) -> float | None:
        return next(t.threshold for t in self.thresholds_ if math.isclose(t.alpha, alpha))


THRESHOLD_RULES = ("rules:\n  - name: ok\n    when: {risk: {le: threshold}}\n    action: allow\n"
                   "  - {name: rest, action: abstain}\n")


def test_bind_takes_the_threshold_alpha_selects(tmp_path: Path) -> None:
    policy = load(tmp_path, THRESHOLD_RULES).bind(calibrator=CalibratorStandIn({0.2: 0.1, 0.3: 0.4}))
    assert policy.risk_threshold == 0.4
    assert policy.decide({"risk": 0.35}).action == "allow"
    assert policy.decide({"risk": 0.45}).action == "abstain"
    assert policy.decide({"risk": 0.35, "risk_threshold": 0.3}).action == "abstain"  # explicit wins


def test_bind_refuses_an_alpha_the_calibrator_lacks(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match=r"alpha=0.3, but the calibrator has thresholds for \[0.1\]"):
        load(tmp_path, THRESHOLD_RULES).bind(calibrator=CalibratorStandIn({0.1: 0.2}))


def test_bind_with_an_uncertified_alpha_fails_closed(tmp_path: Path) -> None:
    policy = load(tmp_path, THRESHOLD_RULES).bind(calibrator=CalibratorStandIn({0.3: None}))
    assert policy.risk_threshold is None
    assert policy.decide({"risk": 0.0}).action == "abstain"


def test_bind_refuses_z_scores_the_calibrator_cannot_give(tmp_path: Path) -> None:
    body = "rules:\n  - name: a\n    when: {epistemic_z: {gt: 1}}\n    action: abstain\n  - {name: b, action: allow}\n"
    with pytest.raises(PolicyError, match="without the 'log_epistemic' feature"):
        load(tmp_path, body).bind(calibrator=CalibratorStandIn({0.3: 0.5}, features=("aleatoric",)))
    load(tmp_path, body).bind(calibrator=CalibratorStandIn({0.3: 0.5}))
