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
//! writing a record of its own, and is exactly what was committed. The window is in the
//! broker's time, like every record time it is compared with (ADR 0003): it ends at the
//! append time of the last command committed on the partition, never at the reducer's
//! clock, so a reducer whose clock runs ahead still reads back every id a copy could
//! pass with, and one whose clock runs behind reads no more than the window. While the partition is
//! owned, what a batch remembers is staged in the batch and kept only once its
//! transaction commits (an aborted batch's inputs are read again and must not meet their
//! own ids). Memory is bounded: entries leave when their window closes, and past
//! [`MAX_REMEMBERED`] per partition the oldest go and the partition's **floor** rises to
//! their `issued_at`: a signed command issued at or before the floor is refused as
//! outside the window (fail closed). A read-back that cannot finish sets the floor, for
//! the same reason, to the last committed command's append time plus the skew (the latest
//! `issued_at` the window can hold), or — when even that could not be read — to the
//! reducer's own clock plus the skew.

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

    /// Remembers what a read-back found, as the partition's batches remembered it then.
    fn remember_read_back(&mut self, found: Vec<Remembered>) {
        for r in found {
            if self
                .window_refusal(r.partition, r.issued_at, r.at)
                .is_none()
            {
                self.remember(r.partition, r.key, r.issued_at, r.at);
            }
        }
    }
}

/// The broker time a partition's read-back starts at: a window and the skew before
/// `last_append`, the append time of the last command committed on it. An id whose
/// command was appended earlier was issued at most `skew` after that, so it is outside
/// the window of every command appended after `last_append` — no copy of it can pass.
fn read_back_from(last_append: i64, window: Window) -> i64 {
    last_append
        .saturating_sub(window.before_ms)
        .saturating_sub(window.skew_ms)
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
        let mut last_appends = BTreeMap::new();
        match self.read_back(partitions, committed, window, &mut last_appends) {
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
                    "The replay window could not be read back; signed commands issued before its end are refused on these partitions."
                );
                let clock = sortie_kafka::clock::now_ms();
                for partition in partitions {
                    let end = last_appends.get(partition).copied().unwrap_or(clock);
                    self.replays
                        .set_floor(*partition, end.saturating_add(window.skew_ms));
                }
            }
        }
    }

    /// Reads the window back; `last_appends` gets each partition's broker time as soon as
    /// it is known (the floor of a read-back that fails later uses it).
    fn read_back(
        &mut self,
        partitions: &BTreeSet<i32>,
        committed: &TopicPartitionList,
        window: Window,
        last_appends: &mut BTreeMap<i32, i64>,
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
        let deadline = Instant::now() + READ_BACK;
        *last_appends = last_appended(&consumer, &topic, &ends, deadline)?;
        let mut times = TopicPartitionList::new();
        for (partition, last_append) in last_appends.iter() {
            times
                .add_partition_offset(
                    &topic,
                    *partition,
                    Offset::Offset(read_back_from(*last_append, window)),
                )
                .map_err(|e| e.to_string())?;
        }
        if times.count() == 0 {
            return Ok(0); // no command below any end: nothing to remember
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
        sortie_kafka::read::to_end(&consumer, &topic, &spans, deadline, |message| {
            let Ok(command) = self.runtime.block_on(
                self.codec
                    .decode_patiently::<w::RunCommand>(message.payload(), None),
            ) else {
                // Dead-lettered when it was read: nothing was remembered of it.
                return Ok::<_, String>(sortie_kafka::read::Next::More);
            };
            let canonical =
                partition_for(command.run_id.as_bytes(), partition_count) == message.partition();
            let keyed = message.key() == Some(command.run_id.as_bytes());
            let at = message
                .timestamp()
                .to_millis()
                .unwrap_or(last_appends[&message.partition()]);
            if canonical && keyed {
                if let crate::keyring::Verdict::Signed = self.keys.verdict(message, &command) {
                    found.push(Remembered {
                        partition: message.partition(),
                        key: (command.tenant, command.run_id, command.command_id),
                        issued_at: command.issued_at,
                        at,
                    });
                }
            }
            Ok(sortie_kafka::read::Next::More)
        })
        .map_err(|e| e.to_string())?;
        let read = found.len();
        self.replays.remember_read_back(found);
        Ok(read)
    }
}

/// The broker's time on each partition: the append time of the last command committed
/// below its end (`ends`, the committed offsets). Read backwards from the end, sixteen
/// times further each time a span holds only transaction markers or aborted records; a
/// partition with no command below its end (or none left by retention) has none.
fn last_appended(
    consumer: &BaseConsumer,
    topic: &str,
    ends: &BTreeMap<i32, i64>,
    deadline: Instant,
) -> Result<BTreeMap<i32, i64>, String> {
    let mut found = BTreeMap::new();
    let mut left = BTreeMap::new();
    for (&partition, &end) in ends {
        let (low, _) = consumer
            .fetch_watermarks(topic, partition, Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        if low < end {
            left.insert(partition, (low, end));
        }
    }
    let mut back = 1i64;
    while !left.is_empty() {
        let spans: BTreeMap<i32, (i64, i64)> = left
            .iter()
            .map(|(&p, &(low, end))| (p, (end.saturating_sub(back).max(low), end)))
            .collect();
        let mut assignment = TopicPartitionList::new();
        for (&partition, &(from, _)) in &spans {
            assignment
                .add_partition_offset(topic, partition, Offset::Offset(from))
                .map_err(|e| e.to_string())?;
        }
        consumer.assign(&assignment).map_err(|e| e.to_string())?;
        sortie_kafka::read::to_end(consumer, topic, &spans, deadline, |message| {
            if let Some(at) = message.timestamp().to_millis() {
                let last = found.entry(message.partition()).or_insert(at);
                *last = (*last).max(at);
            }
            Ok::<_, String>(sortie_kafka::read::Next::More)
        })
        .map_err(|e| e.to_string())?;
        left.retain(|p, &mut (low, end)| !found.contains_key(p) && end.saturating_sub(back) > low);
        back = back.saturating_mul(16);
    }
    Ok(found)
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

    /// The broker's time here is about 10^6 ms after the epoch, so the reducer's clock
    /// (today's date) is decades ahead of it — as a skewed clock could be by minutes. The
    /// read-back starts a window and the skew before the last committed command's
    /// append time (`offsetsForTimes` is simulated: the first record at or after it), and
    /// every command a copy of which could still pass the window is remembered, so the
    /// copy is refused `replayed`. Seen red with the start taken from the reducer's clock
    /// (`now_ms()` in place of the last append time): nothing was remembered.
    #[test]
    fn the_read_back_window_is_in_broker_time_whatever_the_reducers_clock() {
        let window = Window {
            before_ms: 300_000,
            skew_ms: 30_000,
        };
        // The partition's committed commands: (append time, issued_at, id).
        let log = [
            (600_000, 600_000, "long-gone"),
            // Appended just before the start (870_000), issued as far ahead as the skew
            // lets it: outside the window of anything appended from 1_200_000 on.
            (869_000, 899_000, "before-the-start"),
            (871_000, 900_500, "early-but-issued-late"),
            (1_000_000, 995_000, "inside"),
            (1_200_000, 1_200_000, "last"),
        ];
        let last_append = log.iter().map(|r| r.0).max().unwrap_or_default();
        let from = read_back_from(last_append, window);
        assert_eq!(from, 870_000);
        let found = log
            .iter()
            .filter(|r| r.0 >= from)
            .map(|&(at, issued_at, id)| Remembered {
                partition: 0,
                key: key(id),
                issued_at,
                at,
            })
            .collect();
        let mut replays = Replays::new(Some(window));
        replays.remember_read_back(found);
        for (_, issued_at, id) in log {
            // The earliest a copy can be appended is at the last append time.
            let passes_the_window = replays.window_refusal(0, issued_at, last_append).is_none();
            assert_eq!(replays.seen(0, &key(id)), passes_the_window, "{id}");
        }
        assert!(replays.seen(0, &key("early-but-issued-late")));
        assert!(!replays.seen(0, &key("before-the-start")));
    }

    #[test]
    fn without_a_keyring_nothing_is_remembered_or_refused() {
        let mut replays = Replays::new(None);
        replays.remember(0, key("a"), 0, 0);
        assert!(!replays.seen(0, &key("a")));
        assert!(replays.window_refusal(0, 0, i64::MAX).is_none());
    }
}
