//! Tests of [`super`]: params to argv, outputs at temporary names, refused params named.

use super::*;
use serde_json::json;

#[test]
fn fuse_and_export_adapter_run_their_commands() {
    let d = tempfile::tempdir().unwrap();
    let home = Home::new(d.path()).unwrap();
    std::fs::create_dir_all(home.root().join("adapters/upper")).unwrap();
    let builtin = vec!["smollm2-135m".to_string()];
    let ctx = Context {
        home: &home,
        builtin_models: &builtin,
        api: None,
    };
    let argv = |kind, v: Value| -> Vec<String> {
        plan(&ctx, kind, &v, 7)
            .unwrap()
            .argv
            .iter()
            .map(|a| a.to_string_lossy().into())
            .collect()
    };
    let adapter = home.root().join("adapters/upper");
    let a = adapter.to_str().unwrap();
    let fused = home.root().join("models/.f.gguf.partial-7");
    assert_eq!(
        argv(
            Kind::Fuse,
            json!({"model": "smollm2-135m", "adapter": "adapters/upper", "output": "f", "type": "Q8_0"})
        ),
        [
            "fuse",
            "smollm2-135m",
            a,
            fused.to_str().unwrap(),
            "--type",
            "Q8_0",
            "--json"
        ]
    );
    let hf = home.root().join("models/.f.partial-7");
    assert_eq!(
        argv(
            Kind::Fuse,
            json!({"model": "smollm2-135m", "adapter": "adapters/upper", "output": "f", "to": "hf"})
        ),
        [
            "fuse",
            "smollm2-135m",
            a,
            hf.to_str().unwrap(),
            "--to",
            "hf",
            "--json"
        ]
    );
    let lora = home.root().join("adapters/.u.gguf.partial-7");
    assert_eq!(
        argv(
            Kind::ExportAdapter,
            json!({"adapter": "adapters/upper", "output": "u", "to": "gguf-lora", "base": "smollm2-135m"})
        ),
        [
            "convert",
            a,
            lora.to_str().unwrap(),
            "--to",
            "gguf-lora",
            "--base",
            "smollm2-135m",
            "--json"
        ]
    );
    let e = plan(
        &ctx,
        Kind::ExportAdapter,
        &json!({"adapter": "adapters/upper", "output": "u", "to": "gguf"}),
        1,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("to: must be one of gguf-lora, mlx, peft"),
        "{e}"
    );
}

#[test]
fn params_map_to_flags_and_bad_ones_are_named() {
    let d = tempfile::tempdir().unwrap();
    let home = Home::new(d.path()).unwrap();
    std::fs::write(home.root().join("wiki.txt"), "text").unwrap();
    let builtin = vec!["smollm2-135m".to_string()];
    let ctx = Context {
        home: &home,
        builtin_models: &builtin,
        api: None,
    };
    let pl = plan(
        &ctx,
        Kind::Quantize,
        &json!({"model": "smollm2-135m", "type": "Q4_0", "output": "small", "eval-chunks": 2}),
        5,
    )
    .unwrap();
    let argv: Vec<String> = pl.argv.iter().map(|a| a.to_string_lossy().into()).collect();
    let out = home.root().join("models/.small.gguf.partial-5");
    assert_eq!(
        argv,
        [
            "quantize",
            "smollm2-135m",
            out.to_str().unwrap(),
            "--type",
            "Q4_0",
            "--eval-chunks",
            "2",
            "--json"
        ]
    );
    assert_eq!(pl.outputs[0].0, home.root().join("models/small.gguf"));
    assert_eq!(pl.lease, Lease::Cpu);
    let err = |kind, v: Value| plan(&ctx, kind, &v, 1).unwrap_err().to_string();
    assert!(err(
        Kind::Quantize,
        json!({"model": "smollm2-135m", "output": "o", "typ": "Q4_0"})
    )
    .starts_with("typ: unknown parameter"));
    assert!(
        err(Kind::Perplexity, json!({"model": "smollm2-135m"})).starts_with("file: is required")
    );
    assert!(err(
        Kind::Perplexity,
        json!({"model": "smollm2-135m", "file": "wiki.txt", "ctx": -3})
    )
    .starts_with("ctx: must be a whole number"));
    assert!(err(
        Kind::Perplexity,
        json!({"model": "smollm2-135m", "file": "../wiki.txt"})
    )
    .contains("leaves $HF2Q_HOME"));
    assert!(err(
        Kind::Perplexity,
        json!({"model": "/etc/passwd", "file": "wiki.txt"})
    )
    .contains("absolute"));
    assert!(err(Kind::Pull, json!({"name": "gpt-17"})).contains("not a built-in model"));
    std::fs::create_dir_all(home.root().join("data")).unwrap();
    std::fs::write(home.root().join("data/qa.csv"), "q,a\n").unwrap();
    let d = plan(
        &ctx,
        Kind::Dataset,
        &json!({"inputs": ["data/qa.csv", "wiki.txt"], "output": "qa", "map": {"instruction": "q", "output": "a"}, "to": "alpaca"}),
        4,
    )
    .unwrap();
    let argv: Vec<String> = d.argv.iter().map(|a| a.to_string_lossy().into()).collect();
    let tmp = home.root().join("datasets/.qa.partial-4");
    let inp = |n: &str| home.root().join(n).to_string_lossy().to_string();
    assert_eq!(
        argv,
        [
            "dataset".to_string(),
            "build".into(),
            inp("data/qa.csv"),
            inp("wiki.txt"),
            "--output".into(),
            tmp.to_string_lossy().into(),
            "--to".into(),
            "alpaca".into(),
            "--map".into(),
            "instruction=q".into(),
            "--map".into(),
            "output=a".into(),
            "--json".into()
        ]
    );
    assert!(err(Kind::Dataset, json!({"inputs": [], "output": "x"})).contains("non-empty list"));
    assert!(err(
        Kind::Dataset,
        json!({"inputs": ["../x.csv"], "output": "x"})
    )
    .contains("leaves $HF2Q_HOME"));
    assert!(err(
        Kind::Dataset,
        json!({"inputs": ["wiki.txt"], "output": "x", "map": {"a=b": "c"}})
    )
    .contains("not a field name"));
    let t = plan(
        &ctx,
        Kind::TrainSft,
        &json!({"data": "wiki.txt", "output": "a", "steps": 3}),
        2,
    )
    .unwrap();
    assert_eq!(t.lease, Lease::Gpu);
    let t = plan(
        &ctx,
        Kind::TrainSft,
        &json!({"data": "wiki.txt", "output": "a", "device": "cpu"}),
        2,
    )
    .unwrap();
    assert_eq!(t.lease, Lease::Cpu);
}

#[test]
fn a_generation_job_gets_the_servers_address_and_its_inputs_in_the_home() {
    let d = tempfile::tempdir().unwrap();
    let home = Home::new(d.path()).unwrap();
    std::fs::create_dir_all(home.root().join("data")).unwrap();
    std::fs::write(home.root().join("data/seeds.txt"), "Write a poem.\n").unwrap();
    let builtin = vec!["smollm2-135m".to_string()];
    let mut ctx = Context {
        home: &home,
        builtin_models: &builtin,
        api: None,
    };
    let params = json!({"template": "self-instruct", "seeds": "data/seeds.txt", "output": "gen",
        "model": "base:tuned", "count": 3, "temperature": 0.5, "max_tokens": 16});
    let e = plan(&ctx, Kind::DatasetGenerate, &params, 7).unwrap_err();
    assert!(
        e.to_string().contains("needs the address of the server"),
        "{e}"
    );
    ctx.api = Some("http://127.0.0.1:9/v1");
    let pl = plan(&ctx, Kind::DatasetGenerate, &params, 7).unwrap();
    let argv: Vec<String> = pl.argv.iter().map(|a| a.to_string_lossy().into()).collect();
    let root = home.root().to_string_lossy().to_string();
    assert_eq!(
        argv,
        [
            "dataset".to_string(),
            "generate".into(),
            "self-instruct".into(),
            "--output".into(),
            format!("{root}/datasets/.gen.partial-7"),
            "--model".into(),
            "base:tuned".into(),
            "--seeds".into(),
            format!("{root}/data/seeds.txt"),
            "--count".into(),
            "3".into(),
            "--temperature".into(),
            "0.5".into(),
            "--max-tokens".into(),
            "16".into(),
            "--api".into(),
            "http://127.0.0.1:9/v1".into(),
            "--json".into(),
        ]
    );
    assert_eq!(pl.outputs[0].0, home.root().join("datasets/gen"));
    assert_eq!(pl.lease, Lease::Cpu);
    let err = |v: Value| {
        plan(&ctx, Kind::DatasetGenerate, &v, 1)
            .unwrap_err()
            .to_string()
    };
    assert!(
        err(json!({"template": "poems", "output": "x"})).starts_with("template: must be one of")
    );
    assert!(
        err(json!({"template": "qa", "output": "x", "source": "../etc"}))
            .contains("leaves $HF2Q_HOME")
    );
    assert!(
        err(json!({"template": "qa", "output": "x", "api": "http://elsewhere"}))
            .starts_with("api: unknown parameter")
    );
}

#[test]
fn push_and_hub_dataset_jobs_take_checked_repository_names() {
    let d = tempfile::tempdir().unwrap();
    let home = Home::new(d.path()).unwrap();
    std::fs::create_dir_all(home.root().join("datasets/chat")).unwrap();
    let builtin = Vec::new();
    let ctx = Context {
        home: &home,
        builtin_models: &builtin,
        api: None,
    };
    let argv = |kind, v: Value| -> Result<Vec<String>> {
        Ok(plan(&ctx, kind, &v, 3)?
            .argv
            .iter()
            .map(|a| a.to_string_lossy().into())
            .collect())
    };
    let ds = home.root().join("datasets/chat");
    assert_eq!(
        argv(
            Kind::Push,
            json!({"path": "datasets/chat", "repo": "me/chat", "repo_type": "dataset", "private": true})
        )
        .unwrap(),
        [
            "push",
            ds.to_str().unwrap(),
            "me/chat",
            "--repo-type",
            "dataset",
            "--private",
            "--json"
        ]
    );
    for bad in [
        "me",
        "me/",
        "-x/y",
        "a/b/c",
        "a/b--c",
        "a/b c",
        "a/.b",
        "a/b:split",
    ] {
        let e = argv(Kind::Push, json!({"path": "datasets/chat", "repo": bad})).unwrap_err();
        assert!(e.to_string().starts_with("repo:"), "{bad}: {e}");
    }
    let e = argv(Kind::Push, json!({"path": "../x", "repo": "me/chat"})).unwrap_err();
    assert!(e.to_string().starts_with("path:"), "{e}");

    let out = home.root().join("datasets/.d.partial-3");
    assert_eq!(
        argv(
            Kind::Dataset,
            json!({"hub": ["org/notes:test", "org/pq@refs/convert/parquet"], "output": "d"})
        )
        .unwrap(),
        [
            "dataset",
            "build",
            "org/notes:test",
            "org/pq@refs/convert/parquet",
            "--output",
            out.to_str().unwrap(),
            "--json"
        ]
    );
    let e = argv(Kind::Dataset, json!({"output": "d"})).unwrap_err();
    assert!(e.to_string().contains("hub"), "{e}");
    for bad in ["org/x@-rf", "org/x:a/b", "org/x@../y"] {
        let e = argv(Kind::Dataset, json!({"hub": [bad], "output": "d"})).unwrap_err();
        assert!(e.to_string().starts_with("hub:"), "{bad}: {e}");
    }
}
