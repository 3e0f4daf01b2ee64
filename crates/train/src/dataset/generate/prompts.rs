//! Every prompt the generation templates send, in one place, each with a line on why it is
//! worded so. `{name}` marks are filled by [`fill`]. The prompts are written for small local
//! models: one short instruction, the material, and "Reply with ... only" last so that the
//! reply is the wanted text with little chatter (what chatter remains, [`super::parse`] trims).
//!
//! Not here: sending them (the caller's [`super::Complete`]) or reading the replies
//! ([`super::parse`]).

/// self-instruct, step 1: numbered examples show the style and size of a task better than a
/// description; "different from the examples" keeps the model from copying one back.
pub const SELF_INSTRUCT_TASK: &str = "Here are some example tasks:\n\n{examples}\n\nWrite one new task of the same kind, different from the examples. Reply with the task only.";

/// self-instruct, step 2 (and dpo-pairs, and each assistant turn of chats) send the task or
/// prompt itself as the user turn, with no wrapper: the record's answer is then what a model
/// answers to exactly the record's prompt.
pub const AS_IS: &str = "{text}";

/// qa, step 1: the passage first, then one question it answers, so that the question can be
/// answered from the text (not from the model's memory).
pub const QA_QUESTION: &str = "Read this passage:\n\n{passage}\n\nWrite one question that the passage answers. Reply with the question only.";

/// qa, step 2: the answer is asked with the passage in view (grounded), in a separate call so
/// that each reply is one plain text to take as it is.
pub const QA_ANSWER: &str = "Answer the question using the passage.\n\nPassage:\n{passage}\n\nQuestion: {question}\n\nReply with the answer only.";

/// rephrase: the style is named before the text and the meaning is to stay, so that only the
/// form changes (the record keeps its prompt and gets the rewritten answer).
pub const REPHRASE: &str = "Rewrite the text below in this style: {style}. Keep its meaning. Reply with the rewritten text only.\n\nText:\n{text}";

/// classify, generation: one example at a time for one named category, with the other
/// categories listed so that the example is typical of its own one.
pub const CLASSIFY_EXAMPLE: &str = "Write one short example of {about} that belongs to the category \"{label}\" (the categories are: {labels}). Reply with the example only.";

/// classify, the record's user turn: the instruction a classifier is later asked with, the
/// categories spelled out, so that the label alone is a complete answer.
pub const CLASSIFY_RECORD: &str =
    "Classify the text into one of these categories: {labels}. Reply with the category only.\n\nText:\n{text}";

/// chats, the first user turn: the model plays the person, not the assistant, which a chat
/// model only does when told so plainly.
pub const CHAT_FIRST_USER: &str = "You are a person starting a chat with an AI assistant about this topic: {topic}. Write your first message to the assistant. Reply with the message only.";

/// chats, a later user turn: the conversation so far as a transcript (roles as "User:" and
/// "Assistant:" lines), so that a model in its assistant role writes the user's side.
pub const CHAT_NEXT_USER: &str = "Here is a chat between a user and an AI assistant about {topic}:\n\n{transcript}\n\nWrite the user's next message, following on from the assistant's last reply. Reply with the message only.";

/// `template` with each `{name}` replaced by its value (values are not searched again, so a
/// text holding `{style}` stays as it is).
pub fn fill(template: &str, values: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(template.len() + 256);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let hit = after.find('}').and_then(|close| {
            let name = &after[..close];
            values
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (close, *v))
        });
        match hit {
            Some((close, v)) => {
                out.push_str(v);
                rest = &after[close + 1..];
            }
            None => {
                out.push('{');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// Numbered lines `1. a\n2. b`, as [`SELF_INSTRUCT_TASK`] shows its examples.
pub fn numbered(items: &[&str]) -> String {
    items
        .iter()
        .enumerate()
        .map(|(i, s)| format!("{}. {}", i + 1, s))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A conversation as `User: ...` / `Assistant: ...` paragraphs, for [`CHAT_NEXT_USER`].
pub fn transcript(turns: &[crate::data::Turn]) -> String {
    turns
        .iter()
        .map(|t| {
            let who = if t.role == "user" {
                "User"
            } else {
                "Assistant"
            };
            format!("{who}: {}", t.content)
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Turn;

    #[test]
    fn fill_replaces_known_marks_once() {
        let s = fill(
            REPHRASE,
            &[("style", "answer in uppercase"), ("text", "a {style} b")],
        );
        assert!(s.starts_with("Rewrite the text below in this style: answer in uppercase."));
        assert!(s.ends_with("Text:\na {style} b"), "{s}");
        assert_eq!(fill("{x} {y} {", &[("x", "1")]), "1 {y} {");
        for p in [
            SELF_INSTRUCT_TASK,
            QA_QUESTION,
            QA_ANSWER,
            REPHRASE,
            CLASSIFY_EXAMPLE,
            CLASSIFY_RECORD,
            CHAT_FIRST_USER,
            CHAT_NEXT_USER,
        ] {
            assert!(p.contains(" only."), "{p}");
        }
    }

    #[test]
    fn examples_and_transcripts() {
        assert_eq!(numbered(&["a", "b"]), "1. a\n2. b");
        let t = [
            Turn {
                role: "user".into(),
                content: "hi".into(),
            },
            Turn {
                role: "assistant".into(),
                content: "hello".into(),
            },
        ];
        assert_eq!(transcript(&t), "User: hi\n\nAssistant: hello");
    }
}
