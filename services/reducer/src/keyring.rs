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
use std::time::Duration;

use rdkafka::message::Headers;
use rdkafka::Message;
use sortie_wire::records as w;
use sortie_wire::signing::{Claim, Keyring, KeyringFile};

use crate::driver::Error;

/// How often the keyring file is looked at for a change.
const RECHECK: Duration = Duration::from_secs(2);

#[derive(Debug)]
pub(crate) struct Keys {
    file: Option<KeyringFile>,
    require: bool,
}

impl Keys {
    pub fn open(path: Option<PathBuf>, require: bool) -> Result<Self, Error> {
        if require && path.is_none() {
            return Err(Error::Setup(
                "signed commands are required but no keyring is given (--keyring)".into(),
            ));
        }
        let file = path
            .map(|path| KeyringFile::load(&path).map_err(|e| Error::Setup(e.to_string())))
            .transpose()?;
        if let Some(file) = &file {
            tracing::info!(path = %file.path().display(), keys = file.ring().len(), require, "Command keyring loaded.");
        }
        Ok(Self { file, require })
    }

    /// Which graph records the graph table takes: with a keyring, those its publisher
    /// keys sign (and, with `require`, no unsigned one); without, every one.
    pub fn graph_trust(&self) -> Option<sortie_catalog::Trust> {
        self.ring().map(|ring| sortie_catalog::Trust {
            keyring: ring.clone(),
            require: self.require,
        })
    }

    /// The keyring, when one is given.
    pub fn ring(&self) -> Option<&Keyring> {
        self.file.as_ref().map(KeyringFile::ring)
    }

    /// Re-reads the keyring when its file changed (looked at every [`RECHECK`] at most);
    /// true when it changed. A file that no longer loads keeps the last good keyring,
    /// loudly.
    pub fn refresh(&mut self) -> bool {
        let Some(file) = &mut self.file else {
            return false;
        };
        match file.refresh(RECHECK) {
            Ok(false) => false,
            Ok(true) => {
                tracing::info!(path = %file.path().display(), keys = file.ring().len(), "Command keyring changed; reloaded.");
                true
            }
            Err(e) => {
                tracing::warn!(path = %file.path().display(), error = %e, "The command keyring changed but does not load; keeping the last good one.");
                false
            }
        }
    }

    /// What the signature of `command` (decoded from `message`) says.
    pub fn verdict<M: Message>(&self, message: &M, command: &w::RunCommand) -> Verdict {
        // No keyring: nothing to check against, signatures are not read (so gateways can
        // start signing before the reducers get their keyring).
        let Some(ring) = self.ring() else {
            return Verdict::Unsigned;
        };
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
        match ring.check(pairs, message.payload().unwrap_or_default(), claim) {
            Ok(Some(_)) => Verdict::Signed,
            Ok(None) if self.require => Verdict::Refused(
                "the command is not signed, and this deployment requires signed commands".into(),
            ),
            Ok(None) => Verdict::Unsigned,
            Err(reason) => Verdict::Refused(reason),
        }
    }
}

/// What a command's signature says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A key of the keyring signed it and may sign what it claims.
    Signed,
    /// Not signed, and that is allowed (no keyring, or signatures not required).
    Unsigned,
    /// Why it is refused (`unauthenticated`).
    Refused(String),
}
