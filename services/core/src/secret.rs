//! Which environment variables a graph may name as a secret (`api_key_env` of an `llm`
//! node, `auth.env` of an MCP server). An executor runs every tenant's steps in one
//! process, so a graph that could name any variable could send the executor's `HOME`, its
//! blob store's `AWS_SECRET_ACCESS_KEY` or another tenant's token to a URL of its own. A
//! graph names only a variable of its tenant's secrets: `SORTIE_SECRET_<tenant>__<NAME>`,
//! the tenant written with every character outside `A-Z a-z 0-9` as `_` and two hex digits
//! (so two tenants never share a scope, and `__` ends it). The executor checks the
//! tenant of the step it runs; publication checks the prefix (a graph has no tenant of
//! its own yet).

/// The prefix of every variable a graph may name.
pub const PREFIX: &str = "SORTIE_SECRET_";

/// The prefix of the variables a graph of `tenant` may name: `SORTIE_SECRET_<tenant>__`.
pub fn scope(tenant: &str) -> String {
    let mut out = String::from(PREFIX);
    for byte in tenant.bytes() {
        if byte.is_ascii_alphanumeric() {
            out.push(byte as char);
        } else {
            out.push_str(&format!("_{byte:02X}"));
        }
    }
    out.push_str("__");
    out
}

/// Why a graph of `tenant` may not name the variable `name`, if it may not.
pub fn refusal(tenant: &str, name: &str) -> Option<String> {
    let scope = scope(tenant);
    match name.strip_prefix(&scope) {
        Some(rest) if !rest.is_empty() => None,
        _ => Some(format!(
            "a graph of tenant {} reads only its own secrets: environment variables named {scope}<NAME>, not {}",
            crate::limits::shown_id(tenant),
            crate::limits::shown_id(name)
        )),
    }
}

/// Why `name` can be no graph's secret at all (the check publication makes).
pub fn prefix_refusal(what: &str, name: &str) -> Option<String> {
    (!name.starts_with(PREFIX)).then(|| {
        format!("{what} must name a secret variable, SORTIE_SECRET_<tenant>__<NAME>, not {name:?}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_reads_only_its_own_scope() {
        assert_eq!(scope("acme"), "SORTIE_SECRET_acme__");
        assert_eq!(scope("a-b"), "SORTIE_SECRET_a_2Db__");
        assert_ne!(scope("a-b"), scope("a_b"));
        assert!(refusal("acme", "SORTIE_SECRET_acme__OPENAI_KEY").is_none());
        for name in [
            "HOME",
            "AWS_SECRET_ACCESS_KEY",
            "SORTIE_SECRET_globex__KEY",
            "SORTIE_SECRET_acme__",
            "SORTIE_SECRET_acmeX__KEY",
        ] {
            assert!(refusal("acme", name).is_some(), "{name}");
        }
        // No tenant's scope is inside another's.
        assert!(refusal("acme", &format!("{}K", scope("acme_2D"))).is_some());
    }
}
