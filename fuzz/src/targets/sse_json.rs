//! The SSE and JSON writers of the server, round-tripped: arbitrary text as a chat delta, a
//! completion chunk and an error message is framed as `hf2q serve` frames it, then parsed back as
//! a client would (split on blank lines, strip `data: `, parse JSON); the text must come back
//! unchanged and each frame must be exactly one event.

use hf2q_server::error::ApiError;
use hf2q_server::openai::{self, RespMeta};
use serde_json::{json, Value};

pub fn run(data: &[u8]) {
    let text = String::from_utf8_lossy(data).into_owned();
    let meta = RespMeta {
        id: format!("chatcmpl-{}", text.len()),
        created: 0,
        model: text.clone(),
    };
    let delta = json!({"index": 0, "delta": {"content": text}, "finish_reason": null});
    let frames = [
        openai::chat_chunk(&meta, Some(delta), None),
        openai::completion_chunk(
            &meta,
            Some(json!({"index": 0, "text": text, "finish_reason": null})),
            None,
        ),
        ApiError::invalid("messages", text.clone()).body(),
    ];
    for v in &frames {
        let frame = openai::sse(v);
        let events: Vec<&str> = frame.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(
            events.len(),
            1,
            "one value became {} SSE events: {frame:?}",
            events.len()
        );
        assert!(frame.ends_with("\n\n"));
        let payload = events[0]
            .strip_prefix("data: ")
            .expect("the frame starts with 'data: '");
        assert!(
            !payload.contains('\n'),
            "a raw newline inside an SSE data line"
        );
        let back: Value = serde_json::from_str(payload).expect("the frame's JSON parses");
        assert_eq!(&back, v, "the value changed through its SSE frame");
    }
    assert_eq!(
        frames[0]["choices"][0]["delta"]["content"],
        Value::String(text.clone())
    );
    assert_eq!(frames[1]["choices"][0]["text"], Value::String(text.clone()));
    assert_eq!(frames[0]["model"], Value::String(text));
}
