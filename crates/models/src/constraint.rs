//! Constrained decoding: a grammar (a JSON Schema, any JSON object, or a Lark grammar) turned
//! into the set of tokens allowed at each step, which the sampler applies as a mask
//! ([`crate::sampler::apply_mask`]; on a GPU, before the on-device pick).
//!
//! The masks come from llguidance (its Earley parser over a token trie; MaskBench's fastest
//! engine with the fewest wrong answers), through `toktrie_hf_tokenizers` over the same
//! `tokenizers` pipeline [`Tokenizer`] uses, so the trie sees exactly our token bytes.
//! [`ConstraintEnv`] is built once per model (the trie and llguidance's token slices: tens to
//! hundreds of milliseconds for a 150k vocabulary); [`Grammar`] is one compiled request
//! (milliseconds); [`Constraint`] is one sequence's state.
//!
//! A mask is a bit set over the logits: word `i / 32`, bit `i % 32` set = token `i` allowed
//! (`ceil(V / 32)` u32 words for `V` logits). When the grammar is complete only the
//! end-of-generation tokens are allowed, so generation ends there.
//!
//! Lazy constraints (`tool_choice: auto`): the model writes freely until a trigger (a token, or
//! a reply that starts with `{`), then the grammar constrains the rest.
//!
//! Whitespace in JSON is bounded (a few spaces, or one line break and an indentation of at most
//! 32, between two tokens, unless the schema sets its own `x-guidance` options), and so are
//! numbers without bounds of their own (within ±(2^53 − 1), at most 10 decimals, as llama.cpp's
//! grammars bound them): a small model otherwise loops on newlines or zeros until the token
//! limit. Only a recursive schema can still make a reply run that long.
//!
//! Dates and times (`format` `date`, `time`, `date-time`) are compiled as a strict subset of
//! RFC 3339 ([`adapt_schema`]): `T` and `Z` upper case, seconds 00-59, 29 February in leap
//! years only; e-mail addresses as common dot-atom addresses (local part of at most 64
//! characters). llguidance's own patterns also allow a leap second at any minute, 29 February
//! of every year and local parts of any length, which strict validators reject.
//!
//! What it is not: a JSON Schema validator (outputs follow the grammar; the tests validate them
//! independently), or a speculative/fast-forward decoder (forced tokens are sampled one by one
//! like any other, so a constrained greedy reply equals the unconstrained one whenever that one
//! already conforms).

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use crate::tokenizer::Tokenizer;
use crate::tool_calls::grammar::Trigger;
use crate::{Error, Result};

/// Whitespace allowed between JSON tokens when the schema does not choose (see module docs).
pub const JSON_WHITESPACE: &str = r"(?:[\x20\x09]{1,8}|\x0D?\x0A[\x20\x09]{0,32})";

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// A JSON Schema.
    JsonSchema(Value),
    /// A Lark grammar in llguidance's dialect (`%json {...}` embeds schemas, `<[id]>` tokens).
    Lark(String),
}

/// Per-model state shared by every constrained request (cheap to clone).
#[derive(Clone)]
pub struct ConstraintEnv {
    factory: Arc<ParserFactory>,
    env: TokEnv,
    /// Logits per step (the mask's width).
    vocab: usize,
}

impl std::fmt::Debug for ConstraintEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintEnv")
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

fn grammar_err(e: impl std::fmt::Display) -> Error {
    Error::Grammar(e.to_string())
}

impl ConstraintEnv {
    /// Builds the token trie of `tok` for masks over `n_vocab` logits (at least the
    /// tokenizer's size; ids past the tokenizer are never allowed). The end-of-generation ids
    /// are the tokenizer's.
    pub fn new(tok: &Tokenizer, n_vocab: usize) -> Result<ConstraintEnv> {
        let hf = tok.hf_tokenizer().clone();
        let eog: Vec<u32> = tok.eog_ids().to_vec();
        // The adapter asserts on vocabularies it does not expect; a bad file must be an error.
        let built = std::panic::catch_unwind(move || {
            let mut bt = toktrie_hf_tokenizers::ByteTokenizer::from_tokenizer(hf)
                .map_err(|e| e.to_string())?;
            let size = bt.tokrx_info().vocab_size;
            let eog: Vec<u32> = eog.into_iter().filter(|&id| id < size).collect();
            if !eog.is_empty() {
                bt.set_eos_tokens(&eog);
            }
            let n = n_vocab.max(size as usize);
            let env = toktrie_hf_tokenizers::ByteTokenizerEnv::new(bt, Some(n))
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((env.to_env(), n))
        });
        let (env, vocab) = match built {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => {
                return Err(grammar_err(format!(
                    "this tokenizer cannot drive constrained decoding: {e}"
                )))
            }
            Err(_) => {
                return Err(grammar_err(
                    "this tokenizer cannot drive constrained decoding (unexpected vocabulary)",
                ))
            }
        };
        // llguidance's JSON token slices (precomputed token sets for common lexemes), plus our
        // bounded whitespace: without it every step after a JSON token walks the whole
        // vocabulary for the whitespace lexeme (mean mask time 1.6x on Llama 3's vocabulary).
        let mut slices = llguidance::earley::SlicedBiasComputer::json_slices();
        slices.push(JSON_WHITESPACE.to_string());
        let mut factory =
            ParserFactory::new(&env, Default::default(), &slices).map_err(grammar_err)?;
        factory.quiet();
        Ok(ConstraintEnv {
            factory: Arc::new(factory),
            env,
            vocab,
        })
    }

    /// Width of the masks (logits per step).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Compiles a grammar; an unsupported JSON Schema feature or a bad Lark grammar is an
    /// [`Error::Grammar`] naming it.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar> {
        let top = match spec {
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(json!({
                "type": "object",
                "x-guidance": {"whitespace_pattern": JSON_WHITESPACE},
            })),
            GrammarSpec::JsonSchema(s) => {
                let mut s = s.clone();
                let boolean = s.is_boolean();
                match s.as_object_mut() {
                    Some(o) if !o.contains_key("x-guidance") => {
                        o.insert(
                            "x-guidance".into(),
                            json!({"whitespace_pattern": JSON_WHITESPACE}),
                        );
                    }
                    Some(_) => {}
                    None if boolean => {}
                    None => {
                        return Err(grammar_err("a JSON Schema must be an object or a boolean"))
                    }
                }
                adapt_schema(&mut s);
                TopLevelGrammar::from_json_schema(s)
            }
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let parser = self.factory.create_parser(top).map_err(grammar_err)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(grammar_err(e));
        }
        Ok(Grammar { matcher })
    }

    /// A constraint active from the first generated token.
    pub fn constraint(&self, g: &Grammar) -> Constraint {
        Constraint::new(self, State::Active(Box::new(g.matcher.deep_clone())))
    }

    /// A constraint that switches on at the first trigger that fires.
    pub fn lazy(&self, grammars: Vec<(Trigger, Grammar)>) -> Constraint {
        if grammars.is_empty() {
            return Constraint::new(self, State::Off);
        }
        Constraint::new(
            self,
            State::Waiting {
                grammars,
                seen: Vec::new(),
                text: Vec::new(),
            },
        )
    }
}

const DATE: &str = concat!(
    r"(?:[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])",
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))",
    r"|(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29)"
);
const TIME: &str = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])";

/// The common dot-atom addresses: a local part of at most 64 characters, a domain of two or
/// three labels.
const EMAIL: &str = concat!(
    r"[A-Za-z0-9_%+-]{1,32}(?:\.[A-Za-z0-9_%+-]{1,15}){0,2}@",
    r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?){1,2}"
);

/// Largest integer a JSON number carries exactly (I-JSON's safe range).
const SAFE_INT: i64 = (1 << 53) - 1;

/// What llguidance is given for a request's schema (the reply is still validated against the
/// original): `format: date | time | date-time | email` on strings without a `pattern` of
/// their own become the equivalent strict pattern, and numbers get bounds where they have none
/// (see the module docs). Everywhere in the schema.
pub fn adapt_schema(schema: &mut Value) {
    match schema {
        Value::Object(o) => {
            let types: Vec<&str> = match o.get("type") {
                Some(Value::String(t)) => vec![t.as_str()],
                Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            let (int, num) = (types.contains(&"integer"), types.contains(&"number"));
            if int || num {
                if !o.contains_key("minimum") && !o.contains_key("exclusiveMinimum") {
                    o.insert("minimum".into(), json!(-SAFE_INT));
                }
                if !o.contains_key("maximum") && !o.contains_key("exclusiveMaximum") {
                    o.insert("maximum".into(), json!(SAFE_INT));
                }
                if num && !o.contains_key("multipleOf") {
                    o.insert("multipleOf".into(), json!(1e-10));
                }
            }
            let pattern = match o.get("format").and_then(Value::as_str) {
                Some("date") => Some(format!("^{DATE}$")),
                Some("time") => Some(format!("^{TIME}$")),
                Some("date-time") => Some(format!("^{DATE}T{TIME}$")),
                Some("email") => Some(format!("^{EMAIL}$")),
                _ => None,
            };
            if let (Some(p), false) = (pattern, o.contains_key("pattern")) {
                o.remove("format");
                o.insert("pattern".into(), Value::String(p));
            }
            for (k, v) in o.iter_mut() {
                // Values given as data, not subschemas.
                if !matches!(k.as_str(), "const" | "enum" | "default" | "examples") {
                    adapt_schema(v);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(adapt_schema),
        _ => {}
    }
}

/// Whether a reply begins with a JSON object: its first non-whitespace character is `{`,
/// possibly after a Markdown fence line (```` ```json ````).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum JsonStart {
    Undecided,
    Yes,
    No,
}

fn json_start(text: &[u8]) -> JsonStart {
    let t = text.trim_ascii_start();
    let Some(&first) = t.first() else {
        return JsonStart::Undecided;
    };
    match first {
        b'{' => JsonStart::Yes,
        b'`' => {
            for fence in [&b"```json\n"[..], b"```\n"] {
                if fence.starts_with(t) {
                    return JsonStart::Undecided;
                }
                if let Some(rest) = t.strip_prefix(fence) {
                    return match rest.trim_ascii_start().first() {
                        None => JsonStart::Undecided,
                        Some(b'{') => JsonStart::Yes,
                        Some(_) => JsonStart::No,
                    };
                }
            }
            JsonStart::No
        }
        _ => JsonStart::No,
    }
}

/// One compiled grammar, ready to start sequences (each gets its own copy).
pub struct Grammar {
    matcher: Matcher,
}

impl Clone for Grammar {
    fn clone(&self) -> Self {
        Grammar {
            matcher: self.matcher.deep_clone(),
        }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

enum State {
    Active(Box<Matcher>),
    /// Lazy: not triggered yet. `seen`: the ids generated so far; `text`: their bytes.
    Waiting {
        grammars: Vec<(Trigger, Grammar)>,
        seen: Vec<u32>,
        text: Vec<u8>,
    },
    /// Unconstrained from here on.
    Off,
}

impl Clone for State {
    /// Copies are independent: a parser and its caches are cloned deeply.
    fn clone(&self) -> Self {
        match self {
            State::Active(m) => State::Active(Box::new(m.deep_clone())),
            State::Waiting {
                grammars,
                seen,
                text,
            } => State::Waiting {
                grammars: grammars.clone(),
                seen: seen.clone(),
                text: text.clone(),
            },
            State::Off => State::Off,
        }
    }
}

/// One sequence's constraint: call [`Constraint::mask`] before sampling each token and
/// [`Constraint::commit`] with the token sampled. A clone is an independent copy (the `n`
/// choices of one request each get one).
#[derive(Clone)]
pub struct Constraint {
    state: State,
    env: TokEnv,
    vocab: usize,
    mask: SimpleVob,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self.state {
            State::Active(_) => "active",
            State::Waiting { .. } => "waiting for a trigger",
            State::Off => "off",
        };
        write!(f, "Constraint({s})")
    }
}

impl Constraint {
    fn new(env: &ConstraintEnv, state: State) -> Constraint {
        Constraint {
            state,
            env: env.env.clone(),
            vocab: env.vocab,
            mask: SimpleVob::alloc(env.vocab),
        }
    }

    /// Whether the grammar constrains the next token.
    pub fn is_active(&self) -> bool {
        matches!(self.state, State::Active(_))
    }

    /// The tokens allowed next, as bits (`ceil(V / 32)` words; see the module docs), or `None`
    /// when nothing is constrained at this step.
    pub fn mask(&mut self) -> Result<Option<&[u32]>> {
        let State::Active(m) = &mut self.state else {
            return Ok(None);
        };
        let v = m.compute_mask_or_eos().map_err(grammar_err)?;
        if v.is_zero() {
            return Err(grammar_err(
                "the grammar allows no token here (its end cannot be reached with this vocabulary)",
            ));
        }
        self.mask = v;
        let words = self.vocab.div_ceil(32);
        let bits = self.mask.as_slice();
        if bits.len() < words {
            return Err(grammar_err(format!(
                "the grammar's mask has {} words for {} logits",
                bits.len(),
                self.vocab
            )));
        }
        Ok(Some(&bits[..words]))
    }

    /// Advances past the sampled token `id`.
    pub fn commit(&mut self, id: u32) -> Result<()> {
        match &mut self.state {
            State::Off => Ok(()),
            State::Active(m) => {
                if m.is_stopped() {
                    return Ok(());
                }
                m.consume_token(id).map_err(grammar_err)
            }
            State::Waiting {
                grammars,
                seen,
                text,
            } => {
                seen.push(id);
                let trie = self.env.tok_trie();
                if (id as usize) < trie.vocab_size() {
                    text.extend_from_slice(trie.token(id));
                }
                let start = json_start(text);
                let mut fired: Option<State> = None;
                grammars.retain(|(t, g)| {
                    if fired.is_some() {
                        return true;
                    }
                    match t {
                        Trigger::Token(tid) if *tid == id => {
                            fired = Some(State::Active(Box::new(g.matcher.deep_clone())));
                            true
                        }
                        Trigger::JsonStart => match start {
                            JsonStart::Undecided => true,
                            JsonStart::Yes => {
                                let mut m = g.matcher.deep_clone();
                                // The reply so far (unconstrained) must fit the grammar;
                                // when it does not, the model is writing something else.
                                fired = Some(match m.consume_tokens(seen) {
                                    Ok(()) => State::Active(Box::new(m)),
                                    Err(_) => State::Off,
                                });
                                true
                            }
                            JsonStart::No => false,
                        },
                        Trigger::Token(_) => true,
                    }
                });
                if let Some(s) = fired {
                    self.state = s;
                } else if grammars.is_empty() {
                    self.state = State::Off;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_start_sees_bare_and_fenced_objects() {
        use JsonStart::*;
        for (t, want) in [
            ("", Undecided),
            ("  \n", Undecided),
            ("{", Yes),
            ("\n {\"a\"", Yes),
            ("`", Undecided),
            ("```js", Undecided),
            ("```py", No),
            ("```json", Undecided),
            ("```json\n", Undecided),
            ("```json\n{", Yes),
            ("```\n  {", Yes),
            ("```json\nnot", No),
            ("Sure", No),
        ] {
            assert_eq!(json_start(t.as_bytes()), want, "{t:?}");
        }
    }

    #[test]
    fn formats_become_strict_patterns_and_numbers_get_bounds() {
        let mut s = json!({"type": "object", "properties": {
            "d": {"type": "string", "format": "date"},
            "p": {"type": "string", "format": "email", "pattern": "^x$"},
            "n": {"type": "number"},
            "i": {"type": "integer", "maximum": 5},
            "c": {"const": {"format": "date"}}}});
        adapt_schema(&mut s);
        let p = &s["properties"];
        assert!(p["d"].get("format").is_none());
        assert!(p["d"]["pattern"]
            .as_str()
            .unwrap()
            .starts_with("^(?:[0-9]{4}-"));
        assert_eq!(p["p"]["format"], "email", "an own pattern is kept as given");
        assert_eq!(p["n"]["multipleOf"], json!(1e-10));
        assert_eq!(p["n"]["minimum"], json!(-SAFE_INT));
        assert_eq!(p["i"]["maximum"], 5);
        assert_eq!(p["i"]["minimum"], json!(-SAFE_INT));
        assert!(p["i"].get("multipleOf").is_none());
        assert_eq!(
            p["c"]["const"],
            json!({"format": "date"}),
            "data is not a schema"
        );
    }
}
