//! Signed commands cannot be replayed (issue #36 item 3).
//!
//! A signature vouches for a command's bytes, not for when they are used: a signed
//! command refused once (an unknown graph, a role its key lacked) leaves nothing in any
//! run, and could be produced again verbatim later, when it would pass, under the
//! signer's name. Two rules close that, for every command whose signature a key of the
//! keyring verified:
//!
//! - **A validity window inside the signed bytes.** `RunCommand.issued_at` is part of the
//!   value the signature covers; a command is refused (`outside_window`, outside the
//!   run's history) unless `record time − window ≤ issued_at ≤ record time + skew`, the
//!   record time being the broker's (`sortie.commands` is `LogAppendTime`). A copy
//!   produced after the window is dead on arrival.
//! - **Command ids remembered for that window**, per partition, keyed by (tenant, run id,
//!   command id) — refused ones included. A remembered command the run does not know
//!   (refused before the fold, answered outside the history, or a rejection the run no
//!   longer keeps) is refused `replayed`; one the run knows goes to the fold, which
//!   answers a command id once (an idempotent retry gets its first answer). Only verified
//!   commands are remembered: an unsigned or forged record cannot pre-claim someone
//!   else's command id.
//!
//! **Where the memory lives.** It is derived from the input itself: on assignment the
//! reducer reads each assigned commands partition from the first offset of the window
//! (`offsetsForTimes`) up to the committed offset and remembers what it would have
//! remembered then — so it survives a restart, a lost cache and a rebalance without
//! writing a record of its own, and is exactly what was committed. While the partition is
//! owned, what a batch remembers is staged in the batch and kept only once its
//! transaction commits (an aborted batch's inputs are read again and must not meet their
//! own ids). Memory is bounded: entries leave when their window closes, and past
//! [`MAX_REMEMBERED`] per partition the oldest go and the partition's **floor** rises to
//! their `issued_at`: a signed command issued at or before the floor is refused as
//! outside the window (fail closed). A read-back that cannot finish sets the floor to the
//! time of the assignment for the same reason.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use sortie_wire::partition_for;
use sortie_wire::records as w;

use crate::engine::Engine;

/// Most command ids remembered per partition (about 200 bytes each).
pub(crate) const MAX_REMEMBERED: usize = 100_000;
/// How long reading back one assignment's window may take.
const READ_BACK: Duration = Duration::from_secs(60);

/// Who a command is: its tenant, run and command id.
pub(crate) type CommandKey = (String, String, String);

/// The remembered command ids of the owned partitions.
#[derive(Debug, Default)]
pub(crate) struct Replays {
    /// `None`: no keyring, nothing is signed, nothing remembered.
    pub window: Option<Window>,
    partitions: HashMap<i32, Memory>,
}

/// How old (and how far in the future) a signed command's `issued_at` may be.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    pub before_ms: i64,
    pub skew_ms: i64,
}

#[derive(Debug, Default)]
struct Memory {
    ids: HashMap<CommandKey, i64>,
    by_time: BTreeSet<(i64, CommandKey)>,
    /// Signed commands issued at or before this are refused (ids evicted, or a read-back
    /// that did not finish).
    floor: i64,
}

impl Replays {
    pub fn new(window: Option<Window>) -> Self {
        Self {
            window,
            partitions: HashMap::new(),
        }
    }

    /// Why a signed command issued at `issued_at` and appended at `at` is outside its
    /// validity window on `partition`, if it is.
    pub fn window_refusal(&self, partition: i32, issued_at: i64, at: i64) -> Option<String> {
        let window = self.window?;
        if issued_at < at.saturating_sub(window.before_ms) {
            return Some(format!(
                "the command was issued {} ms before the broker took it; signed commands are valid for {} ms",
                at.saturating_sub(issued_at),
                window.before_ms
            ));
        }
        if issued_at > at.saturating_add(window.skew_ms) {
            return Some(format!(
                "the command claims to be issued {} ms after the broker took it (at most {} ms of clock skew)",
                issued_at.saturating_sub(at),
                window.skew_ms
            ));
        }
        let floor = self
            .partitions
            .get(&partition)
            .map_or(i64::MIN, |m| m.floor);
        (issued_at <= floor).then(|| {
            "the command was issued before what this reducer remembers of its partition's commands; send it again with a new issued_at".to_owned()
        })
    }

    /// Whether `key` was remembered on `partition`.
    pub fn seen(&self, partition: i32, key: &CommandKey) -> bool {
        self.partitions
            .get(&partition)
            .is_some_and(|m| m.ids.contains_key(key))
    }

    /// Remembers `key`, issued at `issued_at`, as of record time `at` (whose window
    /// drops what has closed).
    pub fn remember(&mut self, partition: i32, key: CommandKey, issued_at: i64, at: i64) {
        let Some(window) = self.window else { return };
        let memory = self.partitions.entry(partition).or_default();
        // An id whose own window has closed can never pass again: forget it.
        let closed = at.saturating_sub(window.before_ms);
        while let Some((oldest, _)) = memory.by_time.first() {
            if *oldest >= closed {
                break;
            }
            if let Some((_, key)) = memory.by_time.pop_first() {
                memory.ids.remove(&key);
            }
        }
        if let Some(previous) = memory.ids.insert(key.clone(), issued_at) {
            memory.by_time.remove(&(previous, key.clone()));
        }
        memory.by_time.insert((issued_at, key));
        while memory.ids.len() > MAX_REMEMBERED {
            let Some((oldest, key)) = memory.by_time.pop_first() else {
                break;
            };
            memory.ids.remove(&key);
            memory.floor = memory.floor.max(oldest);
        }
    }

    /// Forgets everything of the partitions given up.
    pub fn clear(&mut self) {
        self.partitions.clear();
    }

    fn set_floor(&mut self, partition: i32, floor: i64) {
        let memory = self.partitions.entry(partition).or_default();
        memory.floor = memory.floor.max(floor);
    }
}

/// A command the batch remembers once it commits.
#[derive(Debug, Clone)]
pub(crate) struct Remembered {
    pub partition: i32,
    pub key: CommandKey,
    pub issued_at: i64,
    pub at: i64,
}

impl Engine {
    /// Whether `key` was taken on `partition` already: committed, in the batch in flight
    /// or in the open batch.
    pub(crate) fn replayed(&self, partition: i32, key: &CommandKey) -> bool {
        let staged = |list: &[Remembered]| {
            list.iter()
                .any(|r| r.partition == partition && &r.key == key)
        };
        self.replays.seen(partition, key)
            || staged(&self.batch.remembered)
            || self
                .sending
                .as_ref()
                .is_some_and(|s| staged(&s.batch.remembered))
    }

    /// Reads back the window of each newly assigned commands partition up to its
    /// committed offset (`committed`: the consumer's committed offsets, every topic).
    pub(crate) fn read_back_commands(
        &mut self,
        partitions: &BTreeSet<i32>,
        committed: &TopicPartitionList,
    ) {
        let Some(window) = self.replays.window else {
            return;
        };
        let started = Instant::now();
        let now = sortie_kafka::clock::now_ms();
        match self.read_back(partitions, committed, window, now) {
            Ok(read) => tracing::info!(
                ?partitions,
                commands = read,
                took_ms = started.elapsed().as_millis() as u64,
                "Read back the signed commands of the replay window."
            ),
            Err(error) => {
                tracing::warn!(
                    ?partitions,
                    %error,
                    "The replay window could not be read back; signed commands issued before now are refused on these partitions."
                );
                for partition in partitions {
                    self.replays.set_floor(*partition, now);
                }
            }
        }
    }

    fn read_back(
        &mut self,
        partitions: &BTreeSet<i32>,
        committed: &TopicPartitionList,
        window: Window,
        now: i64,
    ) -> Result<usize, String> {
        let topic = self.config.topics.commands();
        let ends: BTreeMap<i32, i64> = committed
            .elements_for_topic(&topic)
            .iter()
            .filter(|e| partitions.contains(&e.partition()))
            .filter_map(|e| match e.offset() {
                Offset::Offset(next) => Some((e.partition(), next)),
                _ => None,
            })
            .collect();
        if ends.is_empty() {
            return Ok(0);
        }
        let consumer: BaseConsumer = self
            .config
            .kafka
            .named("replay-window")
            .client()
            .set(
                "group.id",
                format!("{}replay-window", self.config.topics.prefix()),
            )
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .create()
            .map_err(|e| e.to_string())?;
        let from = now
            .saturating_sub(window.before_ms)
            .saturating_sub(window.skew_ms);
        let mut times = TopicPartitionList::new();
        for partition in ends.keys() {
            times
                .add_partition_offset(&topic, *partition, Offset::Offset(from))
                .map_err(|e| e.to_string())?;
        }
        let starts = consumer
            .offsets_for_times(times, Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        let mut spans = BTreeMap::new();
        let mut assignment = TopicPartitionList::new();
        for element in starts.elements_for_topic(&topic) {
            let end = ends[&element.partition()];
            // No record at or after the window's start: nothing in it (the end).
            let start = match element.offset() {
                Offset::Offset(start) => start.min(end),
                _ => end,
            };
            if start < end {
                spans.insert(element.partition(), (start, end));
                assignment
                    .add_partition_offset(&topic, element.partition(), Offset::Offset(start))
                    .map_err(|e| e.to_string())?;
            }
        }
        if spans.is_empty() {
            return Ok(0);
        }
        consumer.assign(&assignment).map_err(|e| e.to_string())?;
        let mut found = Vec::new();
        let partition_count = self.partitions;
        sortie_kafka::read::to_end(
            &consumer,
            &topic,
            &spans,
            Instant::now() + READ_BACK,
            |message| {
                let Ok(command) = self.runtime.block_on(
                    self.codec
                        .decode_patiently::<w::RunCommand>(message.payload(), None),
                ) else {
                    // Dead-lettered when it was read: nothing was remembered of it.
                    return Ok::<_, String>(sortie_kafka::read::Next::More);
                };
                let canonical = partition_for(command.run_id.as_bytes(), partition_count)
                    == message.partition();
                let keyed = message.key() == Some(command.run_id.as_bytes());
                let at = message.timestamp().to_millis().unwrap_or(now);
                if canonical && keyed {
                    if let crate::keys::Verdict::Signed = self.keys.verdict(message, &command) {
                        found.push(Remembered {
                            partition: message.partition(),
                            key: (command.tenant, command.run_id, command.command_id),
                            issued_at: command.issued_at,
                            at,
                        });
                    }
                }
                Ok(sortie_kafka::read::Next::More)
            },
        )
        .map_err(|e| e.to_string())?;
        let read = found.len();
        for r in found {
            if self
                .replays
                .window_refusal(r.partition, r.issued_at, r.at)
                .is_none()
            {
                self.replays.remember(r.partition, r.key, r.issued_at, r.at);
            }
        }
        Ok(read)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> CommandKey {
        ("acme".into(), "run-1".into(), id.into())
    }

    #[test]
    fn the_window_and_the_floor_refuse_what_memory_cannot_vouch_for() {
        let mut replays = Replays::new(Some(Window {
            before_ms: 1_000,
            skew_ms: 100,
        }));
        assert!(replays.window_refusal(0, 9_000, 10_000).is_none());
        assert!(
            replays.window_refusal(0, 8_999, 10_000).is_some(),
            "too old"
        );
        assert!(replays.window_refusal(0, 10_100, 10_000).is_none());
        assert!(
            replays.window_refusal(0, 10_101, 10_000).is_some(),
            "from the future"
        );
        replays.remember(0, key("a"), 9_500, 10_000);
        assert!(replays.seen(0, &key("a")));
        assert!(!replays.seen(1, &key("a")), "per partition");
        // Its window closes: forgotten (a copy would be refused by the window anyway).
        replays.remember(0, key("b"), 11_000, 11_000);
        assert!(!replays.seen(0, &key("a")));
        assert!(replays.seen(0, &key("b")));
    }

    #[test]
    fn past_its_bound_memory_forgets_the_oldest_and_raises_the_floor() {
        let mut replays = Replays::new(Some(Window {
            before_ms: i64::MAX / 4,
            skew_ms: 0,
        }));
        for i in 0..=MAX_REMEMBERED as i64 {
            replays.remember(0, key(&i.to_string()), i, MAX_REMEMBERED as i64);
        }
        assert!(!replays.seen(0, &key("0")), "the oldest went");
        assert!(replays.seen(0, &key("1")));
        assert!(
            replays
                .window_refusal(0, 0, MAX_REMEMBERED as i64)
                .is_some(),
            "a command as old as what was forgotten is refused"
        );
        assert!(replays
            .window_refusal(0, 1, MAX_REMEMBERED as i64)
            .is_none());
    }

    #[test]
    fn without_a_keyring_nothing_is_remembered_or_refused() {
        let mut replays = Replays::new(None);
        replays.remember(0, key("a"), 0, 0);
        assert!(!replays.seen(0, &key("a")));
        assert!(replays.window_refusal(0, 0, i64::MAX).is_none());
    }
}
