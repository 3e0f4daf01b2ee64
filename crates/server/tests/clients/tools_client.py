"""Tool calling and structured output through the official `openai` Python client, against an
hf2q server running Qwen2.5-Coder-0.5B-Instruct (whose template writes Hermes-style calls).

Usage: tools_client.py BASE_URL MODEL_ID
Prints one line per test and a closing "N passed, N failed" line; exits 1 on any failure.
"""

import json
import sys
import traceback
import urllib.request

import openai
import pydantic

BASE, MODEL = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, timeout=300)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "description": "The current time", "parameters": {"type": "object", "properties": {}}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def create(**kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(**kw)


def check_call(call, name):
    assert call.type == "function", call
    assert call.id and call.id.startswith("call_"), call
    assert call.function.name == name, call
    return json.loads(call.function.arguments)


def test_auto_call():
    r = create(messages=ASK, tools=[WEATHER])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert not c.message.content, c.message
    args = check_call(c.message.tool_calls[0], "get_weather")
    assert "paris" in args["city"].lower(), args


def test_stream_reassembles_to_the_same_calls():
    whole = create(messages=ASK, tools=[WEATHER]).choices[0].message.tool_calls
    chunks = list(create(messages=ASK, tools=[WEATHER], stream=True))
    firsts, fragments = {}, {}
    finish = None
    for ch in chunks:
        for c in ch.choices:
            finish = c.finish_reason or finish
            assert not (c.delta.content or "").strip(), f"content leaked: {c.delta.content!r}"
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in firsts, "id sent twice"
                    firsts[d.index] = (d.id, d.function.name)
                fragments.setdefault(d.index, []).append(d.function.arguments or "")
    assert finish == "tool_calls", finish
    assert sorted(firsts) == list(range(len(whole))), firsts
    for i, w in enumerate(whole):
        assert firsts[i][1] == w.function.name
        assert "".join(fragments[i]) == w.function.arguments, (fragments[i], w.function.arguments)
        assert len(fragments[i]) > 2, "arguments arrive in fragments"
    # The client's own stream helper (strict tools are parsed) reassembles the same call.
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=120) as s:
        for _ in s:
            pass
        final = s.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.arguments == whole[0].function.arguments
    assert call.function.parsed_arguments == json.loads(whole[0].function.arguments)


# The 0.5B model makes one call per turn; with its end-of-turn tokens banned it goes on to
# further calls until the token limit (the last one cut off, so it comes back as content).
END_OF_TURN_BANNED = {"151645": -100, "151643": -100}


def test_parallel_calls_have_distinct_indexes_and_ids():
    msgs = [{"role": "user", "content": "What is the weather in Paris and in Tokyo?"}]
    kw = dict(messages=msgs, tools=[WEATHER], tool_choice="required", parallel_tool_calls=True,
              max_tokens=120, logit_bias=END_OF_TURN_BANNED)
    r = create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "length", c
    assert len(c.message.tool_calls) >= 2, c.message
    assert len({t.id for t in c.message.tool_calls}) == len(c.message.tool_calls), c.message
    for t in c.message.tool_calls:
        check_call(t, "get_weather")
    ids, args = {}, {}
    for ch in create(stream=True, **kw):
        for x in ch.choices:
            for d in x.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in ids, "id sent twice"
                    ids[d.index] = d.id
                args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    assert sorted(ids) == list(range(len(ids))) and len(ids) >= 2, ids
    assert len(set(ids.values())) == len(ids), ids
    for i, t in enumerate(c.message.tool_calls):
        assert args[i] == t.function.arguments, (args[i], t.function.arguments)


def test_required_without_parallel_is_one_call():
    msgs = [{"role": "user", "content": "What is the weather in Paris and in Tokyo?"}]
    r = create(messages=msgs, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    c = r.choices[0]
    assert len(c.message.tool_calls) == 1, c.message.tool_calls
    assert c.finish_reason == "tool_calls", c


def test_named_tool_choice():
    r = create(messages=ASK, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
    assert isinstance(json.loads(c.message.tool_calls[0].function.arguments), dict)


def test_tool_choice_none_answers_in_text():
    r = create(messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=30)
    c = r.choices[0]
    assert c.message.tool_calls is None, c.message
    assert c.finish_reason in ("stop", "length") and c.message.content, c


def post(path, body):
    req = urllib.request.Request(BASE + path, json.dumps(body).encode(), {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req))


def test_tool_message_round_trip():
    first = create(messages=ASK, tools=[WEATHER]).choices[0].message
    call = first.tool_calls[0]
    result = json.dumps({"temperature_c": 21, "sky": "sunny"})
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    r = create(messages=msgs, tools=[WEATHER], max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls"), c
    assert c.message.content or c.message.tool_calls, c
    # The call and its result reach the model the way its template writes them.
    prompt = post("/detokenize", {"tokens": post("/tokenize", {"messages": msgs})["tokens"]})["content"]
    args = json.dumps(json.loads(call.function.arguments))
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>' in prompt, prompt
    assert f"<tool_response>\n{result}\n</tool_response>" in prompt, prompt
    # Arguments given as an object are accepted too; a tool message needs its call's id.
    msgs[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    create(messages=msgs, tools=[WEATHER], max_tokens=5)
    try:
        create(messages=msgs[:2] + [{"role": "tool", "content": result}], tools=[WEATHER], max_tokens=5)
        raise AssertionError("expected an error")
    except openai.UnprocessableEntityError as e:
        assert e.body["param"] == "messages[2].tool_call_id", e.body


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


def test_structured_output_parse():
    r = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=100, response_format=City,
        messages=[{"role": "user", "content": "Describe Paris as JSON with its name, country and population."}],
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r
    assert city.name.lower().startswith("paris"), city


def test_structured_output_stream():
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3}},
              "required": ["colors"], "additionalProperties": False}
    s = create(messages=[{"role": "user", "content": "Name two colors as JSON."}], stream=True,
               response_format={"type": "json_schema", "json_schema": {"name": "colors", "schema": schema, "strict": True}})
    text = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    v = json.loads(text)
    assert 2 <= len(v["colors"]) <= 3 and set(v["colors"]) <= {"red", "green", "blue"}, v
    r = create(messages=[{"role": "user", "content": "Give me any JSON object."}], response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_unsupported_schema_is_400():
    try:
        create(messages=ASK, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}})
        raise AssertionError("expected 400")
    except openai.BadRequestError as e:
        assert e.body["param"] == "response_format.json_schema.schema", e.body
        assert "if" in e.body["message"] or "then" in e.body["message"], e.body


def main():
    tests = [(k, v) for k, v in globals().items() if k.startswith("test_") and callable(v)]
    passed = failed = 0
    for name, fn in tests:
        try:
            fn()
            print(f"python openai tools {name} ... ok", flush=True)
            passed += 1
        except Exception:  # report every failure, then fail the run
            print(f"python openai tools {name} ... FAILED", flush=True)
            traceback.print_exc()
            failed += 1
    print(f"python openai tools client (openai {openai.__version__}): {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
