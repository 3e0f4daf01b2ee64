//! One attempt of each template: the calls it makes (prompts from [`super::prompts`]), the
//! replies read with [`super::parse`], the record written in its format with
//! [`super::super::map::write`]. An unusable reply ends the attempt as a skip naming where its
//! input came from; a stop or a fatal error of the client ends the run.

use serde_json::Value;

use super::super::map::{self, Preference};
use super::super::{Format, Item};
use super::prompts::{self, fill};
use super::{parse, CallError, Complete, GenConfig, Reply, Request, Setting, Template};
use super::{Line, Rephrasable};
use crate::batch::SplitMix;
use crate::data::{Record, Turn};

/// How many seed tasks a self-instruct prompt shows.
pub const SEEDS_SHOWN: usize = 3;

/// Why an attempt gave no record.
pub enum Fail {
    /// Skipped: (file, line, why).
    Skip(String, usize, String),
    /// The run ends (stopped, or the server cannot be used).
    Halt(CallError),
}

type Step<T> = std::result::Result<T, Fail>;

fn turn(role: &str, content: &str) -> Turn {
    Turn {
        role: role.into(),
        content: content.into(),
    }
}

/// A call's seed: from the run's seed, the attempt and the call within it (53 bits, exact
/// in any JSON reader).
pub fn call_seed(seed: u64, attempt: usize, call: usize) -> u64 {
    let mut r = SplitMix(seed ^ ((attempt as u64) << 20) ^ call as u64);
    r.next_u64() >> 11
}

pub struct Caller<'a> {
    client: &'a dyn Complete,
    cfg: &'a GenConfig,
    pub requests: usize,
    pub truncated: usize,
    /// The attempt now running, and its calls so far.
    attempt: usize,
    calls: usize,
    /// Where the attempt's input is: what a skip names.
    origin: (String, usize),
}

impl<'a> Caller<'a> {
    pub fn new(client: &'a dyn Complete, cfg: &'a GenConfig) -> Caller<'a> {
        Caller {
            client,
            cfg,
            requests: 0,
            truncated: 0,
            attempt: 0,
            calls: 0,
            origin: (String::new(), 0),
        }
    }

    fn skip<T>(&self, why: impl Into<String>) -> Step<T> {
        Err(Fail::Skip(self.origin.0.clone(), self.origin.1, why.into()))
    }

    /// One call with `setting`.
    fn ask_with(&mut self, setting: &Setting, messages: &[Turn]) -> Step<Reply> {
        let req = Request {
            messages,
            model: setting.model.as_deref(),
            temperature: setting.temperature,
            max_tokens: self.cfg.max_tokens,
            seed: call_seed(self.cfg.seed, self.attempt, self.calls),
        };
        self.calls += 1;
        self.requests += 1;
        match self.client.complete(&req) {
            Ok(r) => {
                self.truncated += usize::from(r.truncated);
                Ok(r)
            }
            Err(CallError::Unusable(m)) => self.skip(m),
            Err(e) => Err(Fail::Halt(e)),
        }
    }

    /// One call of a single user turn with the run's setting.
    fn ask(&mut self, prompt: &str) -> Step<Reply> {
        let setting = self.cfg.setting.clone();
        self.ask_with(&setting, &[turn("user", prompt)])
    }

    fn from(&mut self, l: &Line) {
        self.origin = (l.file.clone(), l.line);
    }

    /// Attempt `i`: a record in its output format, or why not.
    pub fn attempt(&mut self, i: usize) -> Step<Value> {
        self.attempt = i;
        self.calls = 0;
        let name = self.cfg.template.name();
        self.origin = (name.to_string(), i + 1);
        let cfg: &'a GenConfig = self.cfg;
        let record = match &cfg.template {
            Template::SelfInstruct { seeds } => self.self_instruct(seeds, i)?,
            Template::Qa { passages } => self.qa(&passages[i % passages.len()])?,
            Template::Rephrase { inputs, style, .. } => {
                let input = &inputs[i % inputs.len()];
                self.origin = (input.file.clone(), input.line);
                self.rephrase(&input.what, style)?
            }
            Template::Classify { labels, about } => self.classify(labels, about, i)?,
            Template::Chats { topics, turns } => self.chats(&topics[i % topics.len()], *turns)?,
            Template::DpoPairs {
                prompts,
                chosen,
                rejected,
            } => self.dpo(&prompts[i % prompts.len()], chosen, rejected)?,
        };
        match map::write(&record.0, record.1) {
            Ok(v) => Ok(v),
            Err(m) => self.skip(m),
        }
    }

    fn self_instruct(&mut self, seeds: &[Line], i: usize) -> Step<(Item, Format)> {
        let mut order: Vec<usize> = (0..seeds.len()).collect();
        SplitMix(self.cfg.seed ^ (i as u64).wrapping_mul(0x2545_F491_4F6C_DD1D))
            .shuffle(&mut order);
        let shown: Vec<&str> = order
            .iter()
            .take(SEEDS_SHOWN)
            .map(|&j| seeds[j].text.as_str())
            .collect();
        let r = self.ask(&fill(
            prompts::SELF_INSTRUCT_TASK,
            &[("examples", &prompts::numbered(&shown))],
        ))?;
        let Some(task) = parse::line(&r.text, &["new task", "task", "instruction"]) else {
            return self.skip("the reply has no task");
        };
        if seeds.iter().any(|s| s.text.eq_ignore_ascii_case(&task)) {
            return self.skip(format!("the new task repeats a seed task: {task}"));
        }
        let a = self.ask(&fill(prompts::AS_IS, &[("text", &task)]))?;
        let Some(answer) = parse::text(&a.text, &["answer"]) else {
            return self.skip("an empty answer to the new task");
        };
        Ok(chat(vec![turn("user", &task), turn("assistant", &answer)]))
    }

    fn qa(&mut self, passage: &Line) -> Step<(Item, Format)> {
        self.from(passage);
        let r = self.ask(&fill(prompts::QA_QUESTION, &[("passage", &passage.text)]))?;
        let Some(q) = parse::line(&r.text, &["question", "q"]) else {
            return self.skip("the reply has no question");
        };
        let a = self.ask(&fill(
            prompts::QA_ANSWER,
            &[("passage", &passage.text), ("question", &q)],
        ))?;
        let Some(answer) = parse::text(&a.text, &["answer", "a"]) else {
            return self.skip("an empty answer to the question");
        };
        Ok(chat(vec![turn("user", &q), turn("assistant", &answer)]))
    }

    fn rewrite(&mut self, text: &str, style: &str) -> Step<String> {
        let r = self.ask(&fill(
            prompts::REPHRASE,
            &[("style", style), ("text", text)],
        ))?;
        match parse::text(&r.text, &["rewritten text", "rewritten", "text"]) {
            Some(t) => Ok(t),
            None => self.skip("an empty rewrite"),
        }
    }

    fn rephrase(&mut self, what: &Rephrasable, style: &str) -> Step<(Item, Format)> {
        match what {
            Rephrasable::Text(t) => {
                let completion = self.rewrite(t, style)?;
                Ok((
                    Item::Sft(Record::Text {
                        prompt: t.clone(),
                        completion,
                    }),
                    Format::PromptCompletion,
                ))
            }
            Rephrasable::Record(item, format) => {
                let mut item = item.clone();
                match &mut item {
                    Item::Sft(Record::Chat(turns) | Record::Reply { turns, .. }) => {
                        let mut any = false;
                        for t in turns.iter_mut().filter(|t| t.role == "assistant") {
                            t.content = self.rewrite(&t.content, style)?;
                            any = true;
                        }
                        if !any {
                            return self.skip("the record has no assistant turn to rewrite");
                        }
                    }
                    Item::Sft(Record::Text { completion, .. }) => {
                        *completion = self.rewrite(completion, style)?;
                    }
                    Item::Dpo(_) => return self.skip("a preference record is not rewritten"),
                }
                Ok((item, *format))
            }
        }
    }

    fn classify(&mut self, labels: &[String], about: &str, i: usize) -> Step<(Item, Format)> {
        let label = &labels[i % labels.len()];
        let all = labels.join(", ");
        let about = if about.trim().is_empty() {
            "texts"
        } else {
            about.trim()
        };
        let r = self.ask(&fill(
            prompts::CLASSIFY_EXAMPLE,
            &[("about", about), ("label", label), ("labels", &all)],
        ))?;
        let Some(example) = parse::text(&r.text, &["example", "text"]) else {
            return self.skip(format!("an empty example for the label '{label}'"));
        };
        let user = fill(
            prompts::CLASSIFY_RECORD,
            &[("labels", &all), ("text", &example)],
        );
        Ok(chat(vec![turn("user", &user), turn("assistant", label)]))
    }

    fn chats(&mut self, topic: &Line, turns: usize) -> Step<(Item, Format)> {
        self.from(topic);
        let mut conv: Vec<Turn> = Vec::new();
        for k in 0..turns {
            let prompt = if k == 0 {
                fill(prompts::CHAT_FIRST_USER, &[("topic", &topic.text)])
            } else {
                fill(
                    prompts::CHAT_NEXT_USER,
                    &[
                        ("topic", &topic.text),
                        ("transcript", &prompts::transcript(&conv)),
                    ],
                )
            };
            let r = self.ask(&prompt)?;
            let Some(user) = parse::user_turn(&r.text) else {
                return self.skip(format!("an empty user turn {}", k + 1));
            };
            conv.push(turn("user", &user));
            let setting = self.cfg.setting.clone();
            let a = self.ask_with(&setting, &conv)?;
            let Some(answer) = parse::text(&a.text, &[]) else {
                return self.skip(format!("an empty assistant turn {}", k + 1));
            };
            conv.push(turn("assistant", &answer));
        }
        Ok(chat(conv))
    }

    fn dpo(&mut self, prompt: &Line, chosen: &Setting, rejected: &Setting) -> Step<(Item, Format)> {
        self.from(prompt);
        let user = [turn(
            "user",
            &fill(prompts::AS_IS, &[("text", &prompt.text)]),
        )];
        let c = self.ask_with(chosen, &user)?;
        let r = self.ask_with(rejected, &user)?;
        let (Some(c), Some(r)) = (parse::text(&c.text, &[]), parse::text(&r.text, &[])) else {
            return self.skip("an empty chosen or rejected reply");
        };
        if c == r {
            return self.skip("the chosen and rejected replies are the same");
        }
        Ok((
            Item::Dpo(Preference::Chat {
                prompt: user.to_vec(),
                chosen: vec![turn("assistant", &c)],
                rejected: vec![turn("assistant", &r)],
            }),
            Format::Dpo,
        ))
    }
}

fn chat(turns: Vec<Turn>) -> (Item, Format) {
    (Item::Sft(Record::Chat(turns)), Format::Messages)
}
