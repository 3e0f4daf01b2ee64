//! `tojson` as transformers installs it for chat templates: Python's `json.dumps(x,
//! ensure_ascii=False, indent=None, separators=None, sort_keys=False)`. minijinja's own `tojson`
//! escapes HTML characters and spaces differently, which changes prompts that embed tool schemas.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::ErrorKind;

/// `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`: Python's
/// `json.dumps`, which is what transformers installs (minijinja's own escapes HTML characters and
/// uses other spacing).
pub(super) fn tojson_filter(
    value: Value,
    kwargs: Kwargs,
) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent: Option<String> = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) => {
            let n = v
                .as_i64()
                .ok_or_else(|| bad_arg("indent must be an integer or a string"))?;
            Some(" ".repeat(n.clamp(0, 64) as usize))
        }
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() && !v.is_undefined() => {
            let parts: Vec<String> = v
                .try_iter()?
                .map(|p| {
                    p.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| bad_arg("separators must be strings"))
                })
                .collect::<std::result::Result<_, _>>()?;
            match parts.as_slice() {
                [a, b] => (a.clone(), b.clone()),
                _ => return Err(bad_arg("separators must be a pair")),
            }
        }
        _ => (
            (if indent.is_some() { "," } else { ", " }).to_string(),
            ": ".to_string(),
        ),
    };
    let opts = JsonOpts {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, &value, &opts, 0)?;
    Ok(out)
}

struct JsonOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn bad_arg(msg: &str) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {msg}"))
}

/// Recursion is bounded by minijinja's value depth (values come from serde_json or the template).
fn write_json(
    out: &mut String,
    v: &Value,
    o: &JsonOpts,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    if depth > 128 {
        return Err(bad_arg("value nested too deeply"));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Undefined => return Err(bad_arg("an undefined value is not JSON serializable")),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&py_number(v)),
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, o, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for k in v.try_iter()? {
                let key = match k.kind() {
                    ValueKind::String => k.as_str().unwrap_or_default().to_string(),
                    ValueKind::Number => py_number(&k),
                    ValueKind::Bool => (if k.is_true() { "true" } else { "false" }).to_string(),
                    ValueKind::None => "null".to_string(),
                    _ => {
                        return Err(bad_arg(
                            "map keys must be strings, numbers, booleans or none",
                        ))
                    }
                };
                entries.push((key, v.get_item(&k)?));
            }
            if o.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, val)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                write_json_str(out, k, o.ensure_ascii);
                out.push_str(&o.key_sep);
                write_json(out, val, o, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        other => {
            return Err(bad_arg(&format!(
                "a {other} value is not JSON serializable"
            )))
        }
    }
    Ok(())
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A number as Python's `json.dumps` writes it (`repr` for floats: `1.0`, `1e-05`, `1e+16`).
fn py_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    let Ok(f) = f64::try_from(v.clone()) else {
        return v.to_string();
    };
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        // Rust gives "1e-5" / "1.5e16"; Python "1e-05" / "1.5e+16".
        let s = format!("{f:e}");
        let (mant, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match exp.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', exp),
        };
        return format!("{mant}e{sign}{digits:0>2}");
    }
    if f.fract() == 0.0 {
        format!("{f:.1}")
    } else {
        format!("{f}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_repr() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (1e-5, "1e-05"),
            (1.5e16, "1.5e+16"),
            (123.25, "123.25"),
            (-2.0, "-2.0"),
        ] {
            assert_eq!(py_number(&Value::from(f)), want);
        }
        assert_eq!(py_number(&Value::from(42)), "42");
    }
}
