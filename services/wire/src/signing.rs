//! Signed commands and graphs: who may write to `sortie.commands` and `sortie.graphs`.
//!
//! Anyone who can produce to the commands topic can write any `tenant`, `principal` and
//! `roles` into a command, and anyone who can produce to the graphs topic can publish a
//! graph version without its gates. A signature makes those records mean something: a
//! command (or graph) record carries two headers,
//!
//! - `sortie-key`: the id of the key that signed it (UTF-8), and
//! - `sortie-signature`: an Ed25519 signature (64 bytes) over the record's **exact value
//!   bytes** (Confluent framing included — the bytes the reducer decodes),
//!
//! and the reducer checks them against a [`Keyring`] before the fold sees the command.
//! A keyring entry says what its key may sign for:
//!
//! - a **service key** signs as one `principal`, for its `tenants`, claiming at most its
//!   `roles` and `groups` (a payments service that starts runs; a bot that approves);
//! - a **delegate key** (`delegate: true`, the gateway's) signs for the principals it has
//!   authenticated itself (bearer tokens): the command's principal, roles and groups are
//!   taken as written, only its tenant is checked;
//! - a **publisher key** (`publisher: true`) signs graph publications as its principal
//!   (the record's `published_by`), for its tenants — a graph of every tenant (no
//!   `tenant` in the record) needs `*`.
//!
//! Rotation: a principal may have several keys at once (add the new one, move the
//! signers, remove the old); the reducer re-reads the keyring file when it changes.
//! A signature covers one value: replaying it elsewhere changes nothing — the run id and
//! command id are inside the value. Replaying it *later* is refused by the reducer: a
//! signed command is valid only for a window around its `issued_at` (inside the signed
//! bytes), and its command id is remembered for that window, refused ones included
//! (`sortie-reducer`'s `replay`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use ed25519_dalek::{Signature, Signer as _, SigningKey, Verifier as _, VerifyingKey};
use serde::{Deserialize, Serialize};

/// The header naming the signing key.
pub const KEY_HEADER: &str = "sortie-key";
/// The header holding the Ed25519 signature over the value bytes.
pub const SIGNATURE_HEADER: &str = "sortie-signature";

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{what}: {reason}")]
    Invalid { what: String, reason: String },
}

fn invalid(what: impl Into<String>, reason: impl Into<String>) -> KeyError {
    KeyError::Invalid {
        what: what.into(),
        reason: reason.into(),
    }
}

fn read(path: &Path) -> Result<String, KeyError> {
    std::fs::read_to_string(path).map_err(|source| KeyError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// One key of a keyring, as written in its YAML file (`keys: [...]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyEntry {
    pub id: String,
    /// The Ed25519 public key: standard base64 of its 32 bytes.
    pub public_key: String,
    /// The principal it signs as (a delegate key: the signer's own name, for logs).
    pub principal: String,
    /// Tenants it may sign for; `*` is any.
    pub tenants: Vec<String>,
    /// Roles a command it signs may claim (not read for a delegate key).
    #[serde(default)]
    pub roles: Vec<String>,
    /// Approver groups a command it signs may claim (not read for a delegate key).
    #[serde(default)]
    pub groups: Vec<String>,
    /// Signs for principals it authenticated itself (the gateway).
    #[serde(default)]
    pub delegate: bool,
    /// May sign graph publications (`sortie graph publish --signing-key`), as its
    /// principal, for its tenants (`*` for graphs of every tenant). Absent in keyrings
    /// written before graphs were signed: such a key publishes nothing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub publisher: bool,
}

#[derive(Debug, Default, Deserialize)]
struct KeyringText {
    #[serde(default)]
    keys: Vec<KeyEntry>,
}

/// Who a command says it comes from: the fields a signature vouches for.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    pub tenant: &'a str,
    pub principal: &'a str,
    pub roles: &'a [String],
    pub groups: &'a [String],
}

/// The public keys commands are checked against.
#[derive(Debug, Default, Clone)]
pub struct Keyring {
    keys: HashMap<String, (VerifyingKey, KeyEntry)>,
}

impl Keyring {
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        Self::parse(&read(path)?).map_err(|e| match e {
            KeyError::Invalid { what, reason } => {
                invalid(format!("{}: {what}", path.display()), reason)
            }
            other => other,
        })
    }

    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let file: KeyringText =
            serde_yaml::from_str(text).map_err(|e| invalid("keyring", e.to_string()))?;
        let mut keys = HashMap::new();
        for entry in file.keys {
            let key = verifying_key(&entry.public_key)
                .map_err(|reason| invalid(format!("key {}", entry.id), reason))?;
            if entry.tenants.is_empty() {
                return Err(invalid(
                    format!("key {}", entry.id),
                    "lists no tenants (write `*` for any)",
                ));
            }
            if keys
                .insert(entry.id.clone(), (key, entry.clone()))
                .is_some()
            {
                return Err(invalid(format!("key {}", entry.id), "listed twice"));
            }
        }
        Ok(Self { keys })
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Checks a command record: its signature headers against `value`, then that the key
    /// may sign what the command claims. `Ok(None)`: not signed at all (the caller decides
    /// whether that is allowed). `Ok(Some(key id))`: signed and allowed. `Err`: why not.
    pub fn check<'h>(
        &self,
        headers: impl IntoIterator<Item = (&'h str, Option<&'h [u8]>)>,
        value: &[u8],
        claim: Claim<'_>,
    ) -> Result<Option<String>, String> {
        let Some((key_id, entry)) = self.verified(headers, value, "command")? else {
            return Ok(None);
        };
        if !entry.tenants.iter().any(|t| t == "*" || t == claim.tenant) {
            return Err(format!(
                "key {key_id:?} may not sign for tenant {:?}",
                claim.tenant
            ));
        }
        if !entry.delegate {
            if claim.principal != entry.principal {
                return Err(format!(
                    "key {key_id:?} signs as {:?}, not {:?}",
                    entry.principal, claim.principal
                ));
            }
            if let Some(role) = claim.roles.iter().find(|r| !entry.roles.contains(r)) {
                return Err(format!("key {key_id:?} may not claim role {role:?}"));
            }
            if let Some(group) = claim.groups.iter().find(|g| !entry.groups.contains(g)) {
                return Err(format!("key {key_id:?} may not claim group {group:?}"));
            }
        }
        Ok(Some(key_id.to_owned()))
    }

    /// Checks a graph record (`sortie.graphs`): its signature headers against `value`,
    /// then that the key is a publisher for the graph's tenant (`None`: a graph of every
    /// tenant, which needs a key for `*`) and signs as `published_by`. Same answers as
    /// [`Keyring::check`].
    pub fn check_graph<'h>(
        &self,
        headers: impl IntoIterator<Item = (&'h str, Option<&'h [u8]>)>,
        value: &[u8],
        tenant: Option<&str>,
        published_by: &str,
    ) -> Result<Option<String>, String> {
        let Some((key_id, entry)) = self.verified(headers, value, "graph")? else {
            return Ok(None);
        };
        if !entry.publisher {
            return Err(format!("key {key_id:?} may not publish graphs"));
        }
        let covered = match tenant {
            None => entry.tenants.iter().any(|t| t == "*"),
            Some(tenant) => entry.tenants.iter().any(|t| t == "*" || t == tenant),
        };
        if !covered {
            return Err(format!(
                "key {key_id:?} may not publish graphs of {}",
                tenant.map_or("every tenant".to_owned(), |t| format!("tenant {t:?}"))
            ));
        }
        if published_by != entry.principal {
            return Err(format!(
                "key {key_id:?} publishes as {:?}, not {published_by:?}",
                entry.principal
            ));
        }
        Ok(Some(key_id.to_owned()))
    }

    /// The key that signed `value` and its entry, when the headers hold a signature that
    /// verifies; `Ok(None)` without signature headers.
    fn verified<'h>(
        &self,
        headers: impl IntoIterator<Item = (&'h str, Option<&'h [u8]>)>,
        value: &[u8],
        what: &str,
    ) -> Result<Option<(&'h str, &KeyEntry)>, String> {
        let (mut key_id, mut signature) = (None, None);
        for (name, bytes) in headers {
            match name {
                KEY_HEADER => key_id = bytes,
                SIGNATURE_HEADER => signature = bytes,
                _ => {}
            }
        }
        let (key_id, signature) = match (key_id, signature) {
            (None, None) => return Ok(None),
            (Some(k), Some(s)) => (k, s),
            _ => {
                return Err(format!(
                    "a signed {what} needs both {KEY_HEADER} and {SIGNATURE_HEADER}"
                ))
            }
        };
        let key_id =
            std::str::from_utf8(key_id).map_err(|_| "the key id is not UTF-8".to_owned())?;
        let Some((key, entry)) = self.keys.get(key_id) else {
            // The id is the sender's: named, but never more of it than a person reads.
            let shown: String = key_id.chars().take(64).collect();
            return Err(format!("unknown signing key {shown:?}"));
        };
        let signature = Signature::from_slice(signature)
            .map_err(|_| "the signature is not 64 bytes".to_owned())?;
        key.verify(value, &signature)
            .map_err(|_| format!("the signature does not match the {what} (key {key_id:?})"))?;
        Ok(Some((key_id, entry)))
    }
}

/// A keyring file, read again when it changes, so keys rotate without a restart. A file
/// that changed but no longer loads keeps the last good keyring.
#[derive(Debug)]
pub struct KeyringFile {
    path: PathBuf,
    ring: Keyring,
    modified: Option<SystemTime>,
    checked: Instant,
}

impl KeyringFile {
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        Ok(Self {
            ring: Keyring::load(path)?,
            modified: modified(path),
            path: path.to_owned(),
            checked: Instant::now(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn ring(&self) -> &Keyring {
        &self.ring
    }

    /// Reads the file again if it changed since it was last read (looked at once per
    /// `recheck` at most). `Ok(true)`: the keyring changed. `Err`: the file changed but
    /// does not load; the last good keyring stays.
    pub fn refresh(&mut self, recheck: Duration) -> Result<bool, KeyError> {
        if self.checked.elapsed() < recheck {
            return Ok(false);
        }
        self.checked = Instant::now();
        let now = modified(&self.path);
        if now == self.modified {
            return Ok(false);
        }
        self.modified = now;
        self.ring = Keyring::load(&self.path)?;
        Ok(true)
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn verifying_key(base64: &str) -> Result<VerifyingKey, String> {
    let bytes = STANDARD
        .decode(base64.trim())
        .map_err(|e| format!("public_key is not base64: {e}"))?;
    let bytes: [u8; 32] = bytes
        .try_into()
        .map_err(|_| "public_key is not 32 bytes".to_owned())?;
    VerifyingKey::from_bytes(&bytes).map_err(|e| format!("public_key is not an Ed25519 key: {e}"))
}

/// A private signing key and its id, as kept in its own file (`id`, `secret_key`: base64
/// of the 32-byte Ed25519 seed). Whoever holds the file can sign as the key.
pub struct Signer {
    id: String,
    key: SigningKey,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

#[derive(Serialize, Deserialize)]
struct SignerFile {
    id: String,
    secret_key: String,
}

impl Signer {
    /// A new random key.
    pub fn generate(id: impl Into<String>) -> Result<Self, KeyError> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| invalid("a new key", e.to_string()))?;
        Ok(Self {
            id: id.into(),
            key: SigningKey::from_bytes(&seed),
        })
    }

    /// The key of a known seed (tests and fuzz targets that need the same key every
    /// time; a real key comes from [`Signer::generate`]).
    pub fn from_seed(id: impl Into<String>, seed: [u8; 32]) -> Self {
        Self {
            id: id.into(),
            key: SigningKey::from_bytes(&seed),
        }
    }

    pub fn load(path: &Path) -> Result<Self, KeyError> {
        let file: SignerFile = serde_yaml::from_str(&read(path)?)
            .map_err(|e| invalid(path.display().to_string(), e.to_string()))?;
        let seed = STANDARD
            .decode(file.secret_key.trim())
            .map_err(|e| invalid(path.display().to_string(), format!("secret_key: {e}")))?;
        let seed: [u8; 32] = seed
            .try_into()
            .map_err(|_| invalid(path.display().to_string(), "secret_key is not 32 bytes"))?;
        Ok(Self {
            id: file.id,
            key: SigningKey::from_bytes(&seed),
        })
    }

    /// The key file's text (keep it secret).
    pub fn to_file(&self) -> String {
        format!(
            "# A Sortie command-signing key. Secret: whoever holds it signs as {:?}.\nid: {}\nsecret_key: {}\n",
            self.id,
            self.id,
            STANDARD.encode(self.key.to_bytes())
        )
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Standard base64 of the public key (a keyring entry's `public_key`).
    pub fn public_key(&self) -> String {
        STANDARD.encode(self.key.verifying_key().to_bytes())
    }

    /// The keyring entry for this key.
    pub fn entry(
        &self,
        principal: &str,
        tenants: &[String],
        roles: &[String],
        delegate: bool,
    ) -> KeyEntry {
        KeyEntry {
            id: self.id.clone(),
            public_key: self.public_key(),
            principal: principal.to_owned(),
            tenants: tenants.to_vec(),
            roles: roles.to_vec(),
            groups: vec![],
            delegate,
            publisher: false,
        }
    }

    /// The two headers that sign `value`.
    pub fn headers(&self, value: &[u8]) -> [(&'static str, Vec<u8>); 2] {
        [
            (KEY_HEADER, self.id.as_bytes().to_vec()),
            (SIGNATURE_HEADER, self.key.sign(value).to_bytes().to_vec()),
        ]
    }
}

/// The entries of a keyring file's text, checked as [`Keyring::parse`] checks them.
pub fn keyring_entries(text: &str) -> Result<Vec<KeyEntry>, KeyError> {
    Keyring::parse(text)?;
    let file: KeyringText =
        serde_yaml::from_str(text).map_err(|e| invalid("keyring", e.to_string()))?;
    Ok(file.keys)
}

/// A keyring file's text with `entries`.
pub fn keyring_text(entries: &[KeyEntry]) -> String {
    #[derive(Serialize)]
    struct Out<'a> {
        keys: &'a [KeyEntry],
    }
    serde_yaml::to_string(&Out { keys: entries }).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(r: &[&str]) -> Vec<String> {
        r.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_service_key_signs_only_what_it_may() -> Result<(), KeyError> {
        let signer = Signer::generate("payments-1")?;
        let ring = Keyring::parse(&keyring_text(&[signer.entry(
            "svc:payments",
            &roles(&["acme"]),
            &roles(&["starter"]),
            false,
        )]))?;
        let value = b"\0\0\0\0\x01a command";
        let headers = signer.headers(value);
        let h = || headers.iter().map(|(k, v)| (*k, Some(v.as_slice())));
        let none: Vec<String> = vec![];
        let starter = roles(&["starter"]);
        let ok = Claim {
            tenant: "acme",
            principal: "svc:payments",
            roles: &starter,
            groups: &none,
        };
        assert_eq!(ring.check(h(), value, ok), Ok(Some("payments-1".into())));
        assert!(
            ring.check(h(), b"another command", ok).is_err(),
            "tampered value"
        );
        let other_tenant = Claim {
            tenant: "globex",
            ..ok
        };
        assert!(ring.check(h(), value, other_tenant).is_err());
        let other_principal = Claim {
            principal: "svc:else",
            ..ok
        };
        assert!(ring.check(h(), value, other_principal).is_err());
        let approver = roles(&["approver"]);
        let more_roles = Claim {
            roles: &approver,
            ..ok
        };
        assert!(ring.check(h(), value, more_roles).is_err());
        assert_eq!(ring.check([], value, ok), Ok(None), "unsigned");
        let unknown = Signer::generate("stranger")?;
        let forged = unknown.headers(value);
        assert!(ring
            .check(
                forged.iter().map(|(k, v)| (*k, Some(v.as_slice()))),
                value,
                ok
            )
            .is_err());
        Ok(())
    }

    #[test]
    fn a_delegate_key_vouches_for_principals_of_its_tenants() -> Result<(), KeyError> {
        let gateway = Signer::generate("gateway-1")?;
        let ring = Keyring::parse(&keyring_text(&[gateway.entry(
            "gateway",
            &roles(&["acme"]),
            &[],
            true,
        )]))?;
        let value = b"value";
        let headers = gateway.headers(value);
        let h = || headers.iter().map(|(k, v)| (*k, Some(v.as_slice())));
        let approver = roles(&["approver"]);
        let none: Vec<String> = vec![];
        let alice = Claim {
            tenant: "acme",
            principal: "user:alice",
            roles: &approver,
            groups: &none,
        };
        assert!(ring.check(h(), value, alice).is_ok());
        assert!(ring
            .check(
                h(),
                value,
                Claim {
                    tenant: "globex",
                    ..alice
                }
            )
            .is_err());
        Ok(())
    }

    #[test]
    fn only_a_publisher_key_signs_graphs_as_its_principal_for_its_tenants() -> Result<(), KeyError>
    {
        let publisher = Signer::generate("graphs-1")?;
        let mut publishes = publisher.entry("ops:graphs", &roles(&["*"]), &[], false);
        publishes.publisher = true;
        let acme_only = Signer::generate("graphs-acme")?;
        let mut acme = acme_only.entry("ops:acme", &roles(&["acme"]), &[], false);
        acme.publisher = true;
        let service = Signer::generate("svc-1")?;
        let ring = Keyring::parse(&keyring_text(&[
            publishes,
            acme,
            service.entry("svc:payments", &roles(&["*"]), &[], false),
        ]))?;
        let value = b"\0\0\0\0\x01a graph";
        let check = |signer: &Signer, value: &[u8], tenant: Option<&str>, by: &str| {
            let headers = signer.headers(value);
            ring.check_graph(
                headers.iter().map(|(k, v)| (*k, Some(v.as_slice()))),
                value,
                tenant,
                by,
            )
        };
        assert_eq!(
            check(&publisher, value, None, "ops:graphs"),
            Ok(Some("graphs-1".into()))
        );
        assert!(
            check(&publisher, value, None, "ops:other").is_err(),
            "as its principal"
        );
        assert!(
            check(&service, value, None, "svc:payments").is_err(),
            "not a publisher"
        );
        assert!(
            check(&acme_only, value, None, "ops:acme").is_err(),
            "every tenant needs *"
        );
        assert!(check(&acme_only, value, Some("acme"), "ops:acme").is_ok());
        assert!(check(&acme_only, value, Some("globex"), "ops:acme").is_err());
        let headers = publisher.headers(value);
        assert!(ring
            .check_graph(
                headers.iter().map(|(k, v)| (*k, Some(v.as_slice()))),
                b"another graph",
                None,
                "ops:graphs"
            )
            .is_err());
        assert_eq!(ring.check_graph([], value, None, "ops:graphs"), Ok(None));
        // A keyring written before graphs were signed still reads: its keys publish nothing.
        let old = "keys:\n- id: k\n  public_key: ".to_owned()
            + &service.public_key()
            + "\n  principal: svc:payments\n  tenants: ['*']\n";
        let old = Keyring::parse(&old)?;
        let headers = service.headers(value);
        assert!(old
            .check_graph(
                headers.iter().map(|(k, v)| (*k, Some(v.as_slice()))),
                value,
                None,
                "svc:payments"
            )
            .is_err());
        Ok(())
    }

    #[test]
    fn a_key_file_round_trips() -> Result<(), KeyError> {
        let signer = Signer::generate("k")?;
        let dir = std::env::temp_dir().join(format!("sortie-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|source| KeyError::Read {
            path: dir.display().to_string(),
            source,
        })?;
        let path = dir.join("k.yaml");
        std::fs::write(&path, signer.to_file()).map_err(|source| KeyError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let loaded = Signer::load(&path)?;
        assert_eq!(loaded.public_key(), signer.public_key());
        assert_eq!(loaded.headers(b"x")[1].1, signer.headers(b"x")[1].1);
        let _ = std::fs::remove_dir_all(dir);
        Ok(())
    }
}
