//! Large payloads by reference (SPEC §3: "large artifacts travel by reference, never
//! inline"). A value too large to carry in a run's records is stored in a blob store by
//! the writer (the executor for a step's output, the gateway for a run's input or a
//! decision's payload) and the record carries a **reference** in its place — plain JSON
//! inside the payload strings, so no Avro schema changes and old readers still parse it:
//!
//! ```json
//! {"$blob": "sortie-blob:acme/run_01/3f…a9", "sha256": "3f…a9", "size": 2097152,
//!  "media_type": "application/json"}
//! ```
//!
//! The key is `<tenant>/<run_id>/<sha256 of the bytes>`: per run (so a run's blobs can be
//! deleted by prefix) and content-addressed within it (a retried step writing the same
//! output writes the same key). A reference may carry `"path": "a.b"`: the value at that
//! path *inside* the blob. The fold never reads a blob (it performs no I/O): when an
//! argument template points into a referenced value, [`project`] answers the reference
//! with the rest of the path, and the executor fetches, verifies and projects it before
//! the handler runs. So the same history still folds to the same state.
//!
//! This module is pure: types, parsing, key encoding and hashing. Stores live in
//! `sortie-blob`.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// The scheme of a reference's URI.
pub const URI_SCHEME: &str = "sortie-blob:";
/// The field that makes an object a reference.
pub const REF_FIELD: &str = "$blob";
/// The media type of every blob Sortie's own writers store (a JSON value's text).
pub const JSON_MEDIA_TYPE: &str = "application/json";

/// A reference to a stored value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobRef {
    /// `sortie-blob:<key>`.
    pub uri: String,
    /// Lower-case hex SHA-256 of the stored bytes.
    pub sha256: String,
    /// Length of the stored bytes.
    pub size: u64,
    pub media_type: String,
    /// The dotted path inside the stored value this reference stands for; `None` for
    /// the whole value.
    pub path: Option<String>,
}

impl BlobRef {
    /// The reference for `bytes` stored under `key`.
    pub fn new(key: &BlobKey, bytes: &[u8], media_type: &str) -> BlobRef {
        BlobRef {
            uri: format!("{URI_SCHEME}{}", key.as_str()),
            sha256: key.sha256().to_owned(),
            size: bytes.len() as u64,
            media_type: media_type.to_owned(),
            path: None,
        }
    }

    /// The reference `value` is, if it is one: an object with exactly the reference's
    /// fields, a `$blob` URI of this scheme, a 64-hex `sha256` and an integer `size`.
    /// Anything else (user data that merely has a `$blob` key, say) is not a reference.
    pub fn from_value(value: &Value) -> Option<BlobRef> {
        let map = value.as_object()?;
        let uri = map.get(REF_FIELD)?.as_str()?;
        if !uri.starts_with(URI_SCHEME) {
            return None;
        }
        let known = ["$blob", "sha256", "size", "media_type", "path"];
        if map.keys().any(|k| !known.contains(&k.as_str())) {
            return None;
        }
        let sha256 = map.get("sha256")?.as_str()?;
        if !is_sha256_hex(sha256) {
            return None;
        }
        let size = map.get("size")?.as_u64()?;
        let media_type = match map.get("media_type") {
            None => JSON_MEDIA_TYPE.to_owned(),
            Some(v) => v.as_str()?.to_owned(),
        };
        let path = match map.get("path") {
            None => None,
            Some(Value::String(p)) if p.is_empty() => None,
            Some(Value::String(p)) => Some(p.clone()),
            Some(_) => return None,
        };
        Some(BlobRef {
            uri: uri.to_owned(),
            sha256: sha256.to_owned(),
            size,
            media_type,
            path,
        })
    }

    /// The reference as JSON (the form records carry).
    pub fn to_value(&self) -> Value {
        let mut map = Map::new();
        map.insert(REF_FIELD.into(), Value::String(self.uri.clone()));
        map.insert("sha256".into(), Value::String(self.sha256.clone()));
        map.insert("size".into(), Value::from(self.size));
        map.insert("media_type".into(), Value::String(self.media_type.clone()));
        if let Some(path) = &self.path {
            map.insert("path".into(), Value::String(path.clone()));
        }
        Value::Object(map)
    }

    /// The store key the URI names. Refused: another scheme, a key that is not
    /// `<tenant>/<run>/<sha256>` or whose hash is not the reference's.
    pub fn key(&self) -> Result<BlobKey, String> {
        let key = self
            .uri
            .strip_prefix(URI_SCHEME)
            .ok_or_else(|| format!("{:?} is not a {URI_SCHEME} URI", self.uri))?;
        let key = BlobKey::parse(key)?;
        if key.sha256() != self.sha256 {
            return Err(format!(
                "the reference's sha256 {} is not the one its URI names ({})",
                self.sha256,
                key.sha256()
            ));
        }
        Ok(key)
    }

    /// This reference narrowed to `more` (a dotted path) inside its value.
    pub fn deeper(&self, more: &str) -> BlobRef {
        let path = match (&self.path, more) {
            (p, "") => p.clone(),
            (None, more) => Some(more.to_owned()),
            (Some(p), more) => Some(format!("{p}.{more}")),
        };
        BlobRef {
            path,
            ..self.clone()
        }
    }
}

/// A blob's key: `<tenant>/<run_id>/<sha256>`, each id segment percent-encoded so that
/// any tenant or run id (ids may hold `/`, `.` or `%`) gives exactly one safe key, and
/// no key can name `..`, an absolute path or a NUL.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobKey {
    text: String,
    tenant: String,
    run_id: String,
}

impl BlobKey {
    /// The key of `bytes` for a run.
    pub fn for_bytes(tenant: &str, run_id: &str, bytes: &[u8]) -> BlobKey {
        BlobKey::from_parts(tenant, run_id, &sha256_hex(bytes))
    }

    fn from_parts(tenant: &str, run_id: &str, sha256: &str) -> BlobKey {
        BlobKey {
            text: format!("{}/{sha256}", run_prefix(tenant, run_id)),
            tenant: tenant.to_owned(),
            run_id: run_id.to_owned(),
        }
    }

    /// Parses `<tenant>/<run>/<sha256>` (encoded segments).
    pub fn parse(text: &str) -> Result<BlobKey, String> {
        let parts: Vec<&str> = text.split('/').collect();
        let [tenant, run_id, sha256] = parts.as_slice() else {
            return Err(format!("{text:?} is not <tenant>/<run_id>/<sha256>"));
        };
        if !is_sha256_hex(sha256) {
            return Err(format!("{sha256:?} is not a lower-case hex SHA-256"));
        }
        let tenant = decode_segment(tenant)?;
        let run_id = decode_segment(run_id)?;
        let key = BlobKey::from_parts(&tenant, &run_id, sha256);
        if key.text != text {
            // Only the canonical encoding is a key: one value, one key.
            return Err(format!("{text:?} is not canonically encoded"));
        }
        Ok(key)
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    pub fn sha256(&self) -> &str {
        &self.text[self.text.len() - 64..]
    }
}

impl std::fmt::Display for BlobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// The key prefix of every blob of a run: `<tenant>/<run_id>` (encoded). Deleting it
/// deletes the run's blobs.
pub fn run_prefix(tenant: &str, run_id: &str) -> String {
    format!("{}/{}", encode_segment(tenant), encode_segment(run_id))
}

/// Percent-encodes every byte but `A-Z a-z 0-9 _ - .`, and a leading `.` (so no segment
/// is `.`, `..` or hidden). Ids are never empty (`limits::check_id`), so neither is a
/// segment.
fn encode_segment(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (i, b) in text.bytes().enumerate() {
        let plain = b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && i > 0);
        if plain {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn decode_segment(text: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("{text:?} has a bad percent escape"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{text:?} does not decode to UTF-8"))
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    crate::json::hex(&Sha256::digest(bytes))
}

/// Whether `text` is 64 lower-case hex digits.
pub fn is_sha256_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether `value` holds a reference anywhere.
pub fn has_refs(value: &Value) -> bool {
    if BlobRef::from_value(value).is_some() {
        return true;
    }
    match value {
        Value::Array(items) => items.iter().any(has_refs),
        Value::Object(map) => map.values().any(has_refs),
        _ => false,
    }
}

/// Every reference in `value`, in document order (keys sorted).
pub fn refs(value: &Value) -> Vec<BlobRef> {
    fn walk(value: &Value, out: &mut Vec<BlobRef>) {
        if let Some(r) = BlobRef::from_value(value) {
            out.push(r);
            return;
        }
        match value {
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            Value::Object(map) => map.values().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(value, &mut out);
    out
}

/// The value at a dotted path, like [`crate::json::at_path`], except that a reference met
/// on the way answers for the rest of the path: the reference itself with `path` extended
/// by the segments not yet walked. The fold cannot look inside a blob, so it hands the
/// executor the reference and the path, deterministically.
pub fn project(value: &Value, path: &str) -> Option<Value> {
    if let Some(r) = BlobRef::from_value(value) {
        return Some(r.deeper(path).to_value());
    }
    if path.is_empty() {
        return Some(value.clone());
    }
    let (segment, rest) = path.split_once('.').unwrap_or((path, ""));
    project(crate::json::step(value, segment)?, rest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn references_round_trip_and_name_their_key() {
        let key = BlobKey::for_bytes("acme", "run_01", b"hello");
        let r = BlobRef::new(&key, b"hello", JSON_MEDIA_TYPE);
        assert_eq!(BlobRef::from_value(&r.to_value()), Some(r.clone()));
        assert_eq!(r.key(), Ok(key.clone()));
        assert_eq!(key.tenant(), "acme");
        assert_eq!(key.run_id(), "run_01");
        assert_eq!(key.sha256(), sha256_hex(b"hello"));
        assert!(r.uri.starts_with("sortie-blob:acme/run_01/"));
    }

    #[test]
    fn lookalikes_are_not_references() {
        let sha = sha256_hex(b"x");
        for value in [
            json!({"$blob": "s3://bucket/x", "sha256": sha, "size": 1}),
            json!({"$blob": format!("sortie-blob:a/b/{sha}"), "sha256": "nothex", "size": 1}),
            json!({"$blob": format!("sortie-blob:a/b/{sha}"), "sha256": sha, "size": -1}),
            json!({"$blob": format!("sortie-blob:a/b/{sha}"), "sha256": sha, "size": 1, "other": 1}),
            json!({"$blob": format!("sortie-blob:a/b/{sha}"), "sha256": sha, "size": 1, "path": 3}),
            json!("$blob"),
        ] {
            assert_eq!(BlobRef::from_value(&value), None, "{value}");
        }
    }

    #[test]
    fn keys_never_escape_and_encode_one_way() {
        let sha = sha256_hex(b"x");
        for (tenant, run) in [
            ("..", "run"),
            ("a/b", "r"),
            (".hidden", "r"),
            ("t", "/abs"),
            ("t", "a\0b"),
            ("50%", "r"),
        ] {
            let key = BlobKey::from_parts(tenant, run, &sha);
            for segment in key.as_str().split('/') {
                assert!(!segment.is_empty() && !segment.starts_with('.'), "{key}");
                assert!(!segment.contains('\0'), "{key}");
            }
            let parsed = BlobKey::parse(key.as_str()).expect("its own key parses");
            assert_eq!((parsed.tenant(), parsed.run_id()), (tenant, run));
        }
        for bad in [
            format!("../r/{sha}"),
            format!("/t/r/{sha}"),
            format!("t/r/x/{sha}"),
            format!("t/r/{}", sha.to_uppercase()),
            format!("t/%2e%2e/{sha}"), // lower-case escape: not canonical
            format!("t/a%2Fb/{sha}/"),
            "t/r/short".to_owned(),
        ] {
            assert!(BlobKey::parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_reference_whose_hash_is_not_its_keys_is_refused() {
        let key = BlobKey::for_bytes("t", "r", b"one");
        let mut r = BlobRef::new(&key, b"one", JSON_MEDIA_TYPE);
        r.sha256 = sha256_hex(b"two");
        assert!(r.key().is_err());
    }

    #[test]
    fn projection_stops_at_a_reference_and_carries_the_rest_of_the_path() {
        let key = BlobKey::for_bytes("t", "r", b"{}");
        let r = BlobRef::new(&key, b"{}", JSON_MEDIA_TYPE).to_value();
        let output = json!({"doc": r, "small": {"n": 1}});
        assert_eq!(project(&output, "small.n"), Some(json!(1)));
        assert_eq!(project(&output, "nope"), None);
        assert_eq!(project(&output, "doc"), Some(r.clone()));
        let deep = project(&output, "doc.items.0.total").expect("a reference");
        let deep = BlobRef::from_value(&deep).expect("still a reference");
        assert_eq!(deep.path.as_deref(), Some("items.0.total"));
        // A reference that already has a path is narrowed further.
        let deeper = project(&deep.to_value(), "sku").expect("a reference");
        assert_eq!(
            BlobRef::from_value(&deeper).and_then(|r| r.path),
            Some("items.0.total.sku".into())
        );
        assert!(has_refs(&output));
        assert_eq!(refs(&output).len(), 1);
        assert!(!has_refs(&json!({"a": [1, {"b": "$blob"}]})));
    }
}
