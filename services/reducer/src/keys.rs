//! Who may write commands: the keyring the reducer checks command signatures against
//! (see `sortie_wire::signing` for the headers and what a key may sign), read from a file
//! and re-read when the file changes, so keys rotate without a restart.
//!
//! With a keyring, a command with signature headers is always checked — a present but
//! wrong signature is refused even where unsigned commands are still accepted. Without
//! one, signatures are not read at all (the rollout order: gateways sign, then reducers
//! get the keyring, then `--require-signatures`). An unsigned command is refused
//! only with `require_signatures` (production); without it (dev, old clients) it is taken
//! as before. A refused command is answered `CommandRejected{code: unauthenticated}`
//! outside the run's history and changes nothing (`sortie_core::refuse`).

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::Message;
use sortie_wire::records as w;
use sortie_wire::signing::{Claim, Keyring};

use crate::driver::Error;

/// How often the keyring file is looked at for a change.
const RECHECK: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub(crate) struct Keys {
    path: Option<PathBuf>,
    require: bool,
    ring: Keyring,
    modified: Option<SystemTime>,
    checked: Instant,
}

impl Keys {
    pub fn open(path: Option<PathBuf>, require: bool) -> Result<Self, Error> {
        if require && path.is_none() {
            return Err(Error::Setup(
                "signed commands are required but no keyring is given (--keyring)".into(),
            ));
        }
        let (ring, modified) = match &path {
            Some(path) => (
                Keyring::load(path).map_err(|e| Error::Setup(e.to_string()))?,
                modified(path),
            ),
            None => (Keyring::default(), None),
        };
        if let Some(path) = &path {
            tracing::info!(path = %path.display(), keys = ring.len(), require, "Command keyring loaded.");
        }
        Ok(Self {
            path,
            require,
            ring,
            modified,
            checked: Instant::now(),
        })
    }

    /// Re-reads the keyring when its file changed (looked at every [`RECHECK`] at most).
    /// A file that no longer loads keeps the last good keyring, loudly.
    pub fn refresh(&mut self) {
        let Some(path) = &self.path else { return };
        if self.checked.elapsed() < RECHECK {
            return;
        }
        self.checked = Instant::now();
        let now = modified(path);
        if now == self.modified {
            return;
        }
        match Keyring::load(path) {
            Ok(ring) => {
                tracing::info!(path = %path.display(), keys = ring.len(), "Command keyring changed; reloaded.");
                self.ring = ring;
                self.modified = now;
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "The command keyring changed but does not load; keeping the last good one.");
                self.modified = now;
            }
        }
    }

    /// Why `command` (decoded from `message`) is refused, if it is.
    pub fn refusal(&self, message: &OwnedMessage, command: &w::RunCommand) -> Option<String> {
        // No keyring: nothing to check against, signatures are not read (so gateways can
        // start signing before the reducers get their keyring).
        self.path.as_ref()?;
        let headers = message.headers();
        let pairs = headers
            .into_iter()
            .flat_map(|h| h.iter().map(|header| (header.key, header.value)));
        let claim = Claim {
            tenant: &command.tenant,
            principal: &command.issuer.principal,
            roles: &command.issuer.roles,
            groups: &command.issuer.groups,
        };
        match self
            .ring
            .check(pairs, message.payload().unwrap_or_default(), claim)
        {
            Ok(Some(_)) => None,
            Ok(None) if self.require => Some(
                "the command is not signed, and this deployment requires signed commands".into(),
            ),
            Ok(None) => None,
            Err(reason) => Some(reason),
        }
    }
}

fn modified(path: &std::path::Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}
