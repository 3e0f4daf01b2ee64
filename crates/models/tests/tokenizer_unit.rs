//! Tokenizer contracts on small synthetic vocabularies (always run, no downloads): GGUF-style
//! byte-level BPE and SentencePiece building, special-token parsing on/off, BOS/EOS, EOG ids,
//! byte fallback, streaming decode of characters split across tokens, and clear errors on bad
//! metadata.

use hf2q_models::tokenizer::{GgufVocab, Tokenizer};
use hf2q_models::Error;

/// GPT-2's byte -> printable char table (the byte-level BPE alphabet).
fn byte_chars() -> Vec<char> {
    let mut bs: Vec<u32> = (0x21..=0x7e)
        .chain(0xa1..=0xac)
        .chain(0xae..=0xff)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in bs.iter().zip(&cs) {
        table[*b as usize] = char::from_u32(*c).unwrap();
    }
    table
}

/// Ids 0..256 are the bytes, then merges "h e" -> "he", "l l" -> "ll", "he ll" -> "hell",
/// "hell o" -> "hello", then control tokens.
fn byte_level() -> GgufVocab {
    let mut tokens: Vec<String> = byte_chars().iter().map(|c| c.to_string()).collect();
    for t in ["he", "ll", "hell", "hello"] {
        tokens.push(t.to_string());
    }
    let mut types = vec![1; tokens.len()];
    for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"] {
        tokens.push(t.to_string());
        types.push(if t == "<tool_call>" { 4 } else { 3 });
    }
    GgufVocab {
        model: "gpt2".into(),
        pre: Some("qwen2".into()),
        tokens,
        token_types: Some(types),
        merges: Some(
            ["h e", "l l", "he ll", "hell o"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        ),
        bos_id: Some(260),
        eos_id: Some(262),
        chat_template: Some("{{ messages[0]['content'] }}".into()),
        ..Default::default()
    }
}

/// `<unk> <s> </s>`, 256 byte tokens, then pieces with scores, a user-defined "\n\n" and turn
/// markers.
fn sentencepiece(add_space_prefix: bool) -> GgufVocab {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..256 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for (i, p) in [
        "\u{2581}",
        "a",
        "b",
        "c",
        "\u{2581}a",
        "ab",
        "\u{2581}ab",
        "\u{2581}\u{2581}",
    ]
    .iter()
    .enumerate()
    {
        tokens.push(p.to_string());
        types.push(1);
        scores.push(-(i as f32) - 1.0);
    }
    tokens.push("\n\n".into());
    types.push(4);
    scores.push(-1000.0);
    tokens.push("<start_of_turn>".into());
    types.push(3);
    scores.push(-1000.0);
    tokens.push("<end_of_turn>".into());
    types.push(3);
    scores.push(-1000.0);
    GgufVocab {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        bos_id: Some(1),
        eos_id: Some(2),
        unk_id: Some(0),
        add_space_prefix: Some(add_space_prefix),
        ..Default::default()
    }
}

fn id(tok: &Tokenizer, s: &str) -> u32 {
    tok.token_to_id(s)
        .unwrap_or_else(|| panic!("{s:?} not in vocab"))
}

#[test]
fn byte_level_merges_and_special_parsing() {
    let tok = Tokenizer::from_gguf_vocab(byte_level()).unwrap();
    assert_eq!(tok.vocab_size(), 264);
    assert_eq!(
        tok.encode("hello", false, true).unwrap(),
        vec![id(&tok, "hello")]
    );
    // The qwen2 regex keeps the space with the word (one pre-token "Ġhello"), but no merge joins
    // "Ġ" and "h", so the space stays its own byte token.
    assert_eq!(
        tok.encode(" hello", false, true).unwrap(),
        vec![b' ' as u32, id(&tok, "hello")]
    );
    let im_end = id(&tok, "<|im_end|>");
    assert_eq!(tok.encode("<|im_end|>", false, true).unwrap(), vec![im_end]);
    let plain = tok.encode("<|im_end|>", false, false).unwrap();
    assert_eq!(
        plain,
        b"<|im_end|>".iter().map(|&b| b as u32).collect::<Vec<_>>()
    );
    // User-defined tokens are recognised either way.
    let tc = id(&tok, "<tool_call>");
    assert_eq!(tok.encode("<tool_call>", false, false).unwrap(), vec![tc]);
    assert!(tok.is_special(im_end) && !tok.is_special(tc) && !tok.is_special(0));
    assert_eq!(
        tok.decode(&[im_end, id(&tok, "hello")], false).unwrap(),
        "<|im_end|>hello"
    );
    assert_eq!(
        tok.decode(&[im_end, id(&tok, "hello")], true).unwrap(),
        "hello"
    );
    assert_eq!(tok.chat_template(), Some("{{ messages[0]['content'] }}"));
}

#[test]
fn byte_level_bos_eos_and_eog() {
    let mut v = byte_level();
    let tok = Tokenizer::from_gguf_vocab(v.clone()).unwrap();
    // qwen2 pre-tokenizer: llama.cpp's default is no BOS.
    assert!(!tok.add_bos() && !tok.add_eos());
    assert_eq!(
        tok.encode("hello", true, true).unwrap(),
        vec![id(&tok, "hello")]
    );
    assert_eq!(tok.bos_token(), Some("<|endoftext|>"));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    let eog: Vec<&str> = tok
        .eog_ids()
        .iter()
        .map(|&i| tok.token_to_str(i).unwrap())
        .collect();
    assert_eq!(eog, ["<|endoftext|>", "<|im_end|>"]);
    assert!(tok.is_eog(262) && !tok.is_eog(0));

    v.add_bos = Some(true);
    v.add_eos = Some(true);
    let tok = Tokenizer::from_gguf_vocab(v).unwrap();
    assert_eq!(
        tok.encode("hello", true, true).unwrap(),
        vec![260, id(&tok, "hello"), 262]
    );
    assert_eq!(
        tok.encode("hello", false, true).unwrap(),
        vec![id(&tok, "hello")]
    );
}

#[test]
fn harmony_end_of_message_does_not_end_generation() {
    let mut v = byte_level();
    for t in [
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|return|>",
        "<|call|>",
    ] {
        v.tokens.push(t.to_string());
        v.token_types.as_mut().unwrap().push(3);
    }
    let eog_of = |v: GgufVocab| {
        let tok = Tokenizer::from_gguf_vocab(v).unwrap();
        let eog: Vec<String> = tok
            .eog_ids()
            .iter()
            .map(|&i| tok.token_to_str(i).unwrap().to_string())
            .collect();
        eog
    };
    assert_eq!(
        eog_of(v.clone()),
        ["<|endoftext|>", "<|im_end|>", "<|return|>", "<|call|>"]
    );
    // Without `<|call|>` (Phi-3's vocabulary has `<|end|>` alone), `<|end|>` ends generation.
    let i = v.tokens.iter().position(|t| t == "<|call|>").unwrap();
    v.tokens[i] = "<|other|>".into();
    assert_eq!(
        eog_of(v),
        ["<|endoftext|>", "<|im_end|>", "<|end|>", "<|return|>"]
    );
}

#[test]
fn byte_level_utf8_roundtrip_and_stream() {
    let tok = Tokenizer::from_gguf_vocab(byte_level()).unwrap();
    let text = "h\u{e9}llo \u{1F600} \u{4f60}\u{597d}\r\n\tend";
    let ids = tok.encode(text, false, false).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);

    // The emoji is four byte tokens: nothing comes out until the last one.
    let emoji = tok.encode("\u{1F600}", false, false).unwrap();
    assert_eq!(emoji.len(), 4);
    let mut s = tok.decoder();
    assert_eq!(s.push(id(&tok, "hello")).as_deref(), Some("hello"));
    for &i in &emoji[..3] {
        assert_eq!(s.push(i), None);
    }
    assert_eq!(s.push(emoji[3]).as_deref(), Some("\u{1F600}"));
    // Special tokens are skipped by the default stream, kept by decoder_with(false).
    assert_eq!(s.push(262), None);
    assert_eq!(s.push(id(&tok, "hello")).as_deref(), Some("hello"));
    let mut k = tok.decoder_with(false);
    assert_eq!(k.push(262).as_deref(), Some("<|im_end|>"));
    // An unfinished character is emitted as U+FFFD on flush; unknown ids are ignored.
    let mut f = tok.decoder();
    assert_eq!(f.push(emoji[0]), None);
    assert_eq!(f.push(99_999), None);
    assert_eq!(f.flush().as_deref(), Some("\u{FFFD}"));
    assert_eq!(f.flush(), None);
}

#[test]
fn stream_equals_full_decode_over_mixed_text() {
    let tok = Tokenizer::from_gguf_vocab(byte_level()).unwrap();
    let text = "hello \u{1F468}\u{200d}\u{1F469}\u{200d}\u{1F467} caf\u{e9} \u{65e5}\u{672c} hello";
    let ids = tok.encode(text, false, false).unwrap();
    let mut s = tok.decoder();
    let mut out = String::new();
    for &i in &ids {
        if let Some(p) = s.push(i) {
            assert!(!p.contains('\u{FFFD}'), "split character in {p:?}");
            out.push_str(&p);
        }
    }
    out.extend(s.flush());
    assert_eq!(out, text);
}

#[test]
fn sentencepiece_space_prefix_byte_fallback_and_user_defined() {
    let tok = Tokenizer::from_gguf_vocab(sentencepiece(true)).unwrap();
    assert!(tok.add_bos(), "SentencePiece default: BOS");
    let ab = id(&tok, "\u{2581}ab");
    assert_eq!(tok.encode("ab ab", false, true).unwrap(), vec![ab, ab]);
    assert_eq!(tok.encode("ab ab", true, true).unwrap(), vec![1, ab, ab]);
    // Byte fallback for characters outside the vocabulary, decoded back.
    let ids = tok.encode("a\u{1F600}", false, true).unwrap();
    let bytes: Vec<u32> = "\u{1F600}".bytes().map(|b| 3 + b as u32).collect();
    assert_eq!(ids, [vec![id(&tok, "\u{2581}a")], bytes.clone()].concat());
    assert_eq!(tok.decode(&ids, false).unwrap(), "a\u{1F600}");
    // The stream waits for the whole emoji and keeps the space between words.
    let mut s = tok.decoder();
    assert_eq!(s.push(ab).as_deref(), Some("ab"));
    for &b in &bytes[..3] {
        assert_eq!(s.push(b), None);
    }
    assert_eq!(s.push(bytes[3]).as_deref(), Some("\u{1F600}"));
    assert_eq!(s.push(ab).as_deref(), Some(" ab"));
    // User-defined "\n\n" is matched even without parse_special; control tokens only with it.
    let nn = id(&tok, "\n\n");
    let sot = id(&tok, "<start_of_turn>");
    assert_eq!(
        tok.encode("<start_of_turn>\n\n", false, true).unwrap()[0],
        sot
    );
    let plain = tok.encode("<start_of_turn>\n\n", false, false).unwrap();
    assert!(!plain.contains(&sot) && plain.contains(&nn), "{plain:?}");
    let eog: Vec<&str> = tok
        .eog_ids()
        .iter()
        .map(|&i| tok.token_to_str(i).unwrap())
        .collect();
    assert_eq!(eog, ["</s>", "<end_of_turn>"]);
}

#[test]
fn sentencepiece_without_space_prefix() {
    let tok = Tokenizer::from_gguf_vocab(sentencepiece(false)).unwrap();
    let (a, ab) = (id(&tok, "a"), id(&tok, "\u{2581}ab"));
    assert_eq!(tok.encode("a ab", false, true).unwrap(), vec![a, ab]);
    assert_eq!(tok.decode(&[a, ab], false).unwrap(), "a ab");
    // Runs of spaces decode back exactly, whichever merges BPE picks.
    let ids = tok.encode("  ab", false, true).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), "  ab");
}

fn err_text(r: Result<Tokenizer, Error>) -> String {
    match r {
        Err(Error::Tokenizer(m)) => m,
        Err(e) => panic!("wrong error kind: {e}"),
        Ok(_) => panic!("expected an error"),
    }
}

#[test]
fn bad_metadata_is_a_clear_error() {
    let mut v = byte_level();
    v.pre = Some("no-such-pre".into());
    assert!(err_text(Tokenizer::from_gguf_vocab(v)).contains("no-such-pre"));

    let mut v = byte_level();
    v.model = "bert".into();
    assert!(
        err_text(Tokenizer::from_gguf_vocab(v)).contains("unsupported GGUF tokenizer model 'bert'")
    );

    let mut v = byte_level();
    v.tokens[5] = v.tokens[4].clone();
    assert!(err_text(Tokenizer::from_gguf_vocab(v)).contains("repeats token"));

    let mut v = byte_level();
    v.eos_id = Some(10_000);
    assert!(err_text(Tokenizer::from_gguf_vocab(v)).contains("outside"));

    let mut v = byte_level();
    v.merges = None;
    assert!(err_text(Tokenizer::from_gguf_vocab(v)).contains("merges"));

    let mut v = byte_level();
    v.merges = Some(vec!["nospace".into()]);
    assert!(err_text(Tokenizer::from_gguf_vocab(v)).contains("nospace"));

    let mut v = sentencepiece(true);
    v.scores.as_mut().unwrap().truncate(10);
    assert!(err_text(Tokenizer::from_gguf_vocab(v)).contains("scores"));

    let mut v = sentencepiece(true);
    v.token_types.as_mut().unwrap().truncate(10);
    assert!(err_text(Tokenizer::from_gguf_vocab(v)).contains("token_type"));

    let mut v = sentencepiece(true);
    v.scores = None;
    assert!(err_text(Tokenizer::from_gguf_vocab(v)).contains("without scores"));

    assert!(err_text(Tokenizer::from_gguf_vocab(GgufVocab {
        model: "gpt2".into(),
        ..Default::default()
    }))
    .contains("empty"));

    let tok = Tokenizer::from_gguf_vocab(byte_level()).unwrap();
    match tok.decode(&[1, 264], false) {
        Err(Error::Tokenizer(m)) => assert!(m.contains("264"), "{m}"),
        other => panic!("{other:?}"),
    }
}

/// A minimal tokenizer.json: word-level BPE over a few pieces, a TemplateProcessing
/// post-processor adding <s>, added special tokens.
fn tiny_tokenizer_json() -> String {
    serde_json::json!({
        "version": "1.0",
        "truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0},
        "padding": null,
        "added_tokens": [
            {"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 1, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "<|eot_id|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "vocab": {"<s>": 0, "</s>": 1, "<|eot_id|>": 2, "a": 3, "b": 4, "ab": 5, "c": 6},
                  "merges": ["a b"]}
    })
    .to_string()
}

#[test]
fn hf_json_post_processor_and_config() {
    let json = tiny_tokenizer_json();
    // Without a config: BOS from what the post-processor adds; padding/truncation ignored.
    let tok = Tokenizer::from_hf_bytes(json.as_bytes(), None).unwrap();
    assert!(tok.add_bos());
    assert_eq!(tok.bos_token(), Some("<s>"));
    assert_eq!(tok.encode("ab c ab", true, true).unwrap(), vec![0, 5, 6, 5]);
    assert_eq!(tok.eog_ids(), &[2]);

    let cfg = serde_json::json!({
        "add_bos_token": false,
        "bos_token": {"content": "<s>", "lstrip": false},
        "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    })
    .to_string();
    let tok = Tokenizer::from_hf_bytes(json.as_bytes(), Some(cfg.as_bytes())).unwrap();
    assert!(!tok.add_bos());
    assert_eq!(tok.eos_id(), Some(1));
    assert_eq!(tok.eog_ids(), &[1, 2]);
    assert_eq!(tok.encode("ab", true, true).unwrap(), vec![5]);
    assert_eq!(tok.chat_template(), Some("D"));
    assert_eq!(tok.encode("ab<|eot_id|>", false, true).unwrap(), vec![5, 2]);

    match Tokenizer::from_hf_bytes(b"{not json", None) {
        Err(Error::Tokenizer(m)) => assert!(m.contains("tokenizer.json"), "{m}"),
        other => panic!("{other:?}"),
    }
    let missing = std::path::Path::new("/nonexistent/tokenizer.json");
    assert!(matches!(
        Tokenizer::from_hf_files(missing, None),
        Err(Error::Io { .. })
    ));
}

#[test]
fn hf_files_read_template_beside_tokenizer_json() {
    let dir = tempfile::tempdir().unwrap();
    let tj = dir.path().join("tokenizer.json");
    std::fs::write(&tj, tiny_tokenizer_json()).unwrap();
    let cfg = dir.path().join("tokenizer_config.json");
    std::fs::write(&cfg, r#"{"eos_token": "</s>"}"#).unwrap();
    let tok = Tokenizer::from_hf_files(&tj, Some(&cfg)).unwrap();
    assert_eq!(tok.chat_template(), None);
    std::fs::write(
        dir.path().join("chat_template.json"),
        r#"{"chat_template": "J"}"#,
    )
    .unwrap();
    assert_eq!(
        Tokenizer::from_hf_files(&tj, Some(&cfg))
            .unwrap()
            .chat_template(),
        Some("J")
    );
    std::fs::write(dir.path().join("chat_template.jinja"), "{{ x }}").unwrap();
    assert_eq!(
        Tokenizer::from_hf_files(&tj, None).unwrap().chat_template(),
        Some("{{ x }}")
    );
    // The config's own template wins.
    std::fs::write(&cfg, r#"{"chat_template": "C"}"#).unwrap();
    assert_eq!(
        Tokenizer::from_hf_files(&tj, Some(&cfg))
            .unwrap()
            .chat_template(),
        Some("C")
    );
}
