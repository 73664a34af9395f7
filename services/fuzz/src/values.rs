//! Hostile values the generators share: JSON payloads at and past each shape limit
//! ([`sortie_core::limits`]), ids and texts a careless or hostile client sends, and (for
//! HTTP) fields of the wrong type and bodies that are not JSON at all.

use serde_json::{json, Value};
use sortie_core::limits::{MAX_DEPTH, MAX_MEMBERS};

use crate::mutate::Rng;

/// Objects nested `depth` levels deep.
pub fn nested(depth: usize) -> Value {
    (0..depth).fold(json!(1), |v, _| json!({ "a": v }))
}

/// A JSON payload a hostile client might send: at the limits, past them, or odd.
pub fn payload(rng: &mut Rng) -> Value {
    use sortie_core::limits;
    match rng.below(10) {
        0 => nested(limits::MAX_DEPTH),
        1 => nested(limits::MAX_DEPTH + 1),
        2 => nested(125),
        3 => Value::Array((0..=limits::MAX_MEMBERS).map(|i| json!(i)).collect()),
        4 => json!({ "k".repeat(limits::MAX_KEY_BYTES + 1): 1 }),
        5 => json!({"s": "x".repeat(300 * 1024)}),
        6 => json!({"n": [u64::MAX, i64::MIN, 1e308, -1e308, 5e-324, -0.0]}),
        7 => json!({"t": "\u{0000}\u{202E}\u{200B}\u{FEFF}\u{1F600}\n\r\t\\\""}),
        8 => json!([[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]),
        _ => json!({"order": rng.next_u64(), "ok": true}),
    }
}

/// An id a hostile client might use.
pub fn id(rng: &mut Rng, base: &str) -> String {
    match rng.below(9) {
        0 => String::new(),
        1 => format!("{base}\u{0000}x"),
        2 => format!("{base}\u{202E}gnp"),
        3 => "r".repeat(300),
        4 => format!(" {base} "),
        5 => format!("{base}/../../etc/passwd"),
        6 => format!("{base}-ünïcødé-🚀"),
        _ => format!("{base}-{}", rng.next_u64() % 100_000),
    }
}

/// Free text a hostile client might send.
pub fn text(rng: &mut Rng) -> String {
    match rng.below(4) {
        0 => "c".repeat(sortie_core::limits::MAX_TEXT_BYTES + 1),
        1 => "z".repeat(250 * 1024),
        2 => "\u{202E}reversed\u{0000}".to_owned(),
        _ => "fine".to_owned(),
    }
}

/// Any field of a request body: a [`payload`], arrays nested around the depth limit, an
/// object past the member limit, a value of the wrong type, an extreme number, a hostile
/// id or text.
pub fn value(rng: &mut Rng) -> Value {
    match rng.below(8) {
        0 | 1 => payload(rng),
        2 => {
            let depth = *rng.pick(&[MAX_DEPTH, MAX_DEPTH + 1, 126]);
            (0..depth).fold(json!(1), |v, _| json!([v]))
        }
        3 => Value::Object(
            (0..=MAX_MEMBERS)
                .map(|i| (format!("k{i}"), json!(0)))
                .collect(),
        ),
        4 => rng
            .pick(&[
                json!(null),
                json!(true),
                json!(0),
                json!(""),
                json!([]),
                json!({}),
                json!([null]),
            ])
            .clone(),
        5 => rng
            .pick(&[
                json!(i64::MAX),
                json!(i64::MIN),
                json!(u64::MAX),
                json!(-1),
                json!(1e308),
                json!(-1e308),
                json!(0.1),
            ])
            .clone(),
        6 => json!(text(rng)),
        _ => json!(id(rng, "x")),
    }
}

/// A body that is not the JSON a route takes: empty, not JSON, not UTF-8, nested past
/// what the parser reads, a number no parser holds, or past the default body cap.
pub fn raw_body(rng: &mut Rng) -> Vec<u8> {
    match rng.below(14) {
        0 => Vec::new(),
        1 => b"   \n".to_vec(),
        2 => b"{".to_vec(),
        3 => b"{\"graph_id\": ".to_vec(),
        4 => b"{\"a\": 1}trailing".to_vec(),
        5 => b"{'single': 'quotes'}".to_vec(),
        6 => [b"\xEF\xBB\xBF".as_slice(), b"{}"].concat(),
        7 => b"\xff\xfe\x00{".to_vec(),
        8 => {
            let depth = *rng.pick(&[128, 129, 1_000, 100_000]);
            ["[".repeat(depth), "]".repeat(depth)].concat().into_bytes()
        }
        9 => b"1e999".to_vec(),
        10 => "9".repeat(2_000).into_bytes(),
        11 => b"{\"a\": \"\\ud800\"}".to_vec(),
        12 => b"nul".to_vec(),
        _ => {
            // Past the default body cap (256 KiB): 413.
            let mut body = b"{\"input\": \"".to_vec();
            body.resize(300 * 1024, b'x');
            body.extend_from_slice(b"\"}");
            body
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_value_and_body_is_drawn() {
        let mut rng = Rng(1);
        let drawn: Vec<Value> = (0..200).map(|_| value(&mut rng)).collect();
        let shape = |v: &Value| sortie_core::limits::check_shape("v", v);
        assert!(drawn.iter().any(|v| shape(v).is_err()));
        assert!(drawn.iter().any(|v| shape(v).is_ok()));
        let bodies: Vec<Vec<u8>> = (0..200).map(|_| raw_body(&mut rng)).collect();
        assert!(bodies.iter().any(Vec::is_empty));
        assert!(bodies
            .iter()
            .any(|b| serde_json::from_slice::<Value>(b).is_err()));
    }
}
