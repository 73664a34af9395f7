//! How one record enters the view's store: a run event folded into its run, a changelog
//! state taken when it is further along, and a run that does not read or store set aside.

use std::sync::atomic::Ordering;

use sortie_core::{Event, EventBody};
use sortie_model as convert;
use sortie_wire::records as w;

use super::{Answer, Error, Position, View, BUFFERED};
use crate::store::{self, Quarantine, Source, Store, StoredRun, Write};

impl View {
    /// Folds a run-event in: stores it, moves the run's state on, answers a waiting write.
    pub(super) fn apply_event(
        &self,
        partition: i32,
        offset: i64,
        event: Option<Event>,
    ) -> Result<(), Error> {
        let next = (Source::RunEvents, partition, offset + 1);
        let answer = event.as_ref().and_then(|event| {
            let position = Position { partition, offset };
            let (command_id, accepted, duplicate, code, reason) = match &event.body {
                EventBody::CommandAccepted {
                    command_id,
                    duplicate,
                    ..
                } => (command_id, true, *duplicate, String::new(), String::new()),
                EventBody::CommandRejected {
                    command_id,
                    code,
                    reason,
                    ..
                } => (command_id, false, false, code.clone(), reason.clone()),
                // A decision on an interrupt not registered yet: the reducer keeps it (its
                // final answer comes when the interrupt opens). That is its answer now.
                EventBody::DecisionBuffered { interrupt_id, .. } => {
                    let command_id = event.command_id.as_ref()?;
                    let reason = format!("kept until interrupt {interrupt_id} opens");
                    (command_id, true, false, BUFFERED.to_owned(), reason)
                }
                _ => return None,
            };
            let answer = Answer {
                tenant: event.tenant.clone(),
                run_id: event.run_id.clone(),
                accepted,
                duplicate,
                code,
                reason,
                state_version: event.state_version,
                position,
            };
            Some((command_id.clone(), answer))
        });
        match event.filter(|e| e.seq > 0) {
            // seq 0 answers a command about a run that does not exist: not part of any
            // history.
            None => self.store.write(Write::offset(next))?,
            Some(event) => {
                let (tenant, run_id) = (event.tenant.clone(), event.run_id.clone());
                let folded = self.fold_event(next, event);
                self.quarantine_on(folded, next, &tenant, &run_id)?;
            }
        }
        self.publish(Source::RunEvents, partition, offset + 1, true);
        // The answer goes out whatever became of the run in the view: a quarantined run's
        // writer still hears what the reducer said.
        if let Some((command_id, answer)) = answer {
            self.answer(answer, &command_id);
        }
        Ok(())
    }

    fn fold_event(&self, next: (Source, i32, i64), event: Event) -> Result<(), store::Error> {
        if self.store.quarantined(&event.run_id)?.is_some() {
            return self.store.write(Write::offset(next));
        }
        let mut write = Write::offset(next);
        let before = self.store.run(&event.run_id)?;
        if let Some(after) = fold(&self.store, before.clone(), &event)? {
            write.run = Some((before, after));
        }
        write.events.push(event);
        self.store.write(write)
    }

    /// Takes a changelog record when it is further along than what the events gave.
    pub(super) fn apply_state(
        &self,
        partition: i32,
        offset: i64,
        record: Option<w::RunState>,
    ) -> Result<(), Error> {
        let next = (Source::RunState, partition, offset + 1);
        let decoded = record.and_then(|record| match convert::state_from_wire(&record) {
            Ok(state) => Some((record.tenant, record.version, state)),
            Err(error) => {
                tracing::warn!(partition, offset, %error, "Skipped a run-state record the view cannot read.");
                None
            }
        });
        match decoded {
            None => self.store.write(Write::offset(next))?,
            Some((tenant, version, state)) => {
                let run_id = state.run_id.clone();
                let taken = self.take_state(next, version, state);
                self.quarantine_on(taken, next, &tenant, &run_id)?;
            }
        }
        self.publish(Source::RunState, partition, offset + 1, true);
        Ok(())
    }

    fn take_state(
        &self,
        next: (Source, i32, i64),
        version: i64,
        state: sortie_core::RunState,
    ) -> Result<(), store::Error> {
        let mut write = Write::offset(next);
        if self.store.quarantined(&state.run_id)?.is_some() {
            return self.store.write(write);
        }
        let before = self.store.run(&state.run_id)?;
        let after = match &before {
            Some(b) if b.state.last_event_seq >= state.last_event_seq => StoredRun {
                state: b.state.clone(),
                changelog_version: b.changelog_version.max(version),
            },
            _ => StoredRun {
                changelog_version: before
                    .as_ref()
                    .map_or(version, |b| b.changelog_version.max(version)),
                state,
            },
        };
        if before.as_ref() != Some(&after) {
            write.run = Some((before, after));
        }
        self.store.write(write)
    }

    /// `applied` when it went through; when what failed was one run's own (a value that
    /// does not read back or cannot be stored), that run is set aside and the offset moves
    /// on all the same. Any other error is the store's as a whole.
    fn quarantine_on(
        &self,
        applied: Result<(), store::Error>,
        next: (Source, i32, i64),
        tenant: &str,
        run_id: &str,
    ) -> Result<(), Error> {
        match applied {
            Err(error) if error.run_scoped() => {
                self.set_aside(next, tenant, run_id, &error.to_string())
            }
            other => Ok(other?),
        }
    }

    /// Quarantines `run_id` (once: a run already set aside only moves the offset on).
    fn set_aside(
        &self,
        next: (Source, i32, i64),
        tenant: &str,
        run_id: &str,
        reason: &str,
    ) -> Result<(), Error> {
        let write = Write::offset(next);
        if matches!(self.store.quarantined(run_id), Ok(Some(_))) {
            return Ok(self.store.write(write)?);
        }
        let (source, partition, offset) = (next.0, next.1, next.2 - 1);
        let topic = match source {
            Source::RunState => "run-state",
            Source::RunEvents => "run-events",
        };
        let record = format!("{topic} p{partition}:o{offset}");
        let quarantine = Quarantine {
            run_id: run_id.to_owned(),
            tenant: tenant.to_owned(),
            reason: sortie_core::limits::clip(reason, 1024).to_owned(),
            at: sortie_kafka::clock::now_ms(),
            record: record.clone(),
        };
        self.store.write(Write {
            quarantine: Some(quarantine),
            ..write
        })?;
        let count = self.quarantined.fetch_add(1, Ordering::Relaxed) + 1;
        crate::metrics::quarantined_runs(count);
        tracing::error!(
            %run_id,
            %tenant,
            %record,
            %reason,
            "The view cannot read or store this run: it is quarantined (its reads answer run_unreadable) and the view goes on with every other run."
        );
        Ok(())
    }

    /// A run-event of `run_id` that does not convert: its run's history has a hole the
    /// view cannot fill, so the run is set aside rather than left behind in silence.
    pub(super) fn unreadable_event(
        &self,
        partition: i32,
        offset: i64,
        tenant: &str,
        run_id: &str,
        reason: &str,
    ) -> Result<(), Error> {
        let next = (Source::RunEvents, partition, offset + 1);
        self.set_aside(next, tenant, run_id, reason)?;
        self.publish(Source::RunEvents, partition, offset + 1, true);
        Ok(())
    }
}

/// The run after `event`, `None` when it changes nothing (already reflected, or a gap the
/// changelog will close).
fn fold(
    store: &Store,
    before: Option<StoredRun>,
    event: &Event,
) -> Result<Option<StoredRun>, store::Error> {
    let changelog_version = before.as_ref().map_or(0, |b| b.changelog_version);
    let mut state = before.map(|b| b.state);
    let last = state.as_ref().map_or(0, |s| s.last_event_seq);
    if event.seq <= last {
        return Ok(None);
    }
    for seq in last + 1..event.seq {
        match store.event(&event.run_id, seq)? {
            Some(earlier) => state = sortie_core::evolve(state, &earlier),
            None => return Ok(None),
        }
    }
    Ok(sortie_core::evolve(state, event).map(|state| StoredRun {
        state,
        changelog_version,
    }))
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    use tokio::sync::watch;

    use super::*;
    use crate::view::Progress;

    fn view(dir: &std::path::Path) -> View {
        View {
            store: Store::open(dir, "p.").expect("open"),
            progress: watch::channel(Progress::default()).0,
            waiters: Mutex::new(HashMap::new()),
            targets: (BTreeMap::new(), BTreeMap::new()),
            quarantined: AtomicUsize::new(0),
        }
    }

    /// Seen red: with TooDeep no longer run-scoped, the first quarantine stopped the view.
    #[test]
    fn one_runs_error_quarantines_it_and_only_the_stores_own_stops_the_view() {
        let dir = tempfile::tempdir().expect("tempdir");
        let view = view(dir.path());
        let next = (Source::RunEvents, 0, 8);
        let one_run = store::Error::TooDeep {
            key: "r/deep".into(),
            depth: 130,
        };
        view.quarantine_on(Err(one_run), next, "acme", "deep")
            .expect("the view goes on");
        assert_eq!(view.quarantined(), 1);
        let kept = view.store.quarantined("deep").expect("read").expect("kept");
        assert_eq!(
            (kept.tenant.as_str(), kept.record.as_str()),
            ("acme", "run-events p0:o7")
        );
        assert_eq!(
            view.store.offsets(Source::RunEvents).expect("offsets"),
            BTreeMap::from([(0, 8)]),
            "the offset moved on with it"
        );
        // Once: the same run again only moves the offset.
        let again = store::Error::TooDeep {
            key: "r/deep".into(),
            depth: 130,
        };
        view.quarantine_on(Err(again), (Source::RunEvents, 0, 9), "acme", "deep")
            .expect("the view goes on");
        assert_eq!(view.quarantined(), 1);

        let whole = store::Error::Sled(sled::Error::Unsupported("the disk is gone".into()));
        assert!(!whole.run_scoped());
        assert!(
            view.quarantine_on(Err(whole), (Source::RunEvents, 0, 10), "acme", "other")
                .is_err(),
            "the store as a whole stops the view"
        );
        assert_eq!(view.quarantined(), 1);
    }
}
