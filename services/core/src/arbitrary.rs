//! Generated inputs for the property tests: JSON that serde_json must escape, nest and
//! sort with care.

use serde_json::Value;

/// Strings with every kind of byte serde_json escapes, and some it does not.
pub(crate) fn hostile_string() -> impl proptest::strategy::Strategy<Value = String> {
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

/// Any JSON document: every kind of scalar (a NaN or an infinity becomes null, as in any
/// `Value`), arrays and objects nested up to six deep.
pub(crate) fn json_value() -> impl proptest::strategy::Strategy<Value = Value> {
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
