//! `POST /v1/chat/completions` and `POST /v1/completions`: parse, tokenize, submit to the
//! engine, then either collect the whole answer or stream it as server-sent events.
//!
//! Streaming framing is OpenAI's: one `data: {json}\n\n` frame per chunk, chat streams start
//! with a `{"role": "assistant", "content": ""}` delta per choice, every choice ends with a chunk
//! carrying its `finish_reason` and an empty delta, `stream_options.include_usage` adds
//! `"usage": null` to every chunk and a last chunk with no choices and the usage, and the stream
//! ends with `data: [DONE]`. An error after the stream started is sent as a `data: {"error":
//! ...}` frame (what OpenAI does and its clients raise).
//!
//! Disconnects: the tickets live in the handler future (non-streaming) or in the response body
//! stream (streaming); the server drops either when the client goes away, which drops the
//! tickets, which cancels the sequences in the engine.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, SelectAll, Stream, StreamExt};
use hf2q_models::chat_template::{encode_chat_json, RenderOptions};
use hf2q_models::constraint::Constraint;
use hf2q_models::tool_calls::ToolFormat;
use hf2q_models::Model;
use serde_json::{json, Value};

use super::{json_body, Shared};
use crate::chat_tools::output::{message_calls, StreamCalls};
use crate::chat_tools::{render, ToolsRequest};
use crate::engine::adapters::AdapterRef;
use crate::engine::{Event, GenRequest, SubmitError, Ticket, TokenLogprob};
use crate::error::{ApiError, ApiResult};
use crate::openai::{self, ChoiceOut, Common, Prompt, RespMeta};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// One choice being generated.
struct Job {
    index: usize,
    /// Index of the prompt this choice continues (`n` choices share one).
    prompt: usize,
    ticket: Ticket,
    /// Text shown before the generated text (`echo`).
    echo: String,
}

pub async fn chat(State(st): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    chat_inner(st, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub async fn completions(
    State(st): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    completions_inner(st, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_inner(st: Shared, body: Result<Bytes, BytesRejection>) -> ApiResult<Response> {
    let v = json_body(body, st.cfg.max_body_bytes)?;
    let req = openai::parse_chat(&v, st.limits())?;
    let adapter = st.resolve_model(req.common.model.as_deref())?;
    let st2 = st.clone();
    let (messages, tools, rf) = (req.messages, req.tools, req.response_format);
    let extra = template_variables(&st, req.reasoning_effort)?;
    let tools2 = tools.clone();
    let (prompt, extras) = blocking(move || {
        let model = st2.engine.model();
        let tok = model.tokenizer();
        let fmt = st2.tool_format;
        let (msgs, tools_var) =
            render::template_inputs(&messages, tools2.as_ref(), fmt, st2.renders_tools);
        let opts = RenderOptions {
            add_generation_prompt: true,
            tools: tools_var.as_ref(),
            extra: Some(&extra),
        };
        let ids = encode_chat_json(tok, &st2.template, &msgs, &opts).map_err(|e| {
            ApiError::invalid(
                "messages",
                format!("the chat template could not render these messages: {e}"),
            )
        })?;
        let active = tools2.as_ref().is_some_and(ToolsRequest::active);
        let constraint = if rf.is_some() || active {
            let env = st2.constraint_env()?;
            render::constraint(env, tok, fmt, tools2.as_ref(), rf.as_ref())?
        } else {
            None
        };
        let keep_tokens = if active || fmt.reads_every_reply() {
            render::markup_tokens(fmt, tok)
        } else {
            Vec::new()
        };
        Ok((
            ids,
            Extras {
                constraint,
                keep_tokens,
                adapter: None,
            },
        ))
    })
    .await?;
    let extras = Extras {
        adapter: adapter.clone(),
        ..extras
    };
    let (jobs, prompt_tokens) = submit(
        &st,
        &req.common,
        vec![(prompt, String::new())],
        req.logprobs,
        extras,
    )?;
    let meta = meta(st.model_id(adapter.as_ref()), "chatcmpl");
    let calls = match tools.filter(ToolsRequest::active) {
        Some(t) => Some((st.tool_format, t)),
        None if st.tool_format.reads_every_reply() => Some((st.tool_format, ToolsRequest::none())),
        None => None,
    };
    respond(
        &st,
        Kind::Chat,
        meta,
        &req.common,
        jobs,
        prompt_tokens,
        req.logprobs.is_some(),
        calls,
    )
    .await
}

/// The template variables a chat request sets beyond messages and tools: `reasoning_effort`,
/// refused for templates that do not read it.
fn template_variables(
    st: &Shared,
    reasoning_effort: Option<String>,
) -> ApiResult<serde_json::Map<String, Value>> {
    let mut extra = serde_json::Map::new();
    if let Some(effort) = reasoning_effort {
        if !st.template.source().contains("reasoning_effort") {
            return Err(ApiError::unsupported(
                "reasoning_effort",
                "'reasoning_effort' is not supported by this model: its chat template has no reasoning effort",
            ));
        }
        extra.insert("reasoning_effort".into(), effort.into());
    }
    Ok(extra)
}

/// What a chat request adds to its engine requests.
#[derive(Default)]
struct Extras {
    constraint: Option<Constraint>,
    keep_tokens: Vec<u32>,
    /// The served adapter the request names.
    adapter: Option<AdapterRef>,
}

/// The tool calls a chat reply is parsed for: the model's format and the request's tools.
type Calls = Option<(ToolFormat, ToolsRequest)>;

async fn completions_inner(st: Shared, body: Result<Bytes, BytesRejection>) -> ApiResult<Response> {
    let v = json_body(body, st.cfg.max_body_bytes)?;
    let req = openai::parse_completion(&v, st.limits())?;
    let adapter = st.resolve_model(req.common.model.as_deref())?;
    let st2 = st.clone();
    let (prompts, echo) = (req.prompts, req.echo);
    let encoded = blocking(move || {
        let tok = st2.engine.model().tokenizer();
        prompts
            .into_iter()
            .map(|p| {
                let (ids, text) = match p {
                    // A raw completion prompt is the client's whole text: special tokens in it
                    // are meant as such, and BOS is added when the model wants one.
                    Prompt::Text(t) => (
                        tok.encode(&t, true, true)
                            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?,
                        t,
                    ),
                    Prompt::Tokens(ids) => {
                        let t = if echo {
                            tok.decode(&ids, false)
                                .map_err(|e| ApiError::invalid("prompt", e.to_string()))?
                        } else {
                            String::new()
                        };
                        (ids, t)
                    }
                };
                Ok((ids, if echo { text } else { String::new() }))
            })
            .collect::<ApiResult<Vec<_>>>()
    })
    .await?;
    let extras = Extras {
        adapter: adapter.clone(),
        ..Extras::default()
    };
    let (jobs, prompt_tokens) = submit(&st, &req.common, encoded, req.logprobs, extras)?;
    let meta = meta(st.model_id(adapter.as_ref()), "cmpl");
    respond(
        &st,
        Kind::Completion,
        meta,
        &req.common,
        jobs,
        prompt_tokens,
        req.logprobs.is_some(),
        None,
    )
    .await
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("tokenization failed: {e}")))?
}

fn meta(model: String, prefix: &str) -> RespMeta {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    // Unique per process and unlikely to repeat across restarts; not a secret.
    let id = format!(
        "{prefix}-{:x}{:06x}",
        now.as_nanos() & 0xffff_ffff_ffff,
        n & 0xff_ffff
    );
    RespMeta {
        id,
        created: now.as_secs(),
        model,
    }
}

/// Checks lengths against the context, builds `n` engine requests per prompt and submits them
/// together. Returns the jobs (choice index = prompt index * n + j) and the prompt token count
/// (each prompt counted once, as OpenAI's usage does).
fn submit(
    st: &Shared,
    c: &Common,
    prompts: Vec<(Vec<u32>, String)>,
    logprobs: Option<usize>,
    extras: Extras,
) -> ApiResult<(Vec<Job>, usize)> {
    let ctx = st.cfg.engine.ctx_size;
    let deadline =
        (!st.cfg.request_timeout.is_zero()).then(|| Instant::now() + st.cfg.request_timeout);
    let mut reqs = Vec::new();
    let mut echoes = Vec::new();
    let mut prompt_tokens = 0;
    for (ids, echo) in prompts {
        let p = ids.len();
        if p == 0 {
            return Err(ApiError::invalid(
                "prompt",
                "the prompt is empty (no tokens to generate from)",
            ));
        }
        let too_long = |total: usize, detail: String| {
            ApiError::invalid(
                "messages",
                format!("This model's maximum context length is {ctx} tokens. However, you requested {total} tokens ({detail}). Please reduce the length of the messages or completion."),
            )
            .with_code("context_length_exceeded")
        };
        if p >= ctx {
            return Err(too_long(
                p + 1,
                format!("{p} in the messages, at least 1 in the completion"),
            ));
        }
        let max_tokens = match c.max_tokens {
            Some(m) if p + m > ctx => {
                return Err(too_long(
                    p + m,
                    format!("{p} in the messages, {m} in the completion"),
                ))
            }
            Some(m) => m,
            None => ctx - p,
        };
        prompt_tokens += p;
        for j in 0..c.n {
            let mut sampler = c.sampler.clone();
            // n choices with one seed must still differ.
            sampler.seed = sampler.seed.map(|s| s.wrapping_add(j as u64));
            reqs.push(GenRequest {
                prompt: ids.clone(),
                max_tokens,
                sampler,
                stop: c.stop.clone(),
                logprobs,
                ignore_eos: c.ignore_eos,
                deadline,
                constraint: extras.constraint.clone(),
                keep_tokens: extras.keep_tokens.clone(),
                adapter: extras.adapter.clone(),
            });
            echoes.push(echo.clone());
        }
    }
    let tickets = st.engine.submit_many(reqs).map_err(|e| match e {
        SubmitError::QueueFull(_) => ApiError::busy(e.to_string()),
        SubmitError::Unavailable(m) => ApiError::unavailable(m),
        SubmitError::TooLarge { prompt_only, .. } => {
            let param = if prompt_only {
                "messages"
            } else {
                "max_tokens"
            };
            ApiError::invalid(param, e.to_string()).with_code("context_length_exceeded")
        }
    })?;
    let jobs = tickets
        .into_iter()
        .zip(echoes)
        .enumerate()
        .map(|(index, (ticket, echo))| Job {
            index,
            prompt: index / c.n.max(1),
            ticket,
            echo,
        })
        .collect();
    Ok((jobs, prompt_tokens))
}

type TextOf = Arc<dyn Fn(u32) -> String + Send + Sync>;

fn text_of(model: &Arc<Model>) -> TextOf {
    let m = model.clone();
    Arc::new(move |id| m.tokenizer().decode(&[id], false).unwrap_or_default())
}

#[allow(clippy::too_many_arguments)]
async fn respond(
    st: &Shared,
    kind: Kind,
    meta: RespMeta,
    c: &Common,
    jobs: Vec<Job>,
    prompt_tokens: usize,
    logprobs: bool,
    calls: Calls,
) -> ApiResult<Response> {
    let text_of = text_of(st.engine.model());
    if c.stream {
        let s = SseState::new(
            kind,
            meta,
            jobs,
            c.include_usage,
            prompt_tokens,
            logprobs.then_some(text_of),
            calls,
        );
        let body = Body::from_stream(s.into_stream());
        let resp = Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
            .header(header::CACHE_CONTROL, "no-cache")
            .header("x-accel-buffering", "no")
            .body(body)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        return Ok(resp);
    }
    let prompts: Vec<usize> = jobs.iter().map(|j| j.prompt).collect();
    let results = futures_util::future::join_all(jobs.into_iter().map(collect)).await;
    let mut choices = Vec::new();
    let mut completion_tokens = 0;
    let mut cached = CachedTokens::default();
    for (r, prompt) in results.into_iter().zip(prompts) {
        let (mut choice, lps, n, echo_len, c) = r?;
        if let Some((fmt, tools)) = &calls {
            let parts = message_calls(*fmt, tools, &choice.text);
            if !parts.tool_calls.is_empty() && choice.finish == "stop" {
                choice.finish = "tool_calls".into();
            }
            choice.text = parts.content;
            choice.reasoning = parts.reasoning;
            choice.tool_calls = parts.tool_calls;
        }
        completion_tokens += n;
        cached.add(prompt, c);
        let lp = match kind {
            _ if !logprobs => Value::Null,
            Kind::Chat => openai::chat_logprobs(&lps, &*text_of),
            Kind::Completion => openai::completion_logprobs(&lps, &*text_of, echo_len),
        };
        choices.push((choice, lp));
    }
    let usage = openai::usage(prompt_tokens, completion_tokens, cached.total());
    let body = match kind {
        Kind::Chat => openai::chat_response(&meta, choices, usage),
        Kind::Completion => openai::completion_response(&meta, choices, usage),
    };
    Ok(axum::Json(body).into_response())
}

/// Prompt tokens served from the prefix cache, per prompt: the usage counts each prompt once
/// (as its `prompt_tokens` does), with the most any of its choices reused.
#[derive(Default)]
struct CachedTokens(Vec<usize>);

impl CachedTokens {
    fn add(&mut self, prompt: usize, cached: usize) {
        if self.0.len() <= prompt {
            self.0.resize(prompt + 1, 0);
        }
        self.0[prompt] = self.0[prompt].max(cached);
    }
    fn total(&self) -> usize {
        self.0.iter().sum()
    }
}

/// One finished choice: (choice, logprobs, completion tokens, echoed prompt length, prompt
/// tokens served from the prefix cache).
type Collected = (ChoiceOut, Vec<TokenLogprob>, usize, usize, usize);

/// Waits for one choice to finish.
async fn collect(mut job: Job) -> ApiResult<Collected> {
    let mut text = std::mem::take(&mut job.echo);
    let echo_len = text.len();
    let mut lps: Vec<TokenLogprob> = Vec::new();
    loop {
        match job.ticket.recv().await {
            Event::Delta {
                text: t, logprobs, ..
            } => {
                text.push_str(&t);
                lps.extend(logprobs);
            }
            Event::Done {
                finish,
                completion_tokens,
                cached_tokens,
                ..
            } => {
                let choice = ChoiceOut {
                    index: job.index,
                    text,
                    finish: finish.as_str().to_string(),
                    ..Default::default()
                };
                return Ok((choice, lps, completion_tokens, echo_len, cached_tokens));
            }
            Event::Error { status, message } => return Err(ApiError::from_status(status, message)),
        }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = (usize, Event)> + Send>>;

/// A job's events up to and including its last one.
fn job_events(job: Job) -> EventStream {
    Box::pin(stream::unfold(Some(job), |state| async move {
        let mut job = state?;
        let ev = job.ticket.recv().await;
        let last = !matches!(ev, Event::Delta { .. });
        Some(((job.index, ev), if last { None } else { Some(job) }))
    }))
}

/// The SSE body: merges the choices' events and formats them.
struct SseState {
    kind: Kind,
    meta: RespMeta,
    events: SelectAll<EventStream>,
    queue: VecDeque<String>,
    include_usage: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Per choice, its prompt's index; and the prompt tokens served from the prefix cache.
    prompt_of: Vec<usize>,
    cached: CachedTokens,
    remaining: usize,
    /// Present when the client asked for log-probabilities.
    text_of: Option<TextOf>,
    /// Per choice, the text length sent so far (legacy `text_offset`).
    offsets: Vec<usize>,
    /// Per choice, its tool-call parser when the request has active tools.
    calls: Vec<Option<StreamCalls>>,
    ended: bool,
}

impl SseState {
    fn new(
        kind: Kind,
        meta: RespMeta,
        jobs: Vec<Job>,
        include_usage: bool,
        prompt_tokens: usize,
        text_of: Option<TextOf>,
        calls: Calls,
    ) -> SseState {
        let n = jobs.len();
        let mut s = SseState {
            calls: (0..n)
                .map(|_| calls.as_ref().map(|(f, t)| StreamCalls::new(*f, t)))
                .collect(),
            kind,
            meta,
            events: SelectAll::new(),
            queue: VecDeque::new(),
            include_usage,
            prompt_tokens,
            completion_tokens: 0,
            prompt_of: jobs.iter().map(|j| j.prompt).collect(),
            cached: CachedTokens::default(),
            remaining: jobs.len(),
            text_of,
            offsets: vec![0; jobs.len()],
            ended: false,
        };
        for job in jobs {
            match kind {
                Kind::Chat => {
                    let delta = json!({"role": "assistant", "content": "", "refusal": null});
                    s.push_choice(openai::chat_chunk_choice(
                        job.index,
                        delta,
                        Value::Null,
                        None,
                    ));
                }
                Kind::Completion if !job.echo.is_empty() => {
                    s.offsets[job.index] = job.echo.len();
                    s.push_choice(openai::completion_chunk_choice(
                        job.index,
                        &job.echo,
                        Value::Null,
                        None,
                    ));
                }
                Kind::Completion => {}
            }
            s.events.push(job_events(job));
        }
        s
    }

    fn usage_field(&self) -> Option<Value> {
        self.include_usage.then_some(Value::Null)
    }

    fn push_choice(&mut self, choice: Value) {
        let u = self.usage_field();
        let chunk = match self.kind {
            Kind::Chat => openai::chat_chunk(&self.meta, Some(choice), u),
            Kind::Completion => openai::completion_chunk(&self.meta, Some(choice), u),
        };
        self.queue.push_back(openai::sse(&chunk));
    }

    fn handle(&mut self, index: usize, ev: Event) {
        match ev {
            Event::Delta { text, logprobs, .. } => {
                let lp = match &self.text_of {
                    Some(f) if !logprobs.is_empty() => match self.kind {
                        Kind::Chat => openai::chat_logprobs(&logprobs, &**f),
                        Kind::Completion => {
                            openai::completion_logprobs(&logprobs, &**f, self.offsets[index])
                        }
                    },
                    _ => Value::Null,
                };
                if text.is_empty() && lp.is_null() {
                    return;
                }
                self.offsets[index] += text.len();
                if let Some(Some(calls)) = self.calls.get_mut(index) {
                    let deltas = calls.push(&text);
                    self.push_deltas(index, deltas, lp);
                    return;
                }
                let choice = match self.kind {
                    Kind::Chat => {
                        openai::chat_chunk_choice(index, json!({"content": text}), lp, None)
                    }
                    Kind::Completion => openai::completion_chunk_choice(index, &text, lp, None),
                };
                self.push_choice(choice);
            }
            Event::Done {
                finish,
                completion_tokens,
                cached_tokens,
                ..
            } => {
                self.completion_tokens += completion_tokens;
                let prompt = self.prompt_of.get(index).copied().unwrap_or(0);
                self.cached.add(prompt, cached_tokens);
                let mut finish = finish.as_str();
                if let Some(Some(calls)) = self.calls.get_mut(index) {
                    let deltas = calls.finish();
                    if calls.has_calls() && finish == "stop" {
                        finish = "tool_calls";
                    }
                    self.push_deltas(index, deltas, Value::Null);
                }
                let choice = match self.kind {
                    Kind::Chat => {
                        openai::chat_chunk_choice(index, json!({}), Value::Null, Some(finish))
                    }
                    Kind::Completion => {
                        openai::completion_chunk_choice(index, "", Value::Null, Some(finish))
                    }
                };
                self.push_choice(choice);
                self.remaining -= 1;
                if self.remaining == 0 {
                    if self.include_usage {
                        let u = openai::usage(
                            self.prompt_tokens,
                            self.completion_tokens,
                            self.cached.total(),
                        );
                        let chunk = match self.kind {
                            Kind::Chat => openai::chat_chunk(&self.meta, None, Some(u)),
                            Kind::Completion => openai::completion_chunk(&self.meta, None, Some(u)),
                        };
                        self.queue.push_back(openai::sse(&chunk));
                    }
                    self.queue.push_back(openai::SSE_DONE.to_string());
                    self.ended = true;
                }
            }
            Event::Error { status, message } => {
                let e = ApiError::from_status(status, message);
                self.queue.push_back(openai::sse(&e.body()));
                self.ended = true;
            }
        }
    }

    /// Chat chunks for tool-call deltas; the log-probabilities of the text they came from ride
    /// on the first (or on an empty delta when the text is still held back).
    fn push_deltas(&mut self, index: usize, deltas: Vec<Value>, mut lp: Value) {
        if deltas.is_empty() && !lp.is_null() {
            self.push_choice(openai::chat_chunk_choice(index, json!({}), lp, None));
            return;
        }
        for d in deltas {
            let l = std::mem::take(&mut lp);
            self.push_choice(openai::chat_chunk_choice(index, d, l, None));
        }
    }

    fn into_stream(self) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
        stream::unfold(self, |mut s| async move {
            loop {
                if let Some(frame) = s.queue.pop_front() {
                    return Some((Ok(Bytes::from(frame)), s));
                }
                if s.ended {
                    return None;
                }
                match s.events.next().await {
                    Some((i, ev)) => s.handle(i, ev),
                    None => {
                        // Every job ended without Done (engine gone).
                        let e =
                            ApiError::internal("the engine stopped while generating this response");
                        s.queue.push_back(openai::sse(&e.body()));
                        s.ended = true;
                    }
                }
            }
        })
    }
}
