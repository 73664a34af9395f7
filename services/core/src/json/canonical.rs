//! Canonical JSON text written straight from a value's `Serialize` structure.
//!
//! The event hash is the SHA-256 of an event's canonical JSON: the text of the
//! `serde_json::Value` its fields make, whose objects keep their keys sorted. Building
//! that `Value` first (a node and a copied string per field, every payload cloned) was
//! most of the hashing's cost, ~5 % of the reducer's CPU under load. This serializer
//! writes the same text without it: sequences as they come, an object's entries each
//! written on their own and then put out in key order.
//!
//! It must agree with `serde_json::to_value` then `to_writer` byte for byte: hashes are
//! recomputed by auditors from the events' fields. Where that path has a rule this one
//! does not model (an `f32`, which `Value` widens to `f64`; 128-bit integers; bytes; a map
//! key that is not a string or a char; an error raised by a value's own `Serialize`), it
//! gives up with [`Unmodelled`] and the caller goes through `Value`, whose text is the
//! definition.

use std::collections::BTreeMap;

use serde::ser::{self, Serialize};

/// The integer methods of a `Serializer`, each `$body` with the serializer and the value.
macro_rules! integers {
    ($ok:ty, |$this:ident, $v:ident| $body:expr) => {
        integers!(@each $ok, $this, $v, $body;
            serialize_i8: i8, serialize_i16: i16, serialize_i32: i32, serialize_i64: i64,
            serialize_u8: u8, serialize_u16: u16, serialize_u32: u32, serialize_u64: u64);
    };
    (@each $ok:ty, $this:ident, $v:ident, $body:expr; $($method:ident: $ty:ty),*) => {
        $(fn $method(self, $v: $ty) -> $ok {
            let $this = self;
            $body
        })*
    };
}

/// An array's `Serialize*` impl: each element written in order, then closed.
macro_rules! compound {
    ($kind:ident, $trait:ident, $method:ident) => {
        impl ser::$trait for $kind<'_> {
            type Ok = ();
            type Error = Unmodelled;

            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Unmodelled> {
                self.element(value)
            }

            fn end(self) -> Result<(), Unmodelled> {
                self.finish();
                Ok(())
            }
        }
    };
}

/// A struct's (or struct variant's) `Serialize*` impl: fields as entries of an object.
macro_rules! fields {
    ($trait:ident) => {
        impl ser::$trait for Object<'_> {
            type Ok = ();
            type Error = Unmodelled;

            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                key: &'static str,
                value: &T,
            ) -> Result<(), Unmodelled> {
                self.entry(key.to_owned(), value)
            }

            fn end(self) -> Result<(), Unmodelled> {
                self.finish();
                Ok(())
            }
        }
    };
}

use crate::json::Unmodelled;

/// `value`'s canonical JSON text, as `serde_json::to_value(value)` would write.
pub(super) fn to_vec<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, Unmodelled> {
    let mut out = Vec::with_capacity(256);
    value.serialize(Writer { out: &mut out })?;
    Ok(out)
}

/// Appends `s` as a JSON string literal, escaped as serde_json escapes.
fn string(out: &mut Vec<u8>, s: &str) {
    // Writing into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// Appends `n` as serde_json writes an integer.
fn integer<N: Serialize>(out: &mut Vec<u8>, n: N) {
    let _ = serde_json::to_writer(&mut *out, &n);
}

struct Writer<'o> {
    out: &'o mut Vec<u8>,
}

/// The entries of an object being written, by key: put out sorted when it ends (a key
/// met twice keeps its last value, as a `Value` map's insert does).
struct Object<'o> {
    out: &'o mut Vec<u8>,
    entries: BTreeMap<String, Vec<u8>>,
    key: Option<String>,
    /// The variant name a struct variant is wrapped in (`{"Variant":{...}}`).
    variant: Option<&'static str>,
}

impl Object<'_> {
    fn entry<T: Serialize + ?Sized>(&mut self, key: String, value: &T) -> Result<(), Unmodelled> {
        let mut written = Vec::new();
        value.serialize(Writer { out: &mut written })?;
        self.entries.insert(key, written);
        Ok(())
    }

    fn finish(self) {
        let out = self.out;
        if let Some(variant) = self.variant {
            out.push(b'{');
            string(out, variant);
            out.push(b':');
        }
        out.push(b'{');
        for (i, (key, value)) in self.entries.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            string(out, key);
            out.push(b':');
            out.extend_from_slice(value);
        }
        out.push(b'}');
        if self.variant.is_some() {
            out.push(b'}');
        }
    }
}

/// An array being written, in order; `wrapped`: inside `{"Variant":` (a tuple variant).
struct Array<'o> {
    out: &'o mut Vec<u8>,
    first: bool,
    wrapped: bool,
}

impl Array<'_> {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Unmodelled> {
        if !self.first {
            self.out.push(b',');
        }
        self.first = false;
        value.serialize(Writer { out: self.out })
    }

    fn finish(self) {
        self.out.push(b']');
        if self.wrapped {
            self.out.push(b'}');
        }
    }
}

impl<'o> ser::Serializer for Writer<'o> {
    type Ok = ();
    type Error = Unmodelled;
    type SerializeSeq = Array<'o>;
    type SerializeTuple = Array<'o>;
    type SerializeTupleStruct = Array<'o>;
    type SerializeTupleVariant = Array<'o>;
    type SerializeMap = Object<'o>;
    type SerializeStruct = Object<'o>;
    type SerializeStructVariant = Object<'o>;

    fn serialize_bool(self, v: bool) -> Result<(), Unmodelled> {
        self.out
            .extend_from_slice(if v { b"true" } else { b"false" });
        Ok(())
    }

    integers!(Result<(), Unmodelled>, |this, v| {
        integer(this.out, v);
        Ok(())
    });

    fn serialize_f32(self, _: f32) -> Result<(), Unmodelled> {
        // `Value` holds it as the f64 it widens to, which writes other digits.
        Err(Unmodelled)
    }

    fn serialize_f64(self, v: f64) -> Result<(), Unmodelled> {
        // A `Value` has no NaN or infinity: they become null.
        if v.is_finite() {
            let _ = serde_json::to_writer(&mut *self.out, &v);
        } else {
            self.out.extend_from_slice(b"null");
        }
        Ok(())
    }

    fn serialize_char(self, v: char) -> Result<(), Unmodelled> {
        string(self.out, v.encode_utf8(&mut [0; 4]));
        Ok(())
    }

    fn serialize_str(self, v: &str) -> Result<(), Unmodelled> {
        string(self.out, v);
        Ok(())
    }

    fn serialize_bytes(self, _: &[u8]) -> Result<(), Unmodelled> {
        Err(Unmodelled)
    }

    fn serialize_none(self) -> Result<(), Unmodelled> {
        self.serialize_unit()
    }

    fn serialize_unit(self) -> Result<(), Unmodelled> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }

    serialize_as_serde_json_does!(Unmodelled);

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), Unmodelled> {
        self.out.push(b'{');
        string(self.out, variant);
        self.out.push(b':');
        value.serialize(Writer { out: self.out })?;
        self.out.push(b'}');
        Ok(())
    }

    fn serialize_seq(self, _: Option<usize>) -> Result<Array<'o>, Unmodelled> {
        self.out.push(b'[');
        Ok(Array {
            out: self.out,
            first: true,
            wrapped: false,
        })
    }

    fn serialize_tuple(self, len: usize) -> Result<Array<'o>, Unmodelled> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_struct(self, _: &'static str, len: usize) -> Result<Array<'o>, Unmodelled> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Array<'o>, Unmodelled> {
        self.out.push(b'{');
        string(self.out, variant);
        self.out.extend_from_slice(b":[");
        Ok(Array {
            out: self.out,
            first: true,
            wrapped: true,
        })
    }

    fn serialize_map(self, _: Option<usize>) -> Result<Object<'o>, Unmodelled> {
        Ok(Object {
            out: self.out,
            entries: BTreeMap::new(),
            key: None,
            variant: None,
        })
    }

    fn serialize_struct(self, name: &'static str, len: usize) -> Result<Object<'o>, Unmodelled> {
        if name.starts_with("$serde_json::") {
            // A number or raw value in serde_json's own encoding (its features
            // `arbitrary_precision`, `raw_value`): written its way.
            return Err(Unmodelled);
        }
        self.serialize_map(Some(len))
    }

    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Object<'o>, Unmodelled> {
        Ok(Object {
            out: self.out,
            entries: BTreeMap::new(),
            key: None,
            variant: Some(variant),
        })
    }
}

compound!(Array, SerializeSeq, serialize_element);
compound!(Array, SerializeTuple, serialize_element);
compound!(Array, SerializeTupleStruct, serialize_field);
compound!(Array, SerializeTupleVariant, serialize_field);

impl ser::SerializeMap for Object<'_> {
    type Ok = ();
    type Error = Unmodelled;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Unmodelled> {
        self.key = Some(key.serialize(Key)?);
        Ok(())
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Unmodelled> {
        let key = self.key.take().ok_or(Unmodelled)?;
        self.entry(key, value)
    }

    fn end(self) -> Result<(), Unmodelled> {
        self.finish();
        Ok(())
    }
}

fields!(SerializeStruct);
fields!(SerializeStructVariant);

/// A map key, as the text serde_json makes of it: a string, a char, an integer (its
/// digits), a unit variant (its name) or a newtype around one of those. Any other key
/// (which serde_json writes by another rule, or refuses) is left to serde_json.
struct Key;

/// An integer key's text.
fn digits<N: Serialize>(n: N) -> String {
    serde_json::to_string(&n).unwrap_or_default()
}

impl ser::Serializer for Key {
    type Ok = String;
    type Error = Unmodelled;
    type SerializeSeq = ser::Impossible<String, Unmodelled>;
    type SerializeTuple = ser::Impossible<String, Unmodelled>;
    type SerializeTupleStruct = ser::Impossible<String, Unmodelled>;
    type SerializeTupleVariant = ser::Impossible<String, Unmodelled>;
    type SerializeMap = ser::Impossible<String, Unmodelled>;
    type SerializeStruct = ser::Impossible<String, Unmodelled>;
    type SerializeStructVariant = ser::Impossible<String, Unmodelled>;

    fn serialize_str(self, v: &str) -> Result<String, Unmodelled> {
        Ok(v.to_owned())
    }
    fn serialize_char(self, v: char) -> Result<String, Unmodelled> {
        Ok(v.to_string())
    }
    integers!(Result<String, Unmodelled>, |_this, v| Ok(digits(v)));
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<String, Unmodelled> {
        value.serialize(self)
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<String, Unmodelled> {
        Ok(variant.to_owned())
    }

    refuse_unmodelled_keys!(String, Unmodelled, Unmodelled);
}
