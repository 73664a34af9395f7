//! The payload-sealing flags every service that reads or writes run payloads shares
//! (reducer, executor, gateway, `audit replay`): see `sortie_seal`.

use std::path::PathBuf;

use sortie_seal::SealConfig;

#[derive(Debug, Clone, clap::Args)]
pub struct SealArgs {
    /// Seal run payloads with per-run data keys: the keyring file of tenant
    /// key-encryption keys (YAML, see `sortie keys kek`). Needs --seal-key-store.
    #[arg(long, env = "SORTIE__SEAL__KEYRING", requires = "seal_key_store")]
    pub seal_keyring: Option<PathBuf>,
    /// Where the wrapped run data keys live: `file:///path` (dev, one node) or
    /// `s3://bucket[/prefix]`. Destroying a run's key there is crypto-shredding.
    #[arg(long, env = "SORTIE__SEAL__KEY_STORE", requires = "seal_keyring")]
    pub seal_key_store: Option<String>,
    /// An S3-compatible endpoint for --seal-key-store (MinIO, a test server); absent: AWS.
    #[arg(long, env = "SORTIE__SEAL__S3_ENDPOINT", requires = "seal_key_store")]
    pub seal_s3_endpoint: Option<String>,
    /// How long a looked-up data key may be reused before asking the store again: a key
    /// destroyed elsewhere stops working here within this.
    #[arg(long, env = "SORTIE__SEAL__CACHE_MS", default_value_t = 5_000)]
    pub seal_cache_ms: u64,
}

impl SealArgs {
    pub fn config(&self) -> Option<SealConfig> {
        let (keyring, store) = (self.seal_keyring.clone()?, self.seal_key_store.clone()?);
        Some(SealConfig {
            keyring,
            key_store: store,
            s3_endpoint: self.seal_s3_endpoint.clone(),
            cache_ms: self.seal_cache_ms,
        })
    }
}
