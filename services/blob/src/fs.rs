//! A blob store in a directory: one file per key under the root. For dev, tests and
//! single-node deployments (a volume shared by every executor and gateway).
//!
//! A write goes to a temporary file in the key's directory, is fsynced, renamed over the
//! key and the directories up to the root are fsynced: a reader (or a crash) sees the
//! previous value or the whole new one. Keys are checked ([`crate::check_key`]) and the
//! key's directory, once created, must still resolve inside the root (no symlink leads
//! out).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use futures::future::BoxFuture;
use futures::FutureExt as _;

use crate::{check_key, BlobStore, Error};

#[derive(Debug)]
pub struct FsStore {
    root: PathBuf,
}

impl FsStore {
    /// A store rooted at `root` (created if missing).
    pub fn open(root: impl AsRef<Path>) -> Result<FsStore, Error> {
        let root = root.as_ref();
        if root.as_os_str().is_empty() {
            return Err(Error::Config("the blob directory is empty".into()));
        }
        std::fs::create_dir_all(root)
            .and_then(|()| root.canonicalize())
            .map(|root| FsStore { root })
            .map_err(|e| Error::Config(format!("blob directory {}: {e}", root.display())))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file of `key` (checked).
    pub fn path_of(&self, key: &str) -> Result<PathBuf, Error> {
        check_key(key)?;
        Ok(self.root.join(key))
    }

    fn put_blocking(&self, key: &str, bytes: &[u8]) -> Result<(), Error> {
        self.write_blocking(key, bytes, false, true)
    }

    /// Creates every key that is not there yet, then makes them all durable at once with
    /// one `syncfs` — a group commit: N new keys cost one journal flush, not 3N fsyncs.
    fn put_new_many_blocking(&self, items: &[(String, Vec<u8>)]) -> Vec<Result<(), Error>> {
        let mut results: Vec<Result<(), Error>> = items
            .iter()
            .map(|(key, bytes)| self.write_blocking(key, bytes, true, false))
            .collect();
        if results.iter().any(Result::is_ok) {
            let synced = std::fs::File::open(&self.root)
                .map_err(|e| e.to_string())
                .and_then(|root| rustix::fs::syncfs(&root).map_err(|e| e.to_string()));
            if let Err(e) = synced {
                let problem = format!("syncing {}: {e}", self.root.display());
                for result in &mut results {
                    if result.is_ok() {
                        *result = Err(Error::Unavailable(problem.clone()));
                    }
                }
            }
        }
        results
    }

    /// Writes `bytes` to a temporary file, then renames it over the key (`new`: links it
    /// to the key, which fails if the key exists — an atomic create-if-absent). `sync`:
    /// durable on return (else the caller syncs).
    fn write_blocking(&self, key: &str, bytes: &[u8], new: bool, sync: bool) -> Result<(), Error> {
        static TEMP: AtomicU64 = AtomicU64::new(0);
        let path = self.path_of(key)?;
        let io = |what: &str, e: std::io::Error| {
            Error::Unavailable(format!("{what} {}: {e}", path.display()))
        };
        let dir = path.parent().unwrap_or(&self.root).to_path_buf();
        std::fs::create_dir_all(&dir).map_err(|e| io("creating the directory of", e))?;
        let real = dir
            .canonicalize()
            .map_err(|e| io("resolving the directory of", e))?;
        if !real.starts_with(&self.root) {
            return Err(Error::InvalidKey {
                key: key.to_owned(),
                problem: "its directory resolves outside the store".into(),
            });
        }
        let temp = dir.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            TEMP.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| {
            let mut file = std::fs::File::create(&temp)?;
            file.write_all(bytes)?;
            if sync {
                file.sync_all()?;
            }
            if new {
                let linked = std::fs::hard_link(&temp, &path);
                let _ = std::fs::remove_file(&temp);
                linked
            } else {
                std::fs::rename(&temp, &path)
            }
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(&temp);
            if new && e.kind() == std::io::ErrorKind::AlreadyExists {
                return Err(Error::Exists(key.to_owned()));
            }
            return Err(io("writing", e));
        }
        if !sync {
            return Ok(());
        }
        // The rename (and any directory just created) is durable once its directories are.
        let mut sync = Some(dir.as_path());
        while let Some(d) = sync {
            std::fs::File::open(d)
                .and_then(|f| f.sync_all())
                .map_err(|e| io("syncing the directory of", e))?;
            sync = d.parent().filter(|p| p.starts_with(&self.root));
        }
        Ok(())
    }

    fn get_blocking(&self, key: &str) -> Result<Vec<u8>, Error> {
        let path = self.path_of(key)?;
        match std::fs::read(&path) {
            Ok(bytes) => Ok(bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(Error::NotFound(key.to_owned()))
            }
            Err(e) => Err(Error::Unavailable(format!(
                "reading {}: {e}",
                path.display()
            ))),
        }
    }

    fn delete_blocking(&self, prefix: &str) -> Result<u64, Error> {
        let path = self.path_of(prefix)?;
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(Error::Unavailable(format!("{}: {e}", path.display()))),
        };
        let fail =
            |e: std::io::Error| Error::Unavailable(format!("deleting {}: {e}", path.display()));
        if meta.is_dir() {
            let count = count_files(&path).map_err(fail)?;
            std::fs::remove_dir_all(&path).map_err(fail)?;
            Ok(count)
        } else {
            std::fs::remove_file(&path).map_err(fail)?;
            Ok(1)
        }
    }
}

fn count_files(dir: &Path) -> std::io::Result<u64> {
    let mut count = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            count += count_files(&entry.path())?;
        } else if !entry.file_name().to_string_lossy().starts_with(".tmp-") {
            count += 1;
        }
    }
    Ok(count)
}

/// Runs blocking file work off the async threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::Unavailable(format!("the file task failed: {e}")))?
}

impl BlobStore for FsStore {
    fn put<'a>(&'a self, key: &'a str, bytes: Vec<u8>) -> BoxFuture<'a, Result<(), Error>> {
        let store = FsStore {
            root: self.root.clone(),
        };
        let key = key.to_owned();
        blocking(move || store.put_blocking(&key, &bytes)).boxed()
    }

    fn put_new<'a>(&'a self, key: &'a str, bytes: Vec<u8>) -> BoxFuture<'a, Result<(), Error>> {
        let store = FsStore {
            root: self.root.clone(),
        };
        let key = key.to_owned();
        blocking(move || store.write_blocking(&key, &bytes, true, true)).boxed()
    }

    fn put_new_many<'a>(
        &'a self,
        items: Vec<(String, Vec<u8>)>,
    ) -> BoxFuture<'a, Vec<Result<(), Error>>> {
        let store = FsStore {
            root: self.root.clone(),
        };
        let count = items.len();
        async move {
            tokio::task::spawn_blocking(move || store.put_new_many_blocking(&items))
                .await
                .unwrap_or_else(|e| {
                    (0..count)
                        .map(|_| Err(Error::Unavailable(format!("the file task failed: {e}"))))
                        .collect()
                })
        }
        .boxed()
    }

    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Vec<u8>, Error>> {
        let store = FsStore {
            root: self.root.clone(),
        };
        let key = key.to_owned();
        blocking(move || store.get_blocking(&key)).boxed()
    }

    fn exists<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool, Error>> {
        async move {
            let path = self.path_of(key)?;
            match tokio::fs::metadata(&path).await {
                Ok(meta) => Ok(meta.is_file()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
                Err(e) => Err(Error::Unavailable(format!("{}: {e}", path.display()))),
            }
        }
        .boxed()
    }

    fn delete_prefix<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<u64, Error>> {
        let store = FsStore {
            root: self.root.clone(),
        };
        let prefix = prefix.to_owned();
        blocking(move || store.delete_blocking(&prefix)).boxed()
    }

    fn location(&self) -> String {
        format!("file://{}", self.root.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, FsStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = FsStore::open(dir.path().join("root")).expect("store");
        (dir, store)
    }

    #[tokio::test]
    async fn put_get_exists_and_delete_by_prefix() {
        let (_dir, store) = store();
        store.put("t/run_1/aa", b"one".to_vec()).await.expect("put");
        store.put("t/run_1/bb", b"two".to_vec()).await.expect("put");
        store
            .put("t/run_10/aa", b"ten".to_vec())
            .await
            .expect("put");
        assert_eq!(store.get("t/run_1/aa").await.expect("get"), b"one");
        assert!(store.exists("t/run_1/bb").await.expect("exists"));
        assert!(!store.exists("t/run_1/cc").await.expect("exists"));
        assert!(matches!(
            store.get("t/run_1/cc").await,
            Err(Error::NotFound(_))
        ));
        // Overwrite is atomic and leaves no temporary file behind.
        store.put("t/run_1/aa", b"uno".to_vec()).await.expect("put");
        assert_eq!(store.get("t/run_1/aa").await.expect("get"), b"uno");
        let names: Vec<_> = std::fs::read_dir(store.root().join("t/run_1"))
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with(".tmp-")), "{names:?}");
        // Whole segments: run_1 does not take run_10 with it.
        assert_eq!(store.delete_prefix("t/run_1").await.expect("delete"), 2);
        assert!(!store.exists("t/run_1/aa").await.expect("exists"));
        assert_eq!(store.get("t/run_10/aa").await.expect("get"), b"ten");
        assert_eq!(store.delete_prefix("t/run_1").await.expect("delete"), 0);
    }

    #[tokio::test]
    async fn keys_never_leave_the_root() {
        let (dir, store) = store();
        for bad in ["../escape", "/tmp/escape", "a/../../escape", "a\0b"] {
            assert!(
                matches!(
                    store.put(bad, b"x".to_vec()).await,
                    Err(Error::InvalidKey { .. })
                ),
                "{bad:?}"
            );
            assert!(store.get(bad).await.is_err());
            assert!(store.delete_prefix(bad).await.is_err());
        }
        assert!(!dir.path().join("escape").exists());
        // A symlink planted inside the root does not lead a write out of it.
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&outside).expect("dir");
        std::os::unix::fs::symlink(&outside, store.root().join("link")).expect("symlink");
        assert!(matches!(
            store.put("link/x", b"x".to_vec()).await,
            Err(Error::InvalidKey { .. })
        ));
        assert!(!outside.join("x").exists());
    }

    #[tokio::test]
    async fn a_failed_write_is_unavailable_and_leaves_the_old_value() {
        let (_dir, store) = store();
        store.put("t/r/aa", b"old".to_vec()).await.expect("put");
        // A directory where the next key's file would go: the rename cannot replace it.
        std::fs::create_dir_all(store.root().join("t/r/bb")).expect("dir");
        assert!(matches!(
            store.put("t/r/bb", b"new".to_vec()).await,
            Err(Error::Unavailable(_))
        ));
        assert_eq!(store.get("t/r/aa").await.expect("get"), b"old");
        let leftovers = std::fs::read_dir(store.root().join("t/r"))
            .expect("dir")
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            })
            .count();
        assert_eq!(leftovers, 0);
    }
}
