//! Where a step's secrets come from: a graph names one of its tenant's secrets as a
//! variable, `SORTIE_SECRET_<tenant>__<NAME>` (`sortie_core::secret`, checked against the
//! step's tenant before anything is read). The executor reads it from its environment, or
//! else from the operator's secrets directory (`--secrets-dir`): the file
//! `<dir>/<tenant>/<NAME>`, the tenant written as in the variable (every character
//! outside `A-Z a-z 0-9` as `_` and two hex digits), one trailing newline dropped — how a
//! Kubernetes Secret per tenant is mounted (the chart's `executorDefaults.tenantSecrets`).
//!
//! The directory is the process's, set once at startup ([`set_dir`]): the built-in
//! handlers are built before any configuration reaches them, and every handler of a
//! process reads the same source.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

static DIR: OnceLock<PathBuf> = OnceLock::new();

/// The most of a secret file read: a key or a token, never a document.
const MAX_SECRET_BYTES: u64 = 64 * 1024;

/// Sets the secrets directory of this process (the first call wins).
pub fn set_dir(dir: PathBuf) {
    let _ = DIR.set(dir);
}

/// The value of the secret variable `name` (already checked against the step's tenant):
/// from the environment, else from the secrets directory. `None` when neither has it.
pub fn read(name: &str) -> Option<String> {
    if let Ok(value) = std::env::var(name) {
        return Some(value);
    }
    read_from(DIR.get()?, name)
}

/// `name`'s file under `dir`: `<dir>/<tenant>/<NAME>` for `SORTIE_SECRET_<tenant>__<NAME>`.
/// Only names whose parts are `A-Z a-z 0-9 _` map to a file, so no name reaches outside
/// the directory.
pub fn read_from(dir: &Path, name: &str) -> Option<String> {
    let rest = name.strip_prefix(sortie_core::secret::PREFIX)?;
    let (tenant, secret) = rest.split_once("__")?;
    let plain =
        |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !plain(tenant) || !plain(secret) {
        return None;
    }
    let path = dir.join(tenant).join(secret);
    let file = std::fs::File::open(path).ok()?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(file, MAX_SECRET_BYTES), &mut text)
        .ok()?;
    if let Some(stripped) = text.strip_suffix('\n') {
        text.truncate(stripped.strip_suffix('\r').unwrap_or(stripped).len());
    }
    Some(text)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A tenant's secret file is found by its variable's name, and no name reaches
    /// another tenant's directory or outside the secrets directory.
    #[test]
    fn a_secret_file_is_read_by_its_variables_name_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("sortie-secrets-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("acme")).unwrap();
        std::fs::create_dir_all(dir.join("a_2Db")).unwrap();
        std::fs::write(dir.join("acme/OPENAI_KEY"), "sk-acme\n").unwrap();
        std::fs::write(dir.join("a_2Db/KEY"), "dash").unwrap();
        std::fs::write(dir.join("outside"), "no").unwrap();
        assert_eq!(
            read_from(&dir, "SORTIE_SECRET_acme__OPENAI_KEY").as_deref(),
            Some("sk-acme")
        );
        assert_eq!(
            read_from(&dir, &format!("{}KEY", sortie_core::secret::scope("a-b"))).as_deref(),
            Some("dash")
        );
        for name in [
            "SORTIE_SECRET_acme__MISSING",
            "SORTIE_SECRET_acme__..",
            "SORTIE_SECRET_acme__../outside",
            "SORTIE_SECRET_..__outside",
            "SORTIE_SECRET___outside",
            "HOME",
        ] {
            assert_eq!(read_from(&dir, name), None, "{name}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
