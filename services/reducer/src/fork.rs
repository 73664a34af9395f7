//! A fork's source, read by the reducer itself (issue #36 item 1). A `StartRun{fork}`
//! names a source run and version; what the source's state was is never taken from the
//! command. The source must be on the fork's own partition, so this reducer holds the
//! source's current state — its own fold of the source's inputs, with the head of its
//! hash chain — and the state at the version is re-derived from the source's history the
//! command carries, held to that head (`sortie_core::decide::fork::verified_source`).
//! Anything else is refused `bad_fork` outside the run's history.
//!
//! Why the same partition: the reducer that applies the fork must know the source's
//! chain head without asking anyone — another partition's head is another reducer's and
//! may be on another machine; a head the command carried would be the command's claim
//! again. The gateway gives a fork a run id on its source's partition.

use sortie_core::{Command, CommandBody, RunState};
use sortie_seal::RunKeys;

use crate::driver::Error;
use crate::engine::Engine;

impl Engine {
    /// `command` with its fork's source state replaced by the one this reducer verified;
    /// `Ok(Err(reason))`: the fork is refused. A command that is not a fork, or whose run
    /// exists (the fold answers a repeated start), is returned as it is.
    pub(crate) fn verify_fork(
        &mut self,
        exists: bool,
        command: &Command,
    ) -> Result<Result<Command, String>, Error> {
        let CommandBody::StartRun {
            fork: Some(fork), ..
        } = &command.body
        else {
            return Ok(Ok(command.clone()));
        };
        if exists {
            return Ok(Ok(command.clone()));
        }
        let source_id = fork.run_id.clone();
        let unknown = || {
            format!(
                "no run {} of this tenant on this run's partition",
                sortie_core::limits::shown_id(&source_id)
            )
        };
        if source_id == command.run_id {
            return Ok(Err("a fork needs a run id of its own".into()));
        }
        let (here, there) = (
            self.partition_of(&command.run_id),
            self.partition_of(&source_id),
        );
        if here != there {
            return Ok(Err(format!(
                "run {} is on partition {there} and this run on {here}: a fork's run id must be on its source's partition",
                sortie_core::limits::shown_id(&source_id)
            )));
        }
        let Some(head) = self.peek_state(&source_id)? else {
            return Ok(Err(unknown()));
        };
        if head.tenant != command.tenant {
            // Said as for a run that does not exist: nothing of another tenant's run leaks.
            return Ok(Err(unknown()));
        }
        let seal = match self.seal_of_run(&head)? {
            Ok(seal) => seal,
            Err(reason) => return Ok(Err(format!("the source's key: {reason}"))),
        };
        match sortie_core::decide::fork::verified_source(&head, fork, &seal) {
            Ok(state) => {
                let mut verified = command.clone();
                if let CommandBody::StartRun {
                    fork: Some(fork), ..
                } = &mut verified.body
                {
                    fork.state = serde_json::to_value(&state)
                        .map_err(|e| Error::Setup(format!("a run state as JSON: {e}")))?;
                    fork.history = None;
                }
                Ok(Ok(verified))
            }
            Err(reason) => Ok(Err(reason)),
        }
    }

    /// The seal a run's records were written with (plain without sealing).
    fn seal_of_run(
        &mut self,
        run: &RunState,
    ) -> Result<Result<sortie_seal::RunSeal, String>, Error> {
        let Some(keys) = self.run_keys.clone() else {
            return Ok(Ok(sortie_seal::RunSeal::Plain));
        };
        Ok(self
            .lookup(&keys, &run.tenant, &run.run_id, false)?
            .map(|lookup| RunKeys::seal_of(&run.run_id, &lookup)))
    }
}
