"""Score the answers of a model guarduq cannot see inside (a remote API) with a local scorer.

The chain's model here is langchain-core's ``FakeListChatModel``, a stand-in for a remote chat
API: it replies with canned answers, some right and some wrong. ``GuardUQCallbackHandler`` reads
each reply and scores it with the local default model by teacher forcing.

Read the numbers for what they are: they measure how uncertain *the local model* is about that
text, given the prompt, not how uncertain the remote model was (its weights are never seen).
A small local model is a rough judge of a large remote one; calibrate a policy on the pairs you
care about before acting on these scores.

    python examples/langchain_remote_scorer.py
    python examples/langchain_remote_scorer.py --policy policies/default.yaml

Runs offline with the default model. The chain's output is never changed by the handler; to act
on the verdict, wrap the chain with ``guard_runnable`` (shown last, when a policy is given).
"""

from __future__ import annotations

import argparse
import sys
import uuid

from langchain_core.language_models.fake_chat_models import FakeListChatModel
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate

from guarduq import Guard
from guarduq.integrations.langchain import GuardUQCallbackHandler, guard_runnable
from guarduq.models import DEFAULT_MODEL

QA = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Australia?", "The capital of Australia is Sydney."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Who was the first person to walk on Mars?", "Neil Armstrong walked on Mars in 1969."),
]


def remote_chain(answers: list[str]):
    """prompt | "remote" model | parser; the fake model answers in order."""
    prompt = ChatPromptTemplate.from_messages(
        [("system", "You are a helpful assistant."), ("user", "{question}")]
    )
    return prompt | FakeListChatModel(responses=answers) | StrOutputParser()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scorer", default=DEFAULT_MODEL, help="local scorer model (default: %(default)s)")
    parser.add_argument("--policy", help="a guarduq policy YAML file: adds decisions")
    args = parser.parse_args(argv)

    scorer = Guard(args.scorer, policy=args.policy)
    handler = GuardUQCallbackHandler(scorer)
    chain = remote_chain([a for _, a in QA])
    print(f"local scorer: {scorer.info.name} (it scores the remote text; it did not write it)\n")
    for question, _ in QA:
        run_id = uuid.uuid4()
        answer = chain.invoke({"question": question}, config={"callbacks": [handler], "run_id": run_id})
        (record,) = handler.get(run_id)
        s = record.scores
        print(f"Q: {question}\nA: {answer}")
        if s is None:
            print(f"   not scored: {record.error}\n")
            continue
        verdict = f"   epistemic={s.epistemic:.3g} aleatoric={s.aleatoric:.3f} mean_token_prob={s.mean_token_prob:.3f}"
        if record.decision is not None:
            verdict += f" -> {record.decision['action']}"
        print(verdict + "\n")

    if scorer.policy is not None:
        guarded = guard_runnable(remote_chain([a for _, a in QA]), scorer)
        print("With guard_runnable, the policy's decision replaces what the user sees:")
        for question, _ in QA:  # one by one: the fake model answers in call order
            print(f"Q: {question}\n=> {guarded.invoke({'question': question})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
