//! JSON helpers: canonical text, hashes, paths and argument templates.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Canonical JSON text: object keys sorted (serde_json's map is ordered), no whitespace.
pub fn canonical(value: &Value) -> String {
    value.to_string()
}

/// Lower-case hex SHA-256 of `parts`, each followed by a unit separator.
pub fn sha256_hex(parts: &[&str]) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update(part.as_bytes());
        hasher.update([0x1f]);
    }
    hex(&hasher.finalize())
}

/// Lower-case hex SHA-256 of `prefix` (followed by a unit separator) and of `value`'s
/// canonical text (followed by one): `sha256_hex(&[prefix, &canonical(value)])`, with the
/// text written into the hash rather than into a string first (the event hash of every
/// event the fold emits).
pub fn sha256_hex_of(prefix: &str, value: &Value) -> String {
    struct Hashing<'h>(&'h mut Sha256);
    impl std::io::Write for Hashing<'_> {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.update(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut hasher = Sha256::new();
    hasher.update(prefix.as_bytes());
    hasher.update([0x1f]);
    // Writing a `Value` into a sink that never fails cannot fail: its keys are strings.
    let _ = serde_json::to_writer(Hashing(&mut hasher), value);
    hasher.update([0x1f]);
    hex(&hasher.finalize())
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0x0f)] as char);
    }
    out
}

/// The value at a dotted path (`order.items.0.sku`); numbers index arrays.
pub fn at_path<'v>(value: &'v Value, path: &str) -> Option<&'v Value> {
    if path.is_empty() {
        return Some(value);
    }
    path.split('.').try_fold(value, step)
}

/// One segment of a path: an object's field, or an array's element by index.
pub fn step<'v>(value: &'v Value, segment: &str) -> Option<&'v Value> {
    match value {
        Value::Object(map) => map.get(segment),
        Value::Array(items) => segment.parse::<usize>().ok().and_then(|i| items.get(i)),
        _ => None,
    }
}

/// Where a template reference points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reference<'t> {
    /// `$input.<path>`: the run input.
    Input(&'t str),
    /// `$steps.<node>.output.<path>` or `$steps.<node>.args.<path>`.
    Step {
        node: &'t str,
        part: &'t str,
        path: &'t str,
    },
    /// `$compensated.output.<path>` / `$compensated.args.<path>`: in a compensation node,
    /// the step being compensated.
    Compensated { part: &'t str, path: &'t str },
    /// `$interrupt.payload.<path>`: the human input given with the decision on the node's
    /// approval (in the gated node itself, its precheck, or its `on_reject` substitute).
    Interrupt(&'t str),
}

/// Parses a string that is a whole template reference, e.g. `$steps.read_order.output.total`.
pub fn reference(text: &str) -> Option<Result<Reference<'_>, String>> {
    let rest = text.strip_prefix('$')?;
    let (head, tail) = rest.split_once('.').unwrap_or((rest, ""));
    Some(match head {
        "input" => Ok(Reference::Input(tail)),
        "steps" => {
            let mut parts = tail.splitn(3, '.');
            match (parts.next(), parts.next()) {
                (Some(node), Some(part @ ("output" | "args"))) if !node.is_empty() => {
                    Ok(Reference::Step {
                        node,
                        part,
                        path: parts.next().unwrap_or(""),
                    })
                }
                _ => Err(format!(
                    "{text:?} should read $steps.<node>.output[.path] or $steps.<node>.args[.path]"
                )),
            }
        }
        "compensated" => {
            let (part, path) = tail.split_once('.').unwrap_or((tail, ""));
            match part {
                "output" | "args" => Ok(Reference::Compensated { part, path }),
                _ => Err(format!("{text:?} should read $compensated.output or $compensated.args")),
            }
        }
        "interrupt" => match tail.split_once('.').unwrap_or((tail, "")) {
            ("payload", path) => Ok(Reference::Interrupt(path)),
            _ => Err(format!("{text:?} should read $interrupt.payload[.path]")),
        },
        _ => Err(format!(
            "{text:?} is not a reference ($input, $steps.<node>, $compensated, $interrupt); write $$ for a literal $"
        )),
    })
}

/// Every reference in a template, for validation.
pub fn references(template: &Value) -> Vec<Result<Reference<'_>, String>> {
    let mut out = Vec::new();
    collect(template, &mut out);
    out
}

fn collect<'t>(value: &'t Value, out: &mut Vec<Result<Reference<'t>, String>>) {
    match value {
        Value::String(s) if !s.starts_with("$$") => out.extend(reference(s)),
        Value::Array(items) => items.iter().for_each(|v| collect(v, out)),
        Value::Object(map) => map.values().for_each(|v| collect(v, out)),
        _ => {}
    }
}

/// Fills a template: every string that is a whole reference is replaced by the value it
/// points at (`null` when absent); `$$text` stands for the literal `$text`.
pub fn render(template: &Value, lookup: &dyn Fn(&Reference<'_>) -> Option<Value>) -> Value {
    match template {
        Value::String(s) if s.starts_with("$$") => Value::String(s[1..].to_owned()),
        Value::String(s) => match reference(s) {
            Some(Ok(r)) => lookup(&r).unwrap_or(Value::Null),
            _ => template.clone(),
        },
        Value::Array(items) => Value::Array(items.iter().map(|v| render(v, lookup)).collect()),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), render(v, lookup)))
                .collect(),
        ),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hashes_are_lower_hex_and_streaming_equals_the_text() {
        // SHA-256 of "abc" (FIPS 180-2, appendix B.1), through the unit-separated form.
        assert_eq!(
            crate::blob::sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");
        let value = json!({"b": [1, "x\u{1f}\"y"], "a": {"é": null, "d": 2.5}});
        for prefix in ["", "ab12"] {
            assert_eq!(
                sha256_hex_of(prefix, &value),
                sha256_hex(&[prefix, &canonical(&value)])
            );
        }
    }

    #[test]
    fn canonical_sorts_keys() {
        assert_eq!(
            canonical(&json!({"b": 1, "a": [2, {"d": 3, "c": 4}]})),
            r#"{"a":[2,{"c":4,"d":3}],"b":1}"#
        );
    }

    #[test]
    fn renders_references() {
        let input = json!({"order": {"id": 7}});
        let out = render(
            &json!({"id": "$input.order.id", "lit": "$$input", "missing": "$input.nope", "n": 1}),
            &|r| match r {
                Reference::Input(path) => at_path(&input, path).cloned(),
                _ => None,
            },
        );
        assert_eq!(
            out,
            json!({"id": 7, "lit": "$input", "missing": null, "n": 1})
        );
    }

    #[test]
    fn interrupt_payload_references_parse() {
        assert_eq!(
            reference("$interrupt.payload.note"),
            Some(Ok(Reference::Interrupt("note")))
        );
        assert_eq!(
            reference("$interrupt.payload"),
            Some(Ok(Reference::Interrupt("")))
        );
        assert!(matches!(reference("$interrupt.args"), Some(Err(_))));
    }

    #[test]
    fn bad_references_are_reported() {
        assert!(matches!(reference("$steps.x.outptu"), Some(Err(_))));
        assert!(matches!(reference("$nope"), Some(Err(_))));
        assert_eq!(reference("plain"), None);
    }
}

#[cfg(test)]
mod roundtrip {
    /// Found by the decoder campaign (`sortie-fuzz`, target `canonical_json`): without
    /// serde_json's `float_roundtrip`, a float past i64 read back from its own canonical
    /// text was another float, so a payload's canonical text (what event hashes cover)
    /// changed when read and written again.
    #[test]
    fn canonical_text_of_a_large_float_is_a_fixed_point() {
        for text in [
            "-9.223372727272726e+140",
            "-922337272727272727272727272727272727272727272727272727272727272727272727272036854775808",
            "1e308",
            "5e-324",
            "0.30000000000000004",
        ] {
            let value: serde_json::Value = serde_json::from_str(text).expect("a number");
            let canonical = super::canonical(&value);
            let again: serde_json::Value = serde_json::from_str(&canonical).expect("reads back");
            assert_eq!(super::canonical(&again), canonical, "{text}");
        }
    }
}
