//! Avro schema resolution (writer's schema → reader's schema) for decoded values.
//!
//! apache-avro 0.22's `Value::resolve` picks a union branch by the value's *shape*: the
//! first branch the value fits. In a union of records that is wrong (a `ReconcileOperation`
//! fits `CancelRun`, whose only field is optional), so Sortie resolves itself, matching
//! union branches by name as the Avro specification says, and delegates only leaves
//! (promotions, enum symbols, logical types) and field defaults to apache-avro.

use std::collections::HashMap;

use apache_avro::{
    schema::{Name, ResolvedSchema, Schema},
    types::Value,
};

pub(crate) struct Resolver<'s> {
    writer: HashMap<Name, &'s Schema>,
    reader: HashMap<Name, &'s Schema>,
}

impl<'s> Resolver<'s> {
    pub(crate) fn new(writer: &'s Schema, reader: &'s Schema) -> Result<Self, String> {
        let names = |schema: &'s Schema| {
            ResolvedSchema::new(schema)
                .map(|resolved| resolved.get_names().clone())
                .map_err(|e| e.to_string())
        };
        Ok(Self {
            writer: names(writer)?,
            reader: names(reader)?,
        })
    }

    pub(crate) fn resolve(
        &self,
        value: Value,
        writer: &'s Schema,
        reader: &'s Schema,
    ) -> Result<Value, String> {
        let writer = deref(writer, &self.writer)?;
        let reader = deref(reader, &self.reader)?;
        match (writer, reader) {
            (Schema::Union(w), Schema::Union(r)) => {
                let Value::Union(index, inner) = value else {
                    return Err(format!("expected a union value, found {value:?}"));
                };
                let branch = w
                    .variants()
                    .get(index as usize)
                    .ok_or_else(|| format!("union branch {index} out of range"))?;
                let (target, reader_branch) = self.matching_branch(branch, r.variants())?;
                Ok(Value::Union(
                    target as u32,
                    Box::new(self.resolve(*inner, branch, reader_branch)?),
                ))
            }
            (Schema::Union(w), reader) => {
                let Value::Union(index, inner) = value else {
                    return Err(format!("expected a union value, found {value:?}"));
                };
                let branch = w
                    .variants()
                    .get(index as usize)
                    .ok_or_else(|| format!("union branch {index} out of range"))?;
                self.resolve(*inner, branch, reader)
            }
            (writer, Schema::Union(r)) => {
                let (target, reader_branch) = self.matching_branch(writer, r.variants())?;
                Ok(Value::Union(
                    target as u32,
                    Box::new(self.resolve(value, writer, reader_branch)?),
                ))
            }
            (Schema::Record(w), Schema::Record(r)) => {
                let Value::Record(fields) = value else {
                    return Err(format!("expected a record value for {}", r.name));
                };
                let mut by_name: HashMap<String, Value> = fields.into_iter().collect();
                let mut out = Vec::with_capacity(r.fields.len());
                for field in &r.fields {
                    let written = std::iter::once(&field.name)
                        .chain(field.aliases.iter())
                        .find_map(|name| {
                            w.fields
                                .iter()
                                .find(|wf| &wf.name == name)
                                .map(|wf| (wf, by_name.remove(&wf.name)))
                        });
                    let resolved = match written {
                        Some((wf, Some(value))) => {
                            self.resolve(value, &wf.schema, &field.schema)?
                        }
                        _ => {
                            let default = field.default.clone().ok_or_else(|| {
                                format!("{}.{} is missing and has no default", r.name, field.name)
                            })?;
                            let value = Value::try_from(default).map_err(|e| e.to_string())?;
                            value
                                .resolve(&field.schema)
                                .map_err(|e| format!("default of {}.{}: {e}", r.name, field.name))?
                        }
                    };
                    out.push((field.name.clone(), resolved));
                }
                Ok(Value::Record(out))
            }
            (Schema::Array(w), Schema::Array(r)) => match value {
                Value::Array(items) => items
                    .into_iter()
                    .map(|item| self.resolve(item, &w.items, &r.items))
                    .collect::<Result<_, _>>()
                    .map(Value::Array),
                other => Err(format!("expected an array, found {other:?}")),
            },
            (Schema::Map(w), Schema::Map(r)) => match value {
                Value::Map(items) => items
                    .into_iter()
                    .map(|(k, v)| Ok((k, self.resolve(v, &w.types, &r.types)?)))
                    .collect::<Result<_, String>>()
                    .map(Value::Map),
                other => Err(format!("expected a map, found {other:?}")),
            },
            (_, reader) => value.resolve(reader).map_err(|e| e.to_string()),
        }
    }

    /// The reader branch for a writer branch: the same name for named types, else the
    /// same kind, else the first branch the writer's type promotes to.
    fn matching_branch(
        &self,
        writer: &'s Schema,
        branches: &'s [Schema],
    ) -> Result<(usize, &'s Schema), String> {
        let writer = deref(writer, &self.writer)?;
        if let Some(name) = writer.name() {
            return branches
                .iter()
                .enumerate()
                .find(|(_, b)| {
                    deref(b, &self.reader)
                        .ok()
                        .and_then(Schema::name)
                        .is_some_and(|n| n.fullname(None) == name.fullname(None))
                })
                .ok_or_else(|| format!("the reader's union has no branch named {name}"));
        }
        let kind = std::mem::discriminant(writer);
        if let Some(found) = branches
            .iter()
            .enumerate()
            .find(|(_, b)| std::mem::discriminant(*b) == kind)
        {
            return Ok(found);
        }
        let promotions: &[fn(&Schema) -> bool] = match writer {
            Schema::Int => &[|s| matches!(s, Schema::Long | Schema::Float | Schema::Double)],
            Schema::Long => &[|s| matches!(s, Schema::Float | Schema::Double)],
            Schema::Float => &[|s| matches!(s, Schema::Double)],
            Schema::String => &[|s| matches!(s, Schema::Bytes)],
            Schema::Bytes => &[|s| matches!(s, Schema::String)],
            _ => &[],
        };
        branches
            .iter()
            .enumerate()
            .find(|(_, b)| promotions.iter().any(|p| p(b)))
            .ok_or_else(|| format!("the reader's union has no branch for {writer:?}"))
    }
}

fn deref<'s>(schema: &'s Schema, names: &HashMap<Name, &'s Schema>) -> Result<&'s Schema, String> {
    match schema {
        Schema::Ref { name } => names
            .get(name)
            .copied()
            .ok_or_else(|| format!("unknown named type {name}")),
        other => Ok(other),
    }
}
