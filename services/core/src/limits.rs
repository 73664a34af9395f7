//! What one run may write. Kafka refuses a record over the topics' `max.message.bytes`
//! (1 MiB), and a refused record inside a transaction aborts the whole batch — which would
//! then be replayed forever. So the fold itself keeps every run within these limits,
//! deterministically (the same history decides the same way on every replay):
//!
//! - a run's state (its JSON, the body of its changelog record) stays under
//!   [`MAX_STATE_BYTES`];
//! - every event and intent stays under [`MAX_RECORD_BYTES`];
//! - only the last [`MAX_REJECTED_COMMANDS`] rejected command ids are remembered for
//!   dedupe (accepted ones are bounded by what a run can accept).
//!
//! An input that would break a limit is not applied as is: a command is rejected with code
//! `too_large`; a step result whose output is too large becomes a non-retryable failure of
//! that step (`too_large`), handled by the node's failure policy; anything else fails the
//! run with the reason. Large values belong in a blob store, referenced by URI (SPEC §3).
//!
//! Sealed runs (`crate::seal`) are checked on their plaintext, and still fit: a sealed
//! payload of `L` bytes takes at most `4/3·(L + 28) + 20` (base64 of nonce, ciphertext and
//! tag, in `{"$sealed":"v1.…"}`). An event or intent of [`MAX_RECORD_BYTES`] seals to under
//! 520 KiB; a state of [`MAX_STATE_BYTES`] to under 690 KiB plus ~55 bytes per payload, and
//! every payload of a state sits in a step or interrupt with well over 150 bytes of its own
//! ids, so under 900 KiB — all under the 1 MiB record limit, without sealing anything twice
//! to measure it.

//!
//! **The shape of a payload.** Every JSON payload that enters Sortie — a run's input, a
//! decision's payload and edited arguments, a step's output, a reconciled output, the
//! values of a graph definition — is held to one rule, [`check_shape`], wherever it
//! enters: the gateway (answered 400 naming the limit), the reducer's decode of a raw
//! Kafka record (dead-lettered with the same words), the executor before it produces an
//! output (the step fails `too_large`) and the graph loader. The rule is: at most
//! [`MAX_DEPTH`] nested containers, [`MAX_MEMBERS`] members in one object or array,
//! [`MAX_KEY_BYTES`] in an object key and [`MAX_STRING_BYTES`] in a string. Every reader
//! of what Sortie stores (serde_json and serde_yaml stop at 128 levels) reads a payload
//! of that depth inside the documents that carry it; the fold still measures the depth of
//! everything it writes ([`measure`]) and refuses past [`MAX_STORED_DEPTH`], so a
//! template that nests one output inside another cannot write what cannot be read back.

use serde::Serialize;
use serde_json::Value;

/// Largest JSON of a run's state.
pub const MAX_STATE_BYTES: usize = 512 * 1024;
/// Largest JSON of one event or one intent.
pub const MAX_RECORD_BYTES: usize = 384 * 1024;
/// Rejected command ids remembered per run.
pub const MAX_REJECTED_COMMANDS: usize = 64;
/// Longest id (run, command, tenant, operation, graph) in bytes.
pub const MAX_ID_BYTES: usize = 256;
/// Longest free text a client writes into a run (a decision's comment, a cancel's reason,
/// an operator's error, a label's value), in bytes. A step's error message from an
/// executor is cut to it instead (a result is never refused for its wording).
pub const MAX_TEXT_BYTES: usize = 4096;
/// Most labels on one run.
pub const MAX_LABELS: usize = 64;
/// Longest reason a rejection stores (`CommandRejected.reason`, and the answer a run keeps
/// for a rejected command id). Reasons are the fold's own sentences; a client's value
/// appears in one only as an id cut to [`MAX_SHOWN_ID_BYTES`], so this cut is a backstop.
pub const MAX_REASON_BYTES: usize = 512;
/// Most bytes of a client-named id (an interrupt, an operation, a graph) a reason shows.
pub const MAX_SHOWN_ID_BYTES: usize = 64;
/// Most decisions one run keeps waiting for interrupts not registered yet.
pub const MAX_BUFFERED: usize = 16;
/// Most bytes (their JSON) the decisions one run keeps waiting may take together: well
/// under [`MAX_STATE_BYTES`], so early decisions, however many clients send, never bring
/// a run near its state limit (where the next step result would fail it).
pub const MAX_BUFFERED_BYTES: usize = 64 * 1024;

/// Whether `value`, the free text called `field`, is at most `max` bytes.
pub fn check_text(field: &str, value: &str, max: usize) -> Result<(), String> {
    if value.len() > max {
        return Err(format!(
            "{field} has {} bytes; at most {max} are allowed",
            value.len()
        ));
    }
    Ok(())
}

/// Whether `labels` are few enough, their names ids and their values short texts.
pub fn check_labels<'l>(
    labels: impl ExactSizeIterator<Item = (&'l String, &'l String)>,
) -> Result<(), String> {
    if labels.len() > MAX_LABELS {
        return Err(format!(
            "labels has {} entries; at most {MAX_LABELS} are allowed",
            labels.len()
        ));
    }
    for (name, value) in labels {
        check_id("a label's name", name)?;
        check_text(&format!("label {name}"), value, MAX_TEXT_BYTES)?;
    }
    Ok(())
}

/// Most nested containers (objects and arrays) in one payload: `{"a": [1]}` has two.
pub const MAX_DEPTH: usize = 64;
/// Most members (an object's keys, an array's items) of one container in a payload.
pub const MAX_MEMBERS: usize = 10_000;
/// Longest object key in a payload, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;
/// Longest string in a payload, in bytes (the record limit bounds a payload as a whole).
pub const MAX_STRING_BYTES: usize = MAX_RECORD_BYTES;
/// Deepest JSON document the fold writes (a state, an event, an intent). serde_json reads
/// 128 levels; what is left above this is for the documents readers wrap a state in (the
/// gateway's stored run, a fork's carried source).
pub const MAX_STORED_DEPTH: usize = 100;

/// Which limit a value broke: the word the gateway's answer and a dead letter's reason
/// name it by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Depth,
    Members,
    KeyBytes,
    StringBytes,
}

impl Limit {
    pub fn name(self) -> &'static str {
        match self {
            Limit::Depth => "depth",
            Limit::Members => "members",
            Limit::KeyBytes => "key_bytes",
            Limit::StringBytes => "string_bytes",
        }
    }

    pub fn max(self) -> usize {
        match self {
            Limit::Depth => MAX_DEPTH,
            Limit::Members => MAX_MEMBERS,
            Limit::KeyBytes => MAX_KEY_BYTES,
            Limit::StringBytes => MAX_STRING_BYTES,
        }
    }
}

/// A payload that does not have the shape Sortie carries (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ShapeError {
    pub limit: Limit,
    /// Where in the payload, e.g. `input.order.items[3]` (cut to a readable length).
    pub at: String,
    pub message: String,
}

/// Longest path a [`ShapeError`] names; a longer one is cut with `…`.
const MAX_PATH_CHARS: usize = 120;

/// Checks `value`, the payload called `field`, against the payload limits. Iterative, so
/// a value deeper than the stack could hold is refused rather than followed.
pub fn check_shape(field: &str, value: &Value) -> Result<(), ShapeError> {
    // (value, its depth counting itself if it is a container, its path)
    let mut pending: Vec<(&Value, usize, Path<'_>)> = vec![(value, 1, Path::Root(field))];
    let breach = |limit: Limit, at: &Path<'_>, what: String| {
        let at = at.render();
        Err(ShapeError {
            limit,
            message: format!("{at}: {what}; at most {} allowed", limit.max()),
            at,
        })
    };
    while let Some((value, depth, path)) = pending.pop() {
        match value {
            Value::Object(map) => {
                if depth > MAX_DEPTH {
                    return breach(Limit::Depth, &path, format!("nests {depth} levels deep"));
                }
                if map.len() > MAX_MEMBERS {
                    return breach(Limit::Members, &path, format!("has {} keys", map.len()));
                }
                for (key, member) in map {
                    if key.len() > MAX_KEY_BYTES {
                        return breach(
                            Limit::KeyBytes,
                            &path,
                            format!("has a key of {} bytes", key.len()),
                        );
                    }
                    pending.push((member, depth + 1, path.key(key)));
                }
            }
            Value::Array(items) => {
                if depth > MAX_DEPTH {
                    return breach(Limit::Depth, &path, format!("nests {depth} levels deep"));
                }
                if items.len() > MAX_MEMBERS {
                    return breach(Limit::Members, &path, format!("has {} items", items.len()));
                }
                for (index, item) in items.iter().enumerate() {
                    pending.push((item, depth + 1, path.index(index)));
                }
            }
            Value::String(text) if text.len() > MAX_STRING_BYTES => {
                return breach(
                    Limit::StringBytes,
                    &path,
                    format!("is a string of {} bytes", text.len()),
                );
            }
            _ => {}
        }
    }
    Ok(())
}

/// Where a value sits, built only when a breach names it: each step keeps its parent's
/// rendered prefix short, so a path costs nothing on the way down but a small string.
#[derive(Debug, Clone)]
enum Path<'v> {
    Root(&'v str),
    Rendered(String),
}

impl<'v> Path<'v> {
    fn render(&self) -> String {
        match self {
            Path::Root(field) => (*field).to_owned(),
            Path::Rendered(text) => text.clone(),
        }
    }

    fn extend(&self, step: std::fmt::Arguments<'_>) -> Path<'v> {
        let mut text = self.render();
        if text.chars().count() < MAX_PATH_CHARS {
            text.push_str(&step.to_string());
            if text.chars().count() >= MAX_PATH_CHARS {
                text = text.chars().take(MAX_PATH_CHARS).collect();
                text.push('…');
            }
        }
        Path::Rendered(text)
    }

    fn key(&self, key: &str) -> Path<'v> {
        let shown: String = key.chars().take(32).filter(|c| !c.is_control()).collect();
        self.extend(format_args!(".{shown}"))
    }

    fn index(&self, index: usize) -> Path<'v> {
        self.extend(format_args!("[{index}]"))
    }
}

/// The length of `value`'s JSON, without building it.
pub fn json_len<T: Serialize + ?Sized>(value: &T) -> usize {
    measure(value).bytes
}

/// The size of a JSON document and how deep its containers nest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Measure {
    pub bytes: usize,
    pub depth: usize,
}

mod measure;
mod measured;

pub use measured::{measure_state, MeasuredSteps};

/// [`Measure`]s `value`'s JSON as serde_json writes it, without building it: by walking
/// its structure (`measure::walk`), or — for what that walk does not model — by writing
/// it to a counter that scans the bytes.
pub fn measure<T: Serialize + ?Sized>(value: &T) -> Measure {
    measure::walk(value).unwrap_or_else(|_| measure_written(value))
}

/// [`measure`] by writing `value` with serde_json: the definition the walk is held to.
pub fn measure_written<T: Serialize + ?Sized>(value: &T) -> Measure {
    #[derive(Default)]
    struct Scan {
        bytes: usize,
        depth: usize,
        deepest: usize,
        in_string: bool,
        escaped: bool,
    }
    impl std::io::Write for Scan {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.bytes += buf.len();
            for &b in buf {
                if self.in_string {
                    match (self.escaped, b) {
                        (true, _) => self.escaped = false,
                        (false, b'\\') => self.escaped = true,
                        (false, b'"') => self.in_string = false,
                        _ => {}
                    }
                    continue;
                }
                match b {
                    b'"' => self.in_string = true,
                    b'{' | b'[' => {
                        self.depth += 1;
                        self.deepest = self.deepest.max(self.depth);
                    }
                    b'}' | b']' => self.depth = self.depth.saturating_sub(1),
                    _ => {}
                }
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut scan = Scan::default();
    match serde_json::to_writer(&mut scan, value) {
        Ok(()) => Measure {
            bytes: scan.bytes,
            depth: scan.deepest,
        },
        Err(_) => Measure {
            bytes: usize::MAX,
            depth: usize::MAX,
        },
    }
}

/// Whether `value` is an id Sortie can carry everywhere it goes: a Kafka key, a sled key
/// (where NUL separates fields), a URL path segment, a log line, a person's screen.
/// Non-empty, at most [`MAX_ID_BYTES`], no control characters, no invisible formatting
/// characters (bidirectional overrides, zero-width joiners: two ids that look alike must
/// be alike), no whitespace at either end.
pub fn check_id(field: &str, value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err(format!("{field} is empty"));
    }
    if value.len() > MAX_ID_BYTES {
        return Err(format!(
            "{field} has {} bytes; at most {MAX_ID_BYTES} are allowed",
            value.len()
        ));
    }
    if let Some(c) = value.chars().find(|c| c.is_control()) {
        return Err(format!(
            "{field} contains the control character U+{:04X}",
            c as u32
        ));
    }
    if let Some(c) = value.chars().find(|c| is_invisible(*c)) {
        return Err(format!(
            "{field} contains the invisible character U+{:04X}",
            c as u32
        ));
    }
    if value.trim() != value {
        return Err(format!("{field} starts or ends with whitespace"));
    }
    Ok(())
}

/// Characters that change how text shows without showing themselves (Unicode's format
/// characters that matter in practice, and the line and paragraph separators).
fn is_invisible(c: char) -> bool {
    matches!(c,
        '\u{00AD}' | '\u{061C}' | '\u{180E}' | '\u{200B}'..='\u{200F}' | '\u{2028}'..='\u{202E}'
        | '\u{2060}'..='\u{206F}' | '\u{FEFF}' | '\u{FFF9}'..='\u{FFFB}')
}

/// At most `max` bytes of `text` (cut at a character boundary): a client's free text kept
/// in a record Sortie writes (a comment, a reason) never grows that record without bound.
pub fn clip(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A client-named id as a rejection's reason shows it: at most [`MAX_SHOWN_ID_BYTES`]
/// bytes of it (cut at a character boundary), with `…` when it was cut.
pub fn shown_id(id: &str) -> String {
    let shown = clip(id, MAX_SHOWN_ID_BYTES);
    if shown.len() < id.len() {
        format!("{shown}…")
    } else {
        shown.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_ids_are_cut() {
        assert_eq!(shown_id("int_1"), "int_1");
        let long = "é".repeat(200);
        let shown = shown_id(&long);
        assert!(shown.len() <= MAX_SHOWN_ID_BYTES + '…'.len_utf8());
        assert!(shown.ends_with('…'));
    }

    #[test]
    fn ids_with_control_characters_or_too_long_are_refused() {
        assert!(check_id("run_id", "run_01").is_ok());
        assert!(check_id("run_id", "").is_err());
        assert!(check_id("run_id", "a\0b").is_err());
        assert!(check_id("run_id", "a\nb").is_err());
        assert!(check_id("run_id", &"x".repeat(MAX_ID_BYTES)).is_ok());
        assert!(check_id("run_id", &"x".repeat(MAX_ID_BYTES + 1)).is_err());
    }

    #[test]
    fn invisible_characters_and_padding_are_refused_in_ids() {
        assert!(check_id("run_id", "run\u{202E}1").is_err());
        assert!(check_id("run_id", "run\u{200B}1").is_err());
        assert!(check_id("run_id", " run").is_err());
        assert!(check_id("run_id", "run 1").is_ok());
        assert!(check_id("run_id", "ünïcode-run").is_ok());
    }

    fn nested(depth: usize) -> Value {
        let mut value = serde_json::json!(1);
        for _ in 0..depth {
            value = serde_json::json!({ "a": value });
        }
        value
    }

    #[test]
    fn a_payload_at_each_limit_passes_and_one_past_it_is_named() {
        assert!(check_shape("input", &nested(MAX_DEPTH)).is_ok());
        let deep = check_shape("input", &nested(MAX_DEPTH + 1)).expect_err("too deep");
        assert_eq!(deep.limit, Limit::Depth);
        assert!(deep.at.starts_with("input.a.a"), "{}", deep.at);
        assert!(deep.message.contains("at most 64"), "{}", deep.message);

        let wide: Vec<Value> = (0..MAX_MEMBERS).map(|i| serde_json::json!(i)).collect();
        assert!(check_shape("input", &Value::Array(wide.clone())).is_ok());
        let mut wider = wide;
        wider.push(serde_json::json!(0));
        let members = check_shape("input", &serde_json::json!({"list": wider})).expect_err("wide");
        assert_eq!(
            (members.limit, members.at.as_str()),
            (Limit::Members, "input.list")
        );

        let key = "k".repeat(MAX_KEY_BYTES + 1);
        let keyed = check_shape("payload", &serde_json::json!({ key: 1 })).expect_err("key");
        assert_eq!(keyed.limit, Limit::KeyBytes);

        let long = "s".repeat(MAX_STRING_BYTES + 1);
        let string = check_shape("output", &serde_json::json!([long])).expect_err("string");
        assert_eq!(
            (string.limit, string.at.as_str()),
            (Limit::StringBytes, "output[0]")
        );
    }

    #[test]
    fn a_path_is_cut_to_a_readable_length() {
        let deep = check_shape("input", &nested(1000)).expect_err("too deep");
        assert!(deep.at.chars().count() <= MAX_PATH_CHARS + 1, "{}", deep.at);
    }

    #[test]
    fn measure_counts_containers_outside_strings_only() {
        let value = serde_json::json!({"a": [{"b": "[[{{\\\"]]"}], "c": "\\"});
        let measured = measure(&value);
        assert_eq!(measured.depth, 3);
        assert_eq!(
            measured.bytes,
            serde_json::to_vec(&value).map(|v| v.len()).unwrap_or(0)
        );
        assert_eq!(measure(&nested(130)).depth, 130);
        assert_eq!(measure(&serde_json::json!("{")).depth, 0);
    }

    /// Strings with every kind of byte serde_json escapes, and some it does not.
    fn hostile_string() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        proptest::collection::vec(
            prop_oneof![
                Just('"'),
                Just('\\'),
                Just('\u{7f}'),
                Just('é'),
                Just('\u{2028}'),
                Just('🦀'),
                (0u32..0x20).prop_map(|c| char::from_u32(c).unwrap_or('?')),
                any::<char>(),
                Just('{'),
                Just(']'),
            ],
            0..12,
        )
        .prop_map(|chars| chars.into_iter().collect())
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            (-1e6f64..1e6).prop_map(Value::from),
            hostile_string().prop_map(Value::from),
        ];
        leaf.prop_recursive(6, 64, 8, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::btree_map(hostile_string(), inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// The walk that measures without writing agrees with serde_json's writer. Seen
        /// red: with `\u{7f}` counted as an escape, and with a map's colon left out.
        #[test]
        fn measuring_by_the_walk_is_measuring_the_written_json(value in json_value()) {
            proptest::prop_assert_eq!(measure(&value), measure_written(&value));
            proptest::prop_assert_eq!(
                measure(&value).bytes,
                serde_json::to_vec(&value).map(|v| v.len()).unwrap_or(0)
            );
        }
    }

    #[test]
    fn the_walk_agrees_on_what_serde_derives() {
        #[derive(Serialize)]
        enum Kind {
            Unit,
            New(u8),
            Tuple(i32, String),
            Struct { a: Option<f32>, b: Vec<u8> },
        }
        #[derive(Serialize)]
        struct Doc {
            kinds: Vec<Kind>,
            keyed: std::collections::BTreeMap<u32, char>,
            signed: std::collections::BTreeMap<i64, ()>,
            big: (u128, i128),
            #[serde(with = "bytes")]
            raw: Vec<u8>,
        }
        mod bytes {
            pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(v)
            }
        }
        let doc = Doc {
            kinds: vec![
                Kind::Unit,
                Kind::New(7),
                Kind::Tuple(-3, "a\"b".into()),
                Kind::Struct {
                    a: Some(1.5),
                    b: vec![],
                },
                Kind::Struct {
                    a: Some(f32::NAN),
                    b: vec![0, 10, 255],
                },
            ],
            keyed: [(0, '\n'), (4_000_000_000, 'x')].into_iter().collect(),
            signed: [(-12, ())].into_iter().collect(),
            big: (u128::MAX, i128::MIN),
            raw: vec![0, 1, 200],
        };
        assert_eq!(measure(&doc), measure_written(&doc));
        // A map with keys serde_json refuses, and one with keys it writes as text: the
        // walk leaves both to serde_json.
        let refused: std::collections::BTreeMap<Vec<u8>, u8> = [(vec![1], 1)].into_iter().collect();
        assert_eq!(measure(&refused).bytes, usize::MAX);
        let booleans: std::collections::BTreeMap<bool, u8> = [(true, 1)].into_iter().collect();
        assert_eq!(measure(&booleans), measure_written(&booleans));
    }

    #[test]
    fn clip_cuts_at_a_character_boundary() {
        assert_eq!(clip("héllo", 2), "h");
        assert_eq!(clip("héllo", 3), "hé");
        assert_eq!(clip("ok", 10), "ok");
    }

    #[test]
    fn json_len_is_the_length_of_the_json() {
        let value = serde_json::json!({"a": [1, "two", null], "b": "ü"});
        assert_eq!(
            json_len(&value),
            serde_json::to_vec(&value).map(|v| v.len()).unwrap_or(0)
        );
    }
}
