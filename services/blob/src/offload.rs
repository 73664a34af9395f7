//! The writers' policy: what of a value goes to the blob store.
//!
//! A value whose JSON is at most the threshold stays inline. A larger **object** keeps its
//! shape: its largest fields are stored one by one (largest first, ties by key) and
//! replaced by references until the object fits. The small fields the fold reads stay
//! readable — an `llm` output's `tool_calls` and `usage`, a precheck's `ok`, an agent's
//! `next_steps`, the fields edge conditions test — while a transcript or a document
//! beside them goes by reference. Anything else (an array, a string, or an object that
//! still does not fit, e.g. thousands of small fields) is stored whole and the value
//! becomes one reference.
//!
//! Every blob is the JSON text of the value it replaces, keyed by its hash within the run:
//! the same value written twice (a retried step, a retried start) is the same key.

use serde_json::Value;
use sortie_core::blob::{BlobKey, BlobRef, JSON_MEDIA_TYPE};
use sortie_core::limits::json_len;

use crate::{BlobStore, Error};

/// What [`plan`] decided: the value to carry, and the blobs to store first.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub value: Value,
    pub blobs: Vec<(BlobKey, Vec<u8>)>,
}

/// Decides, without I/O, what of `value` is stored by reference for a run.
pub fn plan(tenant: &str, run_id: &str, value: Value, threshold: usize) -> Plan {
    let total = json_len(&value);
    if total <= threshold {
        return Plan {
            value,
            blobs: Vec::new(),
        };
    }
    if let Value::Object(map) = &value {
        let mut fields: Vec<(&String, Vec<u8>)> = map
            .iter()
            .filter(|(_, v)| BlobRef::from_value(v).is_none())
            .map(|(k, v)| (k, serde_json::to_vec(v).unwrap_or_default()))
            .collect();
        fields.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then_with(|| a.0.cmp(b.0)));
        let mut out = map.clone();
        let mut blobs = Vec::new();
        let mut size = total;
        for (name, bytes) in fields {
            if size <= threshold {
                break;
            }
            let key = BlobKey::for_bytes(tenant, run_id, &bytes);
            let reference = BlobRef::new(&key, &bytes, JSON_MEDIA_TYPE).to_value();
            let smaller = json_len(&reference);
            if smaller >= bytes.len() {
                continue;
            }
            size = size - bytes.len() + smaller;
            out.insert(name.clone(), reference);
            blobs.push((key, bytes));
        }
        if size <= threshold {
            return Plan {
                value: Value::Object(out),
                blobs,
            };
        }
    }
    let bytes = serde_json::to_vec(&value).unwrap_or_default();
    let key = BlobKey::for_bytes(tenant, run_id, &bytes);
    Plan {
        value: BlobRef::new(&key, &bytes, JSON_MEDIA_TYPE).to_value(),
        blobs: vec![(key, bytes)],
    }
}

/// Stores what [`plan`] says and answers the value to carry. Every blob is written (and
/// durable) before this returns, so a record carrying the answer never references a blob
/// that is not there. A failed write is the caller's to report: nothing was carried.
pub async fn offload(
    store: &dyn BlobStore,
    tenant: &str,
    run_id: &str,
    value: Value,
    threshold: usize,
) -> Result<Value, Error> {
    let plan = plan(tenant, run_id, value, threshold);
    for (key, bytes) in plan.blobs {
        let size = bytes.len();
        store.put(key.as_str(), bytes).await?;
        tracing::info!(key = %key, size, store = %store.location(), "Stored a large value by reference.");
    }
    Ok(plan.value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use sortie_core::blob::project;

    #[test]
    fn small_values_stay_inline() {
        let value = json!({"a": 1, "b": "x".repeat(100)});
        let plan = plan("t", "r", value.clone(), 1024);
        assert_eq!(plan.value, value);
        assert!(plan.blobs.is_empty());
    }

    #[test]
    fn large_fields_go_by_reference_and_small_ones_stay() {
        let big = "x".repeat(10_000);
        let value = json!({
            "content": big,
            "tool_calls": [{"function": {"name": "lookup"}}],
            "usage": {"prompt_tokens": 3},
            "doc": {"text": "y".repeat(5_000), "total": 42},
        });
        let plan = plan("t", "r", value.clone(), 2_000);
        assert_eq!(plan.value["tool_calls"], value["tool_calls"]);
        assert_eq!(plan.value["usage"], value["usage"]);
        let content = BlobRef::from_value(&plan.value["content"]).expect("a reference");
        assert_eq!(content.size as usize, big.len() + 2);
        // Both large fields went, the larger first.
        assert_eq!(plan.blobs.len(), 2);
        assert_eq!(
            plan.blobs[0].1,
            serde_json::to_vec(&value["content"]).unwrap_or_default()
        );
        assert!(json_len(&plan.value) <= 2_000);
        // A path into a stored field renders as the reference with the rest of the path.
        let total = project(&plan.value, "doc.total").expect("a reference");
        assert_eq!(
            BlobRef::from_value(&total).and_then(|r| r.path),
            Some("total".into())
        );
        // Same value, same keys: a retry writes the same blobs.
        assert_eq!(super::plan("t", "r", value, 2_000), plan);
    }

    #[test]
    fn values_that_cannot_fit_by_fields_go_whole() {
        let many: serde_json::Map<String, Value> =
            (0..500).map(|i| (format!("k{i:04}"), json!(i))).collect();
        for value in [
            json!("z".repeat(5_000)),
            Value::Array(vec![json!(1); 3_000]),
            Value::Object(many),
        ] {
            let plan = plan("t", "r", value.clone(), 1_000);
            let whole = BlobRef::from_value(&plan.value).expect("one reference");
            assert_eq!(plan.blobs.len(), 1);
            assert_eq!(
                plan.blobs[0].1,
                serde_json::to_vec(&value).unwrap_or_default()
            );
            assert_eq!(whole.path, None);
        }
    }
}
