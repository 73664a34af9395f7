//! A blob store on any S3-compatible API (AWS S3, MinIO, Ceph RGW, ...), through the
//! `object_store` crate's S3 client.
//!
//! `s3://bucket/prefix`: keys live under `prefix/`. Region and credentials come from the
//! usual AWS environment variables (`AWS_REGION` / `AWS_DEFAULT_REGION`,
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, web identity, the
//! instance metadata service); the endpoint of a server other than AWS is
//! `--blob-s3-endpoint` (path-style requests; `http://` allowed for it).
//!
//! Requests are retried by the client a few times within [`RETRY_TIMEOUT`] (a 5xx, a
//! dropped connection); past that the caller gets [`Error::Unavailable`] and decides
//! (the executor fails the step retryably, the gateway answers 503). A PUT of an object
//! is atomic on S3: a reader sees the previous object or the whole new one.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt as _, StreamExt as _, TryStreamExt as _};
use hmac::Mac as _;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::client::{
    CryptoProvider, DigestAlgorithm, DigestContext, HmacContext, Signer, SigningAlgorithm,
};
use object_store::path::Path;
use object_store::{BackoffConfig, ObjectStore, ObjectStoreExt as _, PutPayload, RetryConfig};
use sha2::Digest as _;

use crate::{check_key, BlobStore, Error};

/// How long one operation may keep retrying before it reports the store unavailable.
pub const RETRY_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub struct S3Store {
    store: AmazonS3,
    bucket: String,
    prefix: Option<String>,
}

impl S3Store {
    /// `location` is `bucket[/prefix]` (the URL without `s3://`).
    pub fn open(location: &str, endpoint: Option<&str>) -> Result<S3Store, Error> {
        let (bucket, prefix) = match location.split_once('/') {
            Some((bucket, prefix)) => (bucket, prefix.trim_matches('/')),
            None => (location, ""),
        };
        if bucket.is_empty() {
            return Err(Error::Config(format!("s3://{location} names no bucket")));
        }
        let prefix = if prefix.is_empty() {
            None
        } else {
            check_key(prefix)?;
            Some(prefix.to_owned())
        };
        let retry = RetryConfig {
            max_retries: 3,
            retry_timeout: RETRY_TIMEOUT,
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(2),
                base: 2.0,
            },
        };
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_crypto_provider(Arc::new(RustCrypto))
            .with_retry(retry);
        if std::env::var_os("AWS_REGION").is_none()
            && std::env::var_os("AWS_DEFAULT_REGION").is_none()
        {
            builder = builder.with_region("us-east-1");
        }
        if let Some(endpoint) = endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_virtual_hosted_style_request(false)
                .with_allow_http(endpoint.starts_with("http://"));
        }
        let store = builder
            .build()
            .map_err(|e| Error::Config(format!("s3://{location}: {e}")))?;
        Ok(S3Store {
            store,
            bucket: bucket.to_owned(),
            prefix,
        })
    }

    fn path(&self, key: &str) -> Result<Path, Error> {
        check_key(key)?;
        let full = match &self.prefix {
            Some(prefix) => format!("{prefix}/{key}"),
            None => key.to_owned(),
        };
        Path::parse(full).map_err(|e| Error::InvalidKey {
            key: key.to_owned(),
            problem: e.to_string(),
        })
    }
}

fn unavailable(e: object_store::Error) -> Error {
    Error::Unavailable(e.to_string())
}

impl BlobStore for S3Store {
    fn put<'a>(&'a self, key: &'a str, bytes: Vec<u8>) -> BoxFuture<'a, Result<(), Error>> {
        async move {
            let path = self.path(key)?;
            self.store
                .put(&path, PutPayload::from(bytes))
                .await
                .map_err(unavailable)?;
            Ok(())
        }
        .boxed()
    }

    fn put_new<'a>(&'a self, key: &'a str, bytes: Vec<u8>) -> BoxFuture<'a, Result<(), Error>> {
        async move {
            let path = self.path(key)?;
            // A conditional PUT (If-None-Match: *), which S3 and most compatible servers
            // honour; one that does not would overwrite, so check yours before relying on it.
            let options = object_store::PutOptions::from(object_store::PutMode::Create);
            match self
                .store
                .put_opts(&path, PutPayload::from(bytes), options)
                .await
            {
                Ok(_) => Ok(()),
                Err(
                    object_store::Error::AlreadyExists { .. }
                    | object_store::Error::Precondition { .. },
                ) => Err(Error::Exists(key.to_owned())),
                Err(e) => Err(unavailable(e)),
            }
        }
        .boxed()
    }

    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<u8>, Error>> {
        async move {
            let path = self.path(key)?;
            match self.store.get(&path).await {
                Ok(found) => Ok(found.bytes().await.map_err(unavailable)?.to_vec()),
                Err(object_store::Error::NotFound { .. }) => Err(Error::NotFound(key.to_owned())),
                Err(e) => Err(unavailable(e)),
            }
        }
        .boxed()
    }

    fn exists<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool, Error>> {
        async move {
            let path = self.path(key)?;
            match self.store.head(&path).await {
                Ok(_) => Ok(true),
                Err(object_store::Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(unavailable(e)),
            }
        }
        .boxed()
    }

    fn delete_prefix<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<u64, Error>> {
        async move {
            let path = self.path(prefix)?;
            // Listing is by whole segments (object_store's rule, the same as the
            // directory store's); the object named exactly `prefix` is not listed.
            let mut locations: Vec<Path> = self
                .store
                .list(Some(&path))
                .map_ok(|meta| meta.location)
                .try_collect()
                .await
                .map_err(unavailable)?;
            if self.exists(prefix).await? {
                locations.push(path);
            }
            let count = locations.len() as u64;
            let stream = futures::stream::iter(locations.into_iter().map(Ok)).boxed();
            self.store
                .delete_stream(stream)
                .try_collect::<Vec<_>>()
                .await
                .map_err(unavailable)?;
            Ok(count)
        }
        .boxed()
    }

    fn location(&self) -> String {
        match &self.prefix {
            Some(prefix) => format!("s3://{}/{prefix}", self.bucket),
            None => format!("s3://{}", self.bucket),
        }
    }
}

/// SigV4 needs SHA-256 and HMAC-SHA256; object_store's bundled providers are ring or
/// aws-lc-rs (C builds). This one uses the RustCrypto crates the workspace already builds.
/// RS256 signing (Google service accounts) is not needed for S3 and is refused.
#[derive(Debug, Default, Clone, Copy)]
pub struct RustCrypto;

impl CryptoProvider for RustCrypto {
    fn digest(&self, algorithm: DigestAlgorithm) -> object_store::Result<Box<dyn DigestContext>> {
        match algorithm {
            DigestAlgorithm::Sha256 => Ok(Box::new(Sha256Context {
                hasher: Some(sha2::Sha256::new()),
                out: Vec::new(),
            })),
            other => Err(not_supported(format!("digest {other:?}"))),
        }
    }

    fn hmac(
        &self,
        algorithm: DigestAlgorithm,
        secret: &[u8],
    ) -> object_store::Result<Box<dyn HmacContext>> {
        match algorithm {
            DigestAlgorithm::Sha256 => {
                let mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret)
                    .map_err(|e| not_supported(format!("HMAC key: {e}")))?;
                Ok(Box::new(HmacSha256 {
                    mac: Some(mac),
                    out: Vec::new(),
                }))
            }
            other => Err(not_supported(format!("HMAC {other:?}"))),
        }
    }

    fn sign(
        &self,
        algorithm: SigningAlgorithm,
        _pem: &[u8],
    ) -> object_store::Result<Box<dyn Signer>> {
        Err(not_supported(format!("signing with {algorithm:?}")))
    }
}

fn not_supported(what: String) -> object_store::Error {
    object_store::Error::NotSupported {
        source: format!("Sortie's crypto provider does not do {what}").into(),
    }
}

struct Sha256Context {
    hasher: Option<sha2::Sha256>,
    out: Vec<u8>,
}

impl DigestContext for Sha256Context {
    fn update(&mut self, data: &[u8]) {
        if let Some(hasher) = &mut self.hasher {
            hasher.update(data);
        }
    }

    fn finish(&mut self) -> object_store::Result<&[u8]> {
        if let Some(hasher) = self.hasher.take() {
            self.out = hasher.finalize().to_vec();
        }
        Ok(&self.out)
    }
}

struct HmacSha256 {
    mac: Option<hmac::Hmac<sha2::Sha256>>,
    out: Vec<u8>,
}

impl HmacContext for HmacSha256 {
    fn update(&mut self, data: &[u8]) {
        if let Some(mac) = &mut self.mac {
            mac.update(data);
        }
    }

    fn finish(&mut self) -> object_store::Result<&[u8]> {
        if let Some(mac) = self.mac.take() {
            self.out = mac.finalize().into_bytes().to_vec();
        }
        Ok(&self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crypto_provider_matches_known_answers() {
        // RFC 4231 test case 2 (HMAC-SHA256) and the SHA-256 of "abc".
        let mut mac = RustCrypto
            .hmac(DigestAlgorithm::Sha256, b"Jefe")
            .expect("hmac");
        mac.update(b"what do ya want ");
        mac.update(b"for nothing?");
        assert_eq!(
            sortie_core::json::hex(mac.finish().expect("mac")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let mut digest = RustCrypto.digest(DigestAlgorithm::Sha256).expect("digest");
        digest.update(b"abc");
        assert_eq!(
            sortie_core::json::hex(digest.finish().expect("digest")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn locations_name_a_bucket_and_keep_keys_under_the_prefix() {
        let store = S3Store::open("bucket/some/prefix", Some("http://127.0.0.1:1")).expect("store");
        assert_eq!(store.location(), "s3://bucket/some/prefix");
        assert_eq!(
            store.path("t/r/aa").expect("path").as_ref(),
            "some/prefix/t/r/aa"
        );
        assert!(store.path("../x").is_err());
        assert!(S3Store::open("/x", None).is_err());
        assert!(S3Store::open("bucket/../x", None).is_err());
    }
}
