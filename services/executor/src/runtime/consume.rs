//! Consumption and offset gating: one consumer thread per queue, its rebalance callbacks,
//! pausing a full queue, and the per-partition tracker that decides what may be committed.

use super::*;

/// "A commit covers your offset: call" (true) or "hand the intent back" (false).
type Waiter = oneshot::Sender<bool>;

pub(super) struct Assigned {
    /// Distinguishes this assignment from an earlier one of the same partition, so a task
    /// of a revoked assignment cannot mark offsets of a new one.
    pub(super) epoch: u64,
    pub(super) tracker: PartitionTracker<Waiter>,
    /// How many of the tracker's pending offsets are held (read, not yet running).
    pub(super) held: usize,
}

/// An intent read and held until its tenant gets a slot (`crate::fair`). Its offset is
/// tracked as pending: no commit passes it until it has run.
pub(super) struct Held {
    pub(super) message: OwnedMessage,
    pub(super) epoch: u64,
    pub(super) task: u64,
    pub(super) since: Instant,
}

impl Held {
    fn bytes(&self) -> usize {
        self.message.payload().map_or(0, <[u8]>::len) + self.message.key().map_or(0, <[u8]>::len)
    }
}

/// The tenant an intent's header names (the reducer writes it); an intent without one
/// (written before the header existed) shares the unnamed tenant's slots.
fn tenant_of(message: &OwnedMessage) -> String {
    message
        .headers()
        .and_then(|headers| {
            headers
                .iter()
                .find(|h| h.key == sortie_wire::TENANT_HEADER)
                .and_then(|h| h.value)
                .and_then(|v| std::str::from_utf8(v).ok())
                .map(str::to_owned)
        })
        .unwrap_or_default()
}

pub(super) struct QueueState {
    pub(super) partitions: HashMap<i32, Assigned>,
    /// Intents holding a slot: running, or taken back after a pre-call commit.
    pub(super) in_flight: usize,
    /// Intents read and not yet running, per tenant, and what each tenant runs.
    pub(super) fair: FairShare<Held>,
    pub(super) held_bytes: usize,
    /// A task waits for a commit: commit now, not at the next interval.
    pub(super) urgent: bool,
    /// Shutting down: revocation does not wait for in-flight intents.
    pub(super) closing: bool,
    pub(super) next_epoch: u64,
    /// Every task not yet ended (running, or waiting for its pre-call commit).
    pub(super) tasks: HashMap<u64, AbortHandle>,
}

impl QueueState {
    fn new(fair: FairShare<Held>) -> Self {
        Self {
            partitions: HashMap::new(),
            in_flight: 0,
            fair,
            held_bytes: 0,
            urgent: false,
            closing: false,
            next_epoch: 0,
            tasks: HashMap::new(),
        }
    }

    /// Drops the held intents of `partitions` (revoked: their new owner reads them
    /// again); they stay pending in their trackers until those are dropped too.
    fn drop_held(&mut self, partitions: impl Fn(i32) -> bool) {
        let mut bytes = 0;
        let mut by_partition: HashMap<i32, usize> = HashMap::new();
        self.fair.retain(|held| {
            let drop = partitions(held.message.partition());
            if drop {
                bytes += held.bytes();
                *by_partition.entry(held.message.partition()).or_default() += 1;
            }
            !drop
        });
        self.held_bytes = self.held_bytes.saturating_sub(bytes);
        for (partition, n) in by_partition {
            if let Some(assigned) = self.partitions.get_mut(&partition) {
                assigned.held = assigned.held.saturating_sub(n);
            }
        }
    }
}

/// The state of one queue's consumer, shared with its tasks and rebalance callbacks.
pub(super) struct Shared {
    pub(super) topic: String,
    pub(super) queue: String,
    pub(super) health: Health,
    pub(super) state: Mutex<QueueState>,
    pub(super) changed: Condvar,
    pub(super) drain_timeout: Duration,
    /// Ends the process when a commit or a pass of this queue's consumer thread blocks
    /// far past its bound (`sortie_kafka::watchdog`).
    pub(super) watchdog: Watchdog,
    /// Ends the process when the consumer stays outside a settled group (its coordinator
    /// answering) past `rejoin_timeout`: a member that polls on but never rejoins serves
    /// nothing, and says nothing.
    pub(super) membership: Watchdog,
    pub(super) rejoin_timeout: Duration,
    pub(super) commit_timeout: Duration,
    pub(super) fault: Option<FaultPoint>,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, QueueState> {
        // A poisoned lock means a panic while holding it; the state is still consistent
        // (every update is a single step), so carry on.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Commits every partition's committable position (or only those in `only`) and
    /// releases the waiters it covers. Runs on the consumer thread only, so no revocation
    /// can happen between choosing the positions and recording the commit.
    pub(super) fn commit<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        only: Option<&BTreeSet<i32>>,
    ) -> bool {
        let positions: Vec<(i32, i64)> = {
            let mut state = self.lock();
            state.urgent = false;
            state
                .partitions
                .iter()
                .filter(|(p, _)| only.is_none_or(|only| only.contains(p)))
                .filter_map(|(p, a)| a.tracker.to_commit().map(|pos| (*p, pos)))
                .collect()
        };
        if positions.is_empty() {
            return true;
        }
        let mut list = TopicPartitionList::new();
        for (partition, position) in &positions {
            if let Err(e) =
                list.add_partition_offset(&self.topic, *partition, Offset::Offset(*position))
            {
                tracing::warn!(error = %e, "Could not build the offset list.");
                return false;
            }
        }
        let committed = self.watchdog.bound("commit", self.commit_timeout, || {
            fault::hang_if(self.fault, FaultPoint::HangInCommit);
            consumer.commit(&list, CommitMode::Sync)
        });
        match committed {
            Ok(()) => {
                let mut state = self.lock();
                for (partition, position) in positions {
                    if let Some(assigned) = state.partitions.get_mut(&partition) {
                        for waiter in assigned.tracker.committed(position) {
                            let _ = waiter.send(true);
                        }
                    }
                }
                tracing::debug!(topic = %self.topic, ?list, "Offsets committed.");
                true
            }
            Err(e) => {
                tracing::warn!(topic = %self.topic, error = %e, "Committing offsets failed; will retry.");
                let mut state = self.lock();
                state.urgent = state.partitions.values().any(|a| a.tracker.has_waiters());
                false
            }
        }
    }

    /// Revocation: let the partitions' in-flight intents finish (committing as they do)
    /// for up to the drain timeout, commit, then drop the partitions and hand back
    /// whatever still waits for a pre-call commit.
    pub(super) fn revoke<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        revoked: &BTreeSet<i32>,
    ) {
        let deadline = Instant::now() + self.drain_timeout;
        loop {
            self.commit(consumer, Some(revoked));
            let state = self.lock();
            // Held intents are not waited for: they have not started, and stay uncommitted.
            let pending: usize = revoked
                .iter()
                .filter_map(|p| state.partitions.get(p))
                .map(|a| a.tracker.pending().saturating_sub(a.held))
                .sum();
            if pending == 0 || state.closing || Instant::now() >= deadline {
                if pending > 0 {
                    tracing::warn!(
                        pending,
                        "Giving up partitions with intents still running: their new owner will run them again."
                    );
                }
                break;
            }
            let _ = self.changed.wait_timeout(state, Duration::from_millis(20));
        }
        self.commit(consumer, Some(revoked));
        let mut state = self.lock();
        state.drop_held(|p| revoked.contains(&p));
        for partition in revoked {
            if let Some(mut assigned) = state.partitions.remove(partition) {
                for waiter in assigned.tracker.hand_back() {
                    let _ = waiter.send(false);
                }
            }
        }
    }
}

/// A task's claim on one offset. Dropping it (the task ended, or was aborted) frees its
/// slot; it does not mark the offset done.
pub(super) struct Ticket {
    pub(super) shared: Arc<Shared>,
    pub(super) partition: i32,
    pub(super) offset: i64,
    pub(super) epoch: u64,
    pub(super) task: u64,
    pub(super) tenant: Arc<str>,
    /// Whether the task holds a slot now: not while it waits for its pre-call commit.
    pub(super) holding: AtomicBool,
}

impl Ticket {
    /// The intent's work is done: its offset may be committed.
    pub(super) fn done(&self) {
        let mut state = self.shared.lock();
        if let Some(assigned) = state
            .partitions
            .get_mut(&self.partition)
            .filter(|a| a.epoch == self.epoch)
        {
            assigned.tracker.done(self.offset);
        }
        drop(state);
        self.shared.changed.notify_all();
    }

    /// Marks the offset committable before the call and waits for a commit to cover it.
    /// False: the partition was revoked (or the executor is stopping) first; do not call.
    ///
    /// The wait holds no slot: the commit may wait for a lower offset that is held for
    /// its tenant's turn, and that intent must be able to get a slot. Once covered, the
    /// call takes its slot back, over the limits if need be (it was admitted once).
    pub(super) async fn commit_first(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.shared.lock();
            let closing = state.closing;
            match state
                .partitions
                .get_mut(&self.partition)
                .filter(|a| a.epoch == self.epoch)
            {
                Some(assigned) if !closing => assigned.tracker.done_and_wait(self.offset, tx),
                _ => return false,
            }
            state.urgent = true;
            if self.holding.swap(false, Ordering::SeqCst) {
                state.in_flight = state.in_flight.saturating_sub(1);
                state.fair.finished(&self.tenant);
            }
        }
        self.shared.changed.notify_all();
        let go = rx.await.unwrap_or(false);
        if go {
            let mut state = self.shared.lock();
            if !self.holding.swap(true, Ordering::SeqCst) {
                state.in_flight += 1;
                state.fair.resume(&self.tenant);
            }
        }
        go
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        if self.holding.swap(false, Ordering::SeqCst) {
            state.in_flight = state.in_flight.saturating_sub(1);
            state.fair.finished(&self.tenant);
        }
        state.tasks.remove(&self.task);
        drop(state);
        self.shared.changed.notify_all();
    }
}

pub(super) struct QueueContext {
    pub(super) shared: Arc<Shared>,
}

impl ClientContext for QueueContext {
    fn stats(&self, statistics: rdkafka::Statistics) {
        sortie_kafka::metrics::consumer_lag(&statistics);
        self.shared
            .membership
            .watch_membership(&statistics, self.shared.rejoin_timeout);
    }
}

impl ConsumerContext for QueueContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let revoked: BTreeSet<i32> = list.elements().iter().map(|e| e.partition()).collect();
            tracing::info!(topic = %self.shared.topic, ?revoked, "Partitions revoked; draining them.");
            self.shared.revoke(consumer, &revoked);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(list) => {
                // librdkafka keeps a partition's pause across its revocation: one paused
                // while the queue was full and handed back (say during a broker outage)
                // would come back paused and never deliver again. New assignments start
                // resumed; the loop pauses them again on its next pass if still full.
                if let Err(e) = consumer.resume(list) {
                    tracing::warn!(topic = %self.shared.topic, error = %e, "Resuming newly assigned partitions failed.");
                }
                let mut state = self.shared.lock();
                for element in list.elements() {
                    state.next_epoch += 1;
                    let epoch = state.next_epoch;
                    state.partitions.insert(
                        element.partition(),
                        Assigned {
                            epoch,
                            tracker: PartitionTracker::default(),
                            held: 0,
                        },
                    );
                }
                let mut owned: Vec<i32> = state.partitions.keys().copied().collect();
                owned.sort_unstable();
                tracing::info!(topic = %self.shared.topic, ?owned, "Partitions assigned.");
                self.shared.health.consuming(&self.shared.queue, true);
            }
            Rebalance::Revoke(_) => {}
            Rebalance::Error(e) => tracing::warn!(error = %e, "Rebalance failed."),
        }
    }
}

/// One queue's consumer and its loop.
pub(super) struct QueueConsumer {
    pub(super) worker: Arc<Worker>,
    pub(super) shared: Arc<Shared>,
    pub(super) consumer: BaseConsumer<QueueContext>,
}

impl QueueConsumer {
    pub(super) fn new(worker: Arc<Worker>, queue: &str) -> Result<Self, Error> {
        let config = &worker.config;
        let topic = config.topics.intents(queue);
        let shared = Arc::new(Shared {
            topic: topic.clone(),
            queue: queue.to_owned(),
            health: worker.health.clone(),
            state: Mutex::new(QueueState::new(FairShare::new(
                &config.fair_share,
                config.max_in_flight,
            ))),
            changed: Condvar::new(),
            drain_timeout: config.drain_timeout,
            watchdog: Watchdog::start(config.stall_grace, "executor"),
            membership: Watchdog::start(config.stall_grace, "executor"),
            rejoin_timeout: config.kafka.rejoin_timeout(config.session_timeout),
            commit_timeout: config.commit_timeout(),
            fault: config.fault,
        });
        // Statistics feed QueueContext::stats (consumer lag per partition).
        let group = config.group_id(queue);
        let consumer_config = config
            .kafka
            .named(&format!("{group}-{}", config.executor_id))
            .group_member(
                &group,
                "cooperative-sticky",
                config.session_timeout,
                config
                    .static_membership
                    .then_some(config.executor_id.as_str()),
            );
        let consumer: BaseConsumer<QueueContext> =
            consumer_config.create_with_context(QueueContext {
                shared: shared.clone(),
            })?;
        partition_count(consumer.client(), &topic)?;
        consumer.subscribe(&[&topic])?;
        tracing::info!(%topic, %group, "Subscribed.");
        Ok(Self {
            worker,
            shared,
            consumer,
        })
    }

    pub(super) fn run(self, runtime: &Handle, stop: &AtomicBool) {
        let max = self.worker.config.max_in_flight;
        let max_held = self.worker.config.fair_share.held_cap(max);
        let interval = self.worker.config.commit_interval;
        let pass_timeout = self.worker.config.pass_timeout();
        let mut last_commit = Instant::now();
        let mut next_task = 0u64;
        let mut paused = false;
        let mut full_since: Option<Instant> = None;
        while !stop.load(Ordering::Relaxed) {
            self.admit(runtime, max);
            let (urgent, in_flight, full) = {
                let state = self.shared.lock();
                let full = state.fair.held() >= max_held
                    || state.held_bytes >= crate::fair::MAX_HELD_BYTES;
                meter::held(&self.shared.queue, state.fair.held());
                (state.urgent, state.in_flight, full)
            };
            meter::in_flight(&self.shared.queue, in_flight);
            if urgent || last_commit.elapsed() >= interval {
                self.shared.commit(&self.consumer, None);
                last_commit = Instant::now();
            }
            // Full (as many intents held as it may hold): wait for a slot without
            // polling — briefly. A queue that stays full (slow tools) pauses its
            // assignment and polls on: not polling at all would exceed
            // max.poll.interval.ms (the member would be kicked out with work in flight),
            // while paused partitions deliver nothing and rebalances are served. Not
            // paused at once: a resumed partition waits for the broker's next fetch (up
            // to fetch.wait.max.ms), which would throttle fast tools to a batch per fetch.
            // Paused again on every pass, so partitions assigned meanwhile are too.
            if !full {
                full_since = None;
                if paused {
                    self.set_paused(false);
                    paused = false;
                }
            } else if full_since.get_or_insert_with(Instant::now).elapsed() < PAUSE_WHEN_FULL_FOR {
                let state = self.shared.lock();
                if state.fair.held() >= max_held && !state.urgent {
                    let _ = self
                        .shared
                        .changed
                        .wait_timeout(state, Duration::from_millis(50));
                }
                continue;
            } else {
                self.set_paused(true);
                paused = true;
            }
            let timeout = if full {
                Duration::from_millis(20)
            } else if in_flight > 0 {
                Duration::from_millis(10)
            } else {
                Duration::from_millis(100)
            };
            // Only once it holds partitions: a member that left after joining. (The fault
            // is checked first: the loop's every pass goes through here.)
            if self.shared.fault == Some(FaultPoint::LeaveGroup)
                && !self.shared.lock().partitions.is_empty()
                && fault::leaves_group(self.shared.fault)
            {
                self.consumer.unsubscribe();
            }
            // The poll runs the rebalance callbacks (a revocation drains and commits).
            let polled = self
                .shared
                .watchdog
                .bound("poll", pass_timeout, || self.consumer.poll(timeout));
            match polled {
                None => {}
                Some(Err(e)) => {
                    tracing::warn!(topic = %self.shared.topic, error = %e, "Consumer error.")
                }
                Some(Ok(message)) => {
                    let message = message.detach();
                    next_task += 1;
                    self.hold(message, next_task);
                }
            }
        }
        self.drain();
    }

    /// Pauses (or resumes) every partition assigned now. A record fetched before a pause
    /// may still arrive: it is held (one over the bound) rather than skipped.
    pub(super) fn set_paused(&self, pause: bool) {
        let Ok(assignment) = self.consumer.assignment() else {
            return;
        };
        if assignment.count() == 0 {
            return;
        }
        let result = if pause {
            self.consumer.pause(&assignment)
        } else {
            self.consumer.resume(&assignment)
        };
        if let Err(e) = result {
            tracing::warn!(topic = %self.shared.topic, pause, error = %e, "Pausing or resuming the queue's partitions failed.");
        }
    }

    /// Holds one intent for its tenant's turn, its offset tracked from now on. A record
    /// of a partition this consumer does not own (it can only be a leftover of a revoked
    /// assignment) is left alone: not tracked, never committed, delivered again to the
    /// owner.
    pub(super) fn hold(&self, message: OwnedMessage, task: u64) {
        let mut state = self.shared.lock();
        let Some(assigned) = state.partitions.get_mut(&message.partition()) else {
            return;
        };
        assigned.tracker.track(message.offset());
        assigned.held += 1;
        let held = Held {
            epoch: assigned.epoch,
            task,
            since: Instant::now(),
            message,
        };
        meter::intent(&self.shared.queue);
        state.held_bytes += held.bytes();
        let tenant = tenant_of(&held.message);
        state.fair.hold(&tenant, held);
    }

    /// Gives free slots to held intents, tenant by tenant (`crate::fair`), each to a task.
    pub(super) fn admit(&self, runtime: &Handle, max: usize) {
        let mut state = self.shared.lock();
        while state.in_flight < max {
            let Some((tenant, held)) = state.fair.admit() else {
                return;
            };
            state.held_bytes = state.held_bytes.saturating_sub(held.bytes());
            let partition = held.message.partition();
            let current = match state.partitions.get_mut(&partition) {
                Some(assigned) if assigned.epoch == held.epoch => {
                    assigned.held = assigned.held.saturating_sub(1);
                    true
                }
                _ => false,
            };
            if !current {
                // Of an assignment since revoked: its new owner runs it.
                state.fair.finished(&tenant);
                continue;
            }
            meter::admitted(&self.shared.queue, held.since.elapsed());
            let ticket = Ticket {
                shared: self.shared.clone(),
                partition,
                offset: held.message.offset(),
                epoch: held.epoch,
                task: held.task,
                tenant,
                holding: AtomicBool::new(true),
            };
            state.in_flight += 1;
            let handle = runtime.spawn(self.worker.clone().process(ticket, held.message));
            state.tasks.insert(held.task, handle.abort_handle());
        }
    }

    /// Shutdown: finish in-flight intents (committing as they complete) for up to the
    /// drain timeout; hand back or abort the rest; commit; leave the group.
    pub(super) fn drain(self) {
        let deadline = Instant::now() + self.worker.config.drain_timeout;
        loop {
            self.shared.commit(&self.consumer, None);
            let state = self.shared.lock();
            if state.tasks.is_empty() || Instant::now() >= deadline {
                break;
            }
            let _ = self
                .shared
                .changed
                .wait_timeout(state, Duration::from_millis(20));
        }
        let aborted: Vec<AbortHandle> = {
            let mut state = self.shared.lock();
            state.closing = true;
            state.drop_held(|_| true);
            for assigned in state.partitions.values_mut() {
                for waiter in assigned.tracker.hand_back() {
                    let _ = waiter.send(false);
                }
            }
            state.tasks.drain().map(|(_, handle)| handle).collect()
        };
        if !aborted.is_empty() {
            tracing::warn!(
                intents = aborted.len(),
                topic = %self.shared.topic,
                "Handing back intents still running at shutdown: they will be delivered again."
            );
        }
        for handle in aborted {
            handle.abort();
        }
        self.shared.commit(&self.consumer, None);
        self.consumer.unsubscribe();
        // Dropping the consumer closes it: it leaves the group (unless static).
    }
}
