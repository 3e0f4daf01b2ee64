"""Drives a running hf2q server with the official `openai` Python client.

Usage: openai_client.py BASE_URL API_KEY MODEL_ID
Prints one line per test and a closing "N passed, N failed" line; exits 1 on any failure.
"""

import sys
import traceback

import openai

BASE, KEY, MODEL = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


def test_models():
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL], models
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat():
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0)
    assert r.object == "chat.completion"
    assert r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == c.message.content, "greedy is deterministic"


def test_chat_stream_with_usage():
    full = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content, (text, full.choices[0].message.content)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason], finishes
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions():
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.object == "text_completion"
    text = r.choices[0].text
    s = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in s if c.choices)
    assert streamed == text, (streamed, text)


def test_n_and_logprobs():
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=3, n=2, temperature=0.9, seed=1, logprobs=True, top_logprobs=2,
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        for t in c.logprobs.content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 2


def test_errors():
    try:
        client.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=2)
        raise AssertionError("expected 404")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and "no-such-model" in str(e)
    try:
        client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=2,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
        raise AssertionError("expected 400")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "tool_choice", e.body
    try:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=-3)
        raise AssertionError("expected 400")
    except openai.BadRequestError as e:
        assert e.body["param"] == "max_tokens", e.body
    try:
        client.chat.completions.create(model=MODEL, messages=MSGS, temperature=7)
        raise AssertionError("expected 400")
    except openai.BadRequestError as e:
        assert e.body["param"] == "temperature", e.body


def test_auth():
    bad = openai.OpenAI(base_url=BASE + "/v1", api_key="wrong-key", max_retries=0)
    try:
        bad.models.list()
        raise AssertionError("expected 401")
    except openai.AuthenticationError as e:
        assert e.status_code == 401
        assert e.body["code"] == "invalid_api_key", e.body


def main():
    tests = [(k, v) for k, v in globals().items() if k.startswith("test_") and callable(v)]
    passed = failed = 0
    for name, fn in tests:
        try:
            fn()
            print(f"python openai {name} ... ok", flush=True)
            passed += 1
        except Exception:  # report every failure, then fail the run
            print(f"python openai {name} ... FAILED", flush=True)
            traceback.print_exc()
            failed += 1
    print(f"python openai client (openai {openai.__version__}): {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
