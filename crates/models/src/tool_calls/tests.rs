//! Parser tests on model outputs of each family's format: the templates' own examples and
//! replies recorded from the real models (marked so), including malformed and truncated calls.

use super::*;

fn names() -> Vec<String> {
    ["get_weather", "now", "run"].map(String::from).to_vec()
}

fn parse(f: ToolFormat, text: &str) -> ParsedReply {
    parse_tool_calls(f, &names(), true, text)
}

fn call(name: &str, args: &str) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments: args.into(),
        id: None,
    }
}

/// Feeds `text` in pieces of `n` characters and folds the events: must equal the one-shot
/// parse (streaming never changes the result).
fn streamed(f: ToolFormat, text: &str, n: usize) -> ParsedReply {
    let mut p = ToolCallParser::new(f, names(), true);
    let chars: Vec<char> = text.chars().collect();
    let mut events = Vec::new();
    for piece in chars.chunks(n) {
        events.extend(p.push(&piece.iter().collect::<String>()));
    }
    events.extend(p.finish());
    collect(events)
}

fn check_streaming(f: ToolFormat, text: &str) {
    let whole = parse(f, text);
    for n in [1, 2, 3, 7, 1000] {
        assert_eq!(streamed(f, text, n), whole, "pieces of {n}: {text:?}");
    }
}

#[test]
fn hermes_single_parallel_and_text() {
    // The Qwen2.5 template's own call format.
    let t = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let r = parse(ToolFormat::Hermes, t);
    assert_eq!(r.calls, vec![call("get_weather", "{\"city\": \"Paris\"}")]);
    assert_eq!(r.content, "");
    let t2 = format!("Let me check.\n{t}\n{}", t.replace("Paris", "London"));
    let r = parse(ToolFormat::Hermes, &t2);
    assert_eq!(r.content, "Let me check.");
    assert_eq!(r.calls.len(), 2);
    assert_eq!(r.calls[1].arguments, "{\"city\": \"London\"}");
    check_streaming(ToolFormat::Hermes, &t2);
    // Without parallel calls only the first counts.
    let r = parse_tool_calls(ToolFormat::Hermes, &names(), false, &t2);
    assert_eq!(r.calls.len(), 1);
    assert_eq!(r.content, "Let me check.");
}

#[test]
fn hermes_fenced_call_without_tags() {
    // Recorded from Qwen2.5-Coder-0.5B-Instruct Q4_K_M (hf2q serve, temperature 0, the Qwen2.5
    // template with one tool get_weather, "What is the weather in Paris?").
    let t = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\n    \"city\": \"Paris\"\n  }\n}\n```";
    let r = parse(ToolFormat::Hermes, t);
    assert_eq!(r.content, "");
    assert_eq!(r.calls.len(), 1, "{r:?}");
    let v: serde_json::Value = serde_json::from_str(&r.calls[0].arguments).unwrap();
    assert_eq!(v, serde_json::json!({"city": "Paris"}));
    check_streaming(ToolFormat::Hermes, t);
}

#[test]
fn hermes_plain_text_passes_through() {
    let t = "The weather <b>is</b> nice; use <tool_ for tags.";
    let r = parse(ToolFormat::Hermes, t);
    assert_eq!(
        r,
        ParsedReply {
            content: t.into(),
            ..Default::default()
        }
    );
    check_streaming(ToolFormat::Hermes, t);
}

#[test]
fn arguments_with_braces_quotes_and_no_arguments() {
    let t = "<tool_call>\n{\"name\": \"run\", \"arguments\": {\"cmd\": \"mkdir -p test/{a,b\", \"q\": \"say \\\"}\\\"\"}}\n</tool_call>";
    let r = parse(ToolFormat::Hermes, t);
    assert_eq!(r.calls.len(), 1, "{r:?}");
    let v: serde_json::Value = serde_json::from_str(&r.calls[0].arguments).unwrap();
    assert_eq!(v["cmd"], "mkdir -p test/{a,b");
    assert_eq!(v["q"], "say \"}\"");
    check_streaming(ToolFormat::Hermes, t);
    for t in [
        "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"now\"}\n</tool_call>",
    ] {
        let r = parse(ToolFormat::Hermes, t);
        assert_eq!(r.calls, vec![call("now", "{}")], "{t}");
        check_streaming(ToolFormat::Hermes, t);
    }
    // Arguments encoded as a string, and keys in the other order: still one call.
    let t = "<tool_call>{\"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\", \"name\": \"get_weather\"}</tool_call>";
    assert_eq!(
        parse(ToolFormat::Hermes, t).calls,
        vec![call("get_weather", "{\"city\": \"Rome\"}")]
    );
    check_streaming(ToolFormat::Hermes, t);
}

#[test]
fn malformed_truncated_and_unknown_calls_are_content() {
    for t in [
        "<tool_call>\nnot json at all\n</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par",
        "<tool_call>\n{\"name\": \"delete_everything\", \"arguments\": {}}\n</tool_call>",
        "<tool_call>\n{\"name\": 42}\n</tool_call>",
        "<tool_call>",
    ] {
        let r = parse(ToolFormat::Hermes, t);
        assert!(r.calls.is_empty(), "{t}: {r:?}");
        assert!(r.content.contains("<tool_call>"), "{t}: {r:?}");
        check_streaming(ToolFormat::Hermes, t);
    }
    // A good call followed by a truncated one keeps the good one.
    let t = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"run\", \"argu";
    let r = parse(ToolFormat::Hermes, t);
    assert_eq!(r.calls, vec![call("now", "{}")]);
    assert!(
        r.content.starts_with("<tool_call>\n{\"name\": \"run\""),
        "{r:?}"
    );
}

#[test]
fn streaming_events_follow_openai_order() {
    let mut p = ToolCallParser::new(ToolFormat::Hermes, names(), true);
    let mut ev = Vec::new();
    for piece in [
        "<tool_",
        "call>\n{\"name\": \"get_",
        "weather\", \"argu",
        "ments\": {\"ci",
        "ty\": \"Paris\"}}\n</tool_call>",
    ] {
        ev.extend(p.push(piece));
    }
    ev.extend(p.finish());
    let starts = ev
        .iter()
        .filter(|e| matches!(e, ToolEvent::Start { .. }))
        .count();
    let args: Vec<&str> = ev
        .iter()
        .filter_map(|e| match e {
            ToolEvent::Args { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(starts, 1);
    assert!(args.len() >= 2, "arguments arrive in fragments: {ev:?}");
    assert_eq!(args.concat(), "{\"city\": \"Paris\"}");
    assert!(
        !ev.iter().any(|e| matches!(e, ToolEvent::Content(_))),
        "{ev:?}"
    );
}

#[test]
fn llama3_json_and_python_tag() {
    // The Llama 3.2 template's own format.
    let t = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    assert_eq!(
        parse(ToolFormat::Llama3Json, t).calls,
        vec![call("get_weather", "{\"city\": \"Paris\"}")]
    );
    check_streaming(ToolFormat::Llama3Json, t);
    let t = "<|python_tag|>{\"name\": \"now\", \"parameters\": {}}; {\"name\": \"run\", \"parameters\": {\"cmd\": \"ls\"}}";
    let r = parse(ToolFormat::Llama3Json, t);
    assert_eq!(r.calls.len(), 2, "{r:?}");
    check_streaming(ToolFormat::Llama3Json, t);
    // JSON that is not a call stays content.
    let t = "{\"answer\": 42}";
    assert_eq!(parse(ToolFormat::Llama3Json, t).content, t);
    check_streaming(ToolFormat::Llama3Json, t);
    let t = "  Sure: {\"name\": \"now\", \"parameters\": {}}";
    assert!(parse(ToolFormat::Llama3Json, t).calls.is_empty());
}

#[test]
fn mistral_list_and_v11() {
    let t = "[TOOL_CALLS][{\"id\": \"a1b2c3d4e\", \"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"now\", \"arguments\": {}}]";
    let r = parse(ToolFormat::Mistral { v11: false }, t);
    assert_eq!(r.calls.len(), 2, "{r:?}");
    assert_eq!(r.calls[0].id.as_deref(), Some("a1b2c3d4e"));
    check_streaming(ToolFormat::Mistral { v11: false }, t);
    let f = ToolFormat::Mistral { v11: true };
    let t = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]now[ARGS]{}";
    let r = parse(f, t);
    assert_eq!(
        r.calls,
        vec![
            call("get_weather", "{\"city\":\"Paris\"}"),
            call("now", "{}")
        ]
    );
    check_streaming(f, t);
    assert!(parse(f, "[TOOL_CALLS]get_weather[ARGS]{\"city\": ")
        .calls
        .is_empty());
}

#[test]
fn function_gemma_blocks() {
    let t = "<start_function_call>call:get_weather{city:<escape>Paris, FR<escape>,days:3,metric:true}<end_function_call>";
    let r = parse(ToolFormat::FunctionGemma, t);
    assert_eq!(r.calls.len(), 1, "{r:?}");
    let v: serde_json::Value = serde_json::from_str(&r.calls[0].arguments).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"city": "Paris, FR", "days": 3, "metric": true})
    );
    check_streaming(ToolFormat::FunctionGemma, t);
    let bad = "<start_function_call>call:get_weather{city:<escape>Par";
    assert_eq!(parse(ToolFormat::FunctionGemma, bad).content, bad);
}

#[test]
fn generic_json_lines_fences_and_tool_code() {
    let f = ToolFormat::Generic;
    let t = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n{\"name\": \"now\", \"arguments\": {}}";
    assert_eq!(parse(f, t).calls.len(), 2);
    check_streaming(f, t);
    let t = "```json\n{\"name\": \"now\", \"arguments\": {}}\n```";
    assert_eq!(parse(f, t).calls, vec![call("now", "{}")]);
    check_streaming(f, t);
    let t = "```python\nprint(1)\n```";
    assert_eq!(parse(f, t).content, t);
    check_streaming(f, t);
    // Gemma 3's function-calling blocks.
    let t = "I will look.\n```tool_code\nget_weather(city=\"Paris\", days=2)\n```";
    let r = parse(f, t);
    assert_eq!(r.content, "I will look.");
    assert_eq!(
        r.calls,
        vec![call("get_weather", "{\"city\":\"Paris\",\"days\":2}")]
    );
    check_streaming(f, t);
}

#[test]
fn detection_from_templates() {
    let cases = [
        ("{{- '<tool_call>\\n' }}", ToolFormat::Hermes),
        (
            "{{- '[TOOL_CALLS]' + tool_calls|tojson }}",
            ToolFormat::Mistral { v11: false },
        ),
        (
            "[TOOL_CALLS]{{ name }}[ARGS]{{ args }}",
            ToolFormat::Mistral { v11: true },
        ),
        (
            "{{ '<start_function_call>call:' }}",
            ToolFormat::FunctionGemma,
        ),
        (
            "{%- if tools %}<|start_header_id|>{{ '\"parameters\": ' }}",
            ToolFormat::Llama3Json,
        ),
        (
            "{{ '<|im_start|>' + message['role'] }}",
            ToolFormat::Generic,
        ),
    ];
    for (t, f) in cases {
        assert_eq!(ToolFormat::detect(t), f, "{t}");
    }
}

#[test]
fn grammars_name_their_tools() {
    let tools = vec![grammar::GrammarTool {
        name: "get_weather".into(),
        arguments: serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}}),
    }];
    let tok = |s: &str| {
        (s == "<tool_call>")
            .then_some(7)
            .or((s == "</tool_call>").then_some(8))
    };
    let g = grammar::required(ToolFormat::Hermes, &tools, true, &tok);
    assert!(
        g.starts_with("start: block (\"\\n\" block)* \"\\n\"?\n"),
        "{g}"
    );
    assert!(g.contains("<[7]> \"\\n\" call \"\\n\" <[8]>"), "{g}");
    assert!(g.contains("\"const\":\"get_weather\""), "{g}");
    let lazy = grammar::lazy(ToolFormat::Hermes, &tools, false, &tok);
    assert_eq!(lazy.len(), 2);
    assert_eq!(lazy[0].trigger, grammar::Trigger::Token(7));
    assert_eq!(lazy[1].trigger, grammar::Trigger::JsonStart);
    assert!(
        lazy[0]
            .lark
            .starts_with("start: \"\\n\" call \"\\n\" <[8]> \"\\n\"?\n"),
        "{}",
        lazy[0].lark
    );
    // Without the markup tokens there is no lazy trigger for Hermes.
    assert!(grammar::lazy(ToolFormat::Hermes, &tools, false, &|_| None).is_empty());
}

// ---- harmony (GPT-OSS) ----------------------------------------------------------------------

const H_ANALYSIS: &str = "<|channel|>analysis<|message|>The user wants the weather in Z\u{fc}rich; call get_weather.<|end|>";
const H_CALL: &str = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"Z\u{fc}rich\"}";

/// Feeds `text` split in two at every character boundary (and a character at a time): every
/// split folds to the one-shot parse, which is returned. No markup reaches content or reasoning.
fn check_harmony(text: &str, parallel: bool) -> ParsedReply {
    let whole = parse_tool_calls(ToolFormat::Harmony, &names(), parallel, text);
    let mut cuts: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    cuts.push(text.len());
    for cut in cuts {
        let mut p = ToolCallParser::new(ToolFormat::Harmony, names(), parallel);
        let mut ev = p.push(&text[..cut]);
        ev.extend(p.push(&text[cut..]));
        ev.extend(p.finish());
        assert_eq!(collect(ev), whole, "split at {cut}: {text:?}");
    }
    let mut p = ToolCallParser::new(ToolFormat::Harmony, names(), parallel);
    let mut ev = Vec::new();
    for c in text.chars() {
        ev.extend(p.push(&c.to_string()));
    }
    ev.extend(p.finish());
    assert_eq!(collect(ev), whole, "a character at a time: {text:?}");
    for m in HARMONY_MARKERS {
        assert!(
            !whole.content.contains(m) && !whole.reasoning.contains(m),
            "{m} leaked: {whole:?}"
        );
    }
    whole
}

#[test]
fn harmony_call_after_analysis() {
    // As the model writes it: `<|call|>` ends generation, so it usually never arrives.
    for end in ["", "<|call|>"] {
        let t = format!("{H_ANALYSIS}{H_CALL}{end}");
        let r = check_harmony(&t, true);
        assert_eq!(
            r.calls,
            vec![call("get_weather", "{\"location\":\"Z\u{fc}rich\"}")]
        );
        assert_eq!(r.content, "");
        assert_eq!(
            r.reasoning,
            "The user wants the weather in Z\u{fc}rich; call get_weather."
        );
    }
    // The template's own form: the recipient before the channel, `json` without `<|constrain|>`.
    let t = "<|channel|>analysis<|message|>Time?<|end|><|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>";
    let r = check_harmony(t, true);
    assert_eq!(r.calls, vec![call("now", "{}")]);
    assert_eq!(r.reasoning, "Time?");
    // A call without any analysis first.
    let t =
        "<|channel|>commentary to=functions.run <|constrain|>json<|message|>{\"cmd\": \"ls <|x\"}";
    assert_eq!(
        check_harmony(t, true).calls,
        vec![call("run", "{\"cmd\": \"ls <|x\"}")]
    );
}

#[test]
fn harmony_final_answer_separates_reasoning_from_content() {
    let t = "<|channel|>analysis<|message|>2+2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>The answer is **4**.<|return|>";
    let r = check_harmony(t, true);
    assert_eq!(r.content, "The answer is **4**.");
    assert_eq!(r.reasoning, "2+2 is 4.");
    assert!(r.calls.is_empty());
    // Cut off inside the analysis (token limit): what came is reasoning, no content.
    let r = check_harmony("<|channel|>analysis<|message|>Let me th", true);
    assert_eq!(
        (r.content.as_str(), r.reasoning.as_str()),
        ("", "Let me th")
    );
    // Text without any markup is content; a commentary preamble without a recipient too.
    assert_eq!(check_harmony("Hello there.", true).content, "Hello there.");
    let t = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done";
    assert_eq!(check_harmony(t, true).content, "Checking.Done");
}

#[test]
fn harmony_parallel_calls() {
    let second = H_CALL.replace("Z\u{fc}rich", "Rome");
    let t = format!("{H_ANALYSIS}{H_CALL}<|call|>{second}<|call|>");
    let r = check_harmony(&t, true);
    assert_eq!(r.calls.len(), 2, "{r:?}");
    assert_eq!(r.calls[1].arguments, "{\"location\":\"Rome\"}");
    let r = check_harmony(&t, false);
    assert_eq!(r.calls.len(), 1, "{r:?}");
    assert_eq!(r.content, "");
}

#[test]
fn harmony_malformed_and_unknown_calls_are_content() {
    let head = "<|channel|>commentary to=functions.";
    for (name, body) in [
        ("get_weather", "{\"location\": Paris}"),
        ("get_weather", "{\"location\": \"Par"),
        ("get_weather", "\"Paris\""),
        ("get_weather", "{} {}"),
        ("delete_everything", "{}"),
    ] {
        let t = format!(
            "{H_ANALYSIS}<|start|>assistant{head}{name} <|constrain|>json<|message|>{body}<|call|>"
        );
        let r = check_harmony(&t, true);
        assert!(r.calls.is_empty(), "{t}: {r:?}");
        assert_eq!(r.content, body, "{t}");
    }
    // A good call followed by a broken one keeps the good one.
    let t = format!("{H_CALL}<|call|><|start|>assistant{head}now<|message|>{{oops");
    let r = check_harmony(&t, true);
    assert_eq!(r.calls.len(), 1, "{r:?}");
    assert_eq!(r.content, "{oops");
}

#[test]
fn harmony_streams_events_in_order() {
    let mut p = ToolCallParser::new(ToolFormat::Harmony, names(), true);
    let mut ev = Vec::new();
    for piece in [
        "<|channel|>",
        "analysis<|message|>Need",
        " weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_",
        "weather <|constrain|>json<|message|>{\"loc",
        "ation\":\"Paris\"}",
    ] {
        ev.extend(p.push(piece));
    }
    ev.extend(p.finish());
    assert!(p.has_calls());
    let reasoning: String = ev
        .iter()
        .filter_map(|e| match e {
            ToolEvent::Reasoning(t) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(reasoning, "Need weather.");
    let args: Vec<&str> = ev
        .iter()
        .filter_map(|e| match e {
            ToolEvent::Args { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert!(args.len() >= 2, "arguments arrive in fragments: {ev:?}");
    assert_eq!(args.concat(), "{\"location\":\"Paris\"}");
    let starts = ev
        .iter()
        .filter(|e| matches!(e, ToolEvent::Start { .. }))
        .count();
    assert_eq!(starts, 1);
    assert!(
        !ev.iter().any(|e| matches!(e, ToolEvent::Content(_))),
        "{ev:?}"
    );
}

#[test]
fn harmony_detection_and_grammar() {
    // GPT-OSS's template (the whole template: chat_template_parity.rs).
    let t = "{{- \"<|start|>assistant<|channel|>analysis<|message|>\" + message.thinking + \"<|end|>\" }}";
    assert_eq!(ToolFormat::detect(t), ToolFormat::Harmony);
    let tools = vec![grammar::GrammarTool {
        name: "get_weather".into(),
        arguments: serde_json::json!({"type": "object"}),
    }];
    let tok = |s: &str| {
        HARMONY_MARKERS
            .iter()
            .position(|m| *m == s)
            .map(|i| 200_000 + i as u32)
    };
    let g = grammar::required(ToolFormat::Harmony, &tools, true, &tok);
    assert!(
        g.starts_with("start: <[200001]> \"commentary to=functions.\" call\n"),
        "{g}"
    );
    assert!(
        g.contains("c0: \"get_weather\" \" \" <[200006]> \"json\" <[200002]> a0"),
        "{g}"
    );
    assert!(grammar::lazy(ToolFormat::Harmony, &tools, true, &tok).is_empty());
}
