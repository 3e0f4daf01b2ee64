//! Each template's prompts and its reading of replies, with a scripted client that records
//! every request it gets and answers from a list (the HTTP path is tested against a real
//! server in the CLI's tests).

use std::cell::RefCell;

use serde_json::{json, Value};

use super::*;
use crate::dataset::{Dedup, Format, OnError};

/// A request as the script saw it: (model, temperature, seed, messages as (role, content)).
type SeenRequest = (Option<String>, f64, u64, Vec<(String, String)>);

/// Answers the i-th request with `replies[i]` (`None`: an unusable response), and keeps the
/// requests: (model, temperature, seed, messages as (role, content)).
struct Script {
    replies: Vec<Option<&'static str>>,
    seen: RefCell<Vec<SeenRequest>>,
    /// Fail fatally at this request.
    fatal_at: Option<usize>,
}

impl Script {
    fn new(replies: &[Option<&'static str>]) -> Script {
        Script {
            replies: replies.to_vec(),
            seen: RefCell::new(Vec::new()),
            fatal_at: None,
        }
    }
    fn prompt(&self, i: usize) -> String {
        self.seen.borrow()[i].3.last().unwrap().1.clone()
    }
}

impl Complete for Script {
    fn complete(&self, r: &Request) -> std::result::Result<Reply, CallError> {
        let n = self.seen.borrow().len();
        self.seen.borrow_mut().push((
            r.model.map(str::to_string),
            r.temperature,
            r.seed,
            r.messages
                .iter()
                .map(|t| (t.role.clone(), t.content.clone()))
                .collect(),
        ));
        if self.fatal_at == Some(n) {
            return Err(CallError::Fatal("connection refused".into()));
        }
        match self.replies.get(n) {
            Some(Some(t)) => Ok(Reply {
                text: t.to_string(),
                truncated: t.ends_with("..."),
            }),
            Some(None) => Err(CallError::Unusable("HTTP 400: prompt too long".into())),
            None => Err(CallError::Stopped),
        }
    }
}

#[derive(Default)]
struct Seen {
    records: Vec<(usize, Value)>,
    last: Option<(usize, usize, usize, usize)>,
}

impl Observer for Seen {
    fn record(&mut self, index: usize, record: &Value) {
        self.records.push((index, record.clone()));
    }
    fn progress(&mut self, done: usize, total: usize, generated: usize, skipped: usize) {
        self.last = Some((done, total, generated, skipped));
    }
}

fn line(file: &str, n: usize, text: &str) -> Line {
    Line {
        file: file.into(),
        line: n,
        text: text.into(),
    }
}

fn setting() -> Setting {
    Setting {
        model: Some("m".into()),
        temperature: 0.7,
    }
}

fn cfg(template: Template, count: Option<usize>) -> GenConfig {
    GenConfig {
        template,
        count,
        setting: setting(),
        max_tokens: 32,
        seed: 3,
    }
}

fn run(c: &GenConfig, s: &Script) -> (Generated, Seen) {
    let mut seen = Seen::default();
    let g = generate(c, s, &mut seen).unwrap();
    (g, seen)
}

#[test]
fn self_instruct_shows_seeds_then_answers_the_new_task() {
    let seeds = vec![
        line("seeds.txt", 1, "Write a haiku about rain."),
        line("seeds.txt", 2, "Name three fruits."),
        line("seeds.txt", 3, "Explain gravity to a child."),
        line("seeds.txt", 5, "Translate 'hello' to French."),
    ];
    let s = Script::new(&[
        Some("5. Describe a sunset in one sentence.\n6. Another"),
        Some("The sky glows orange."),
        Some("Name three fruits."),
        Some("Task: List two colours."),
        Some("  "),
    ]);
    let c = cfg(Template::SelfInstruct { seeds }, Some(4));
    let (g, seen) = run(&c, &s);
    let p = s.prompt(0);
    assert!(p.starts_with("Here are some example tasks:\n\n1. "), "{p}");
    assert_eq!(
        p.lines()
            .filter(|l| l.starts_with(char::is_numeric))
            .count(),
        templates::SEEDS_SHOWN
    );
    assert_eq!(s.prompt(1), "Describe a sunset in one sentence.");
    assert_eq!(
        g.records,
        [json!({"messages": [
            {"role": "user", "content": "Describe a sunset in one sentence."},
            {"role": "assistant", "content": "The sky glows orange."}
        ]})]
    );
    let why: Vec<&str> = g.problems.iter().map(|p| p.message.as_str()).collect();
    assert_eq!(why.len(), 2, "{why:?}");
    assert!(why[0].starts_with("the new task repeats a seed task"));
    assert_eq!(why[1], "an empty answer to the new task");
    // The fourth attempt's task call got no scripted reply: the run stopped there.
    assert!(g.stopped);
    assert_eq!((g.attempts, g.requests), (3, 6));
    assert_eq!(seen.records.len(), 1);
    assert_eq!(seen.last, Some((3, 4, 1, 2)));
    // Calls carry the setting and distinct seeds.
    let seeds: Vec<u64> = s.seen.borrow().iter().map(|r| r.2).collect();
    assert!(seeds.windows(2).all(|w| w[0] != w[1]));
    assert!(s
        .seen
        .borrow()
        .iter()
        .all(|r| r.0.as_deref() == Some("m") && r.1 == 0.7));
}

#[test]
fn qa_asks_a_question_of_the_passage_then_answers_with_it() {
    let passages = vec![
        line("notes/a.md", 3, "Bees make honey from nectar."),
        line("b.txt", 1, "Rust was first released in 2015."),
    ];
    let s = Script::new(&[
        Some("Question: What do bees make honey from?"),
        Some("Answer: From nectar."),
        None,
    ]);
    let c = cfg(Template::Qa { passages }, None);
    let (g, _) = run(&c, &s);
    assert!(s.prompt(0).contains("Bees make honey from nectar."));
    assert!(s.prompt(0).ends_with("Reply with the question only."));
    let p1 = s.prompt(1);
    assert!(
        p1.contains("Passage:\nBees make honey from nectar.")
            && p1.contains("Question: What do bees make honey from?"),
        "{p1}"
    );
    assert_eq!(
        g.records[0]["messages"][1]["content"], "From nectar.",
        "the label is taken off"
    );
    // The second passage's request was refused on its own: skipped, naming the passage.
    assert_eq!(g.problems.len(), 1);
    assert_eq!(
        (g.problems[0].file.as_str(), g.problems[0].line),
        ("b.txt", 1)
    );
    assert!(g.problems[0].message.contains("prompt too long"));
    assert!(!g.stopped);
}

#[test]
fn rephrase_rewrites_answers_and_keeps_the_format() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("in.jsonl");
    std::fs::write(
        &f,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Capital of France?\"}, {\"role\": \"assistant\", \"content\": \"Paris.\"}]}\n{\"text\": \"a plain text\"}\n{\"prompt\": \"p\", \"chosen\": \"a\", \"rejected\": \"b\"}\n",
    )
    .unwrap();
    let (inputs, problems) = sources::read_rephrase(&f).unwrap();
    let s = Script::new(&[
        Some("Here is the rewritten text:\nPARIS."),
        Some("A PLAIN TEXT"),
        Some("PARIS!"),
    ]);
    let c = cfg(
        Template::Rephrase {
            inputs: inputs.clone(),
            problems,
            style: "answer in uppercase".into(),
        },
        Some(3),
    );
    let (g, _) = run(&c, &s);
    assert_eq!(
        s.prompt(0),
        "Rewrite the text below in this style: answer in uppercase. Keep its meaning. Reply with the rewritten text only.\n\nText:\nParis."
    );
    assert_eq!(
        g.records,
        [
            json!({"messages": [
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "PARIS."}
            ]}),
            json!({"text": "A PLAIN TEXT"}),
            json!({"messages": [
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "PARIS!"}
            ]}),
        ]
    );
    // The preference row is a problem of its input line.
    assert_eq!(g.problems.len(), 1);
    assert_eq!(g.problems[0].line, 3);
    // A line of text becomes prompt (the text) and completion (the rewrite).
    let t = Template::Rephrase {
        inputs: vec![ToRephrase {
            file: "t.txt".into(),
            line: 1,
            what: Rephrasable::Text("hello there".into()),
        }],
        problems: Vec::new(),
        style: "formal".into(),
    };
    let s = Script::new(&[Some("Good day.")]);
    let (g, _) = run(&cfg(t, None), &s);
    assert_eq!(
        g.records,
        [json!({"prompt": "hello there", "completion": "Good day."})]
    );
}

#[test]
fn classify_makes_examples_whose_answer_is_the_label() {
    let t = Template::Classify {
        labels: vec!["positive".into(), "negative".into()],
        about: "product reviews".into(),
    };
    let s = Script::new(&[Some("\"I love it.\""), Some("Example: It broke in a day.")]);
    let (g, _) = run(&cfg(t, Some(2)), &s);
    assert_eq!(
        s.prompt(0),
        "Write one short example of product reviews that belongs to the category \"positive\" (the categories are: positive, negative). Reply with the example only."
    );
    assert!(s.prompt(1).contains("category \"negative\""));
    assert_eq!(
        g.records[1],
        json!({"messages": [
            {"role": "user", "content": "Classify the text into one of these categories: positive, negative. Reply with the category only.\n\nText:\nIt broke in a day."},
            {"role": "assistant", "content": "negative"}
        ]})
    );
    assert_eq!(
        g.records[0]["messages"][0]["content"]
            .as_str()
            .unwrap()
            .rsplit('\n')
            .next(),
        Some("I love it.")
    );
    let one = Template::Classify {
        labels: vec!["x".into()],
        about: String::new(),
    };
    let e = generate(&cfg(one, None), &s, &mut Seen::default()).unwrap_err();
    assert!(e.to_string().contains("at least two labels"), "{e}");
}

#[test]
fn chats_alternate_a_played_user_and_the_assistant() {
    let t = Template::Chats {
        topics: vec![line("topics.txt", 2, "baking bread")],
        turns: 2,
    };
    let s = Script::new(&[
        Some("User: How long should dough rise?"),
        Some("About an hour."),
        Some("And at what temperature?\nAssistant: Warm."),
        Some("Somewhere warm, around 25 C."),
    ]);
    let (g, _) = run(&cfg(t, None), &s);
    assert!(s.prompt(0).contains("about this topic: baking bread"));
    // The assistant's calls get the conversation so far as messages.
    assert_eq!(
        s.seen.borrow()[1].3,
        [(
            "user".to_string(),
            "How long should dough rise?".to_string()
        )]
    );
    let p2 = s.prompt(2);
    assert!(
        p2.contains("User: How long should dough rise?\n\nAssistant: About an hour.")
            && p2.contains("Write the user's next message"),
        "{p2}"
    );
    assert_eq!(s.seen.borrow()[3].3.len(), 3);
    let roles: Vec<&str> = g.records[0]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"]);
    assert_eq!(
        g.records[0]["messages"][2]["content"],
        "And at what temperature?"
    );
}

#[test]
fn dpo_pairs_take_chosen_and_rejected_from_their_settings() {
    let strong = Setting {
        model: Some("base:tuned".into()),
        temperature: 0.2,
    };
    let weak = Setting {
        model: Some("base".into()),
        temperature: 1.5,
    };
    let t = Template::DpoPairs {
        prompts: vec![line("p.txt", 1, "Say hi."), line("p.txt", 2, "Count to 3.")],
        chosen: strong.clone(),
        rejected: weak.clone(),
    };
    let s = Script::new(&[Some("Hi!"), Some("hi"), Some("1 2 3"), Some("1 2 3")]);
    let (g, _) = run(&cfg(t, None), &s);
    let seen = s.seen.borrow();
    assert_eq!((seen[0].0.as_deref(), seen[0].1), (Some("base:tuned"), 0.2));
    assert_eq!((seen[1].0.as_deref(), seen[1].1), (Some("base"), 1.5));
    assert_eq!(
        g.records,
        [json!({"prompt": [{"role": "user", "content": "Say hi."}],
                "chosen": [{"role": "assistant", "content": "Hi!"}],
                "rejected": [{"role": "assistant", "content": "hi"}]})]
    );
    assert_eq!(
        g.problems[0].message,
        "the chosen and rejected replies are the same"
    );
    let same = Template::DpoPairs {
        prompts: vec![line("p.txt", 1, "x")],
        chosen: strong.clone(),
        rejected: strong,
    };
    let e = generate(&cfg(same, None), &s, &mut Seen::default()).unwrap_err();
    assert!(e.to_string().contains("two different settings"), "{e}");
}

#[test]
fn a_fatal_client_error_fails_the_run_and_the_records_become_a_dataset() {
    let t = Template::Qa {
        passages: vec![line("a.txt", 1, "Text one."), line("a.txt", 5, "Text two.")],
    };
    let mut s = Script::new(&[Some("Q1?"), Some("A1."), Some("Q2?"), Some("A2...")]);
    s.fatal_at = Some(1);
    let e = generate(&cfg(t.clone(), None), &s, &mut Seen::default()).unwrap_err();
    assert_eq!(e.to_string(), "connection refused");

    let s = Script::new(&[Some("Q1?"), Some("A1."), Some("Q2?"), Some("A2...")]);
    let (g, _) = run(&cfg(t, Some(3)), &s);
    // Three attempts over two passages: the third uses the first again (and stops: no reply).
    assert!(g.stopped && g.attempts == 2 && g.truncated == 1);
    let b = BuildConfig {
        valid_split: 0.5,
        seed: 1,
        dedup: Dedup::Exact,
        on_error: OnError::Reject,
        ..Default::default()
    };
    let built = into_dataset(&g, &b).unwrap();
    assert_eq!((built.train.len(), built.valid.len()), (1, 1));
    let r = serde_json::to_value(&built.report).unwrap();
    assert_eq!(
        (
            &r["template"],
            &r["generated"],
            &r["requests"],
            &r["truncated"]
        ),
        (&json!("qa"), &json!(2), &json!(5), &json!(1))
    );
    assert_eq!(r["format"], "messages");
    assert_eq!(r["skipped"], 0);
    // A conversion the records have no form in is an error naming it.
    let e = into_dataset(
        &g,
        &BuildConfig {
            to: Some(Format::Dpo),
            ..b.clone()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("no dpo form"), "{e}");
    let none = Generated {
        records: Vec::new(),
        problems: vec![Problem {
            file: "a.txt".into(),
            line: 1,
            message: "an empty answer".into(),
        }],
        ..g
    };
    let e = into_dataset(&none, &b).unwrap_err().to_string();
    assert!(
        e.contains("no usable records") && e.contains("a.txt:1: an empty answer"),
        "{e}"
    );
}

#[test]
fn call_seeds_differ_by_attempt_and_call_and_fit_json() {
    let a = templates::call_seed(0, 0, 0);
    assert_ne!(a, templates::call_seed(0, 0, 1));
    assert_ne!(a, templates::call_seed(0, 1, 0));
    assert_ne!(a, templates::call_seed(1, 0, 0));
    assert_eq!(a, templates::call_seed(0, 0, 0));
    assert!((0..100).all(|i| templates::call_seed(9, i, 3) < 1 << 53));
}
