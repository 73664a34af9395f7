//! A producer polled by its own thread that wakes when an event arrives.
//!
//! The reducer (and the bench's ceiling) serve their transactional producer's delivery
//! reports on the thread that commits: with a background polling thread,
//! `commit_transaction`'s own flush raced that thread for the last reports. But
//! rdkafka's `BaseProducer::poll(timeout)` keeps polling until `timeout` has passed,
//! however early the reports came (rust-rdkafka #748), and its last millisecond spins:
//! librdkafka takes whole milliseconds and the remaining sub-millisecond becomes a 0 ms
//! poll, again and again. A reducer profile under full load had ~15 % of its CPU there,
//! and every wait for deliveries ended on a poll slice's boundary instead of at the last
//! report.
//!
//! [`PolledProducer::serve`] returns as soon as an event has been served: librdkafka
//! writes a byte to a socket when the producer's event queue turns non-empty
//! (`rd_kafka_queue_io_event_enable`), and the waiting thread blocks on that socket.

use std::io::{ErrorKind, Read};
use std::ops::Deref;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use rdkafka::bindings as rdsys;
use rdkafka::config::FromClientConfigAndContext;
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::producer::{BaseProducer, Producer, ProducerContext, PurgeConfig};
use rdkafka::ClientConfig;

/// A `BaseProducer` whose owner serves its events with [`PolledProducer::serve`].
/// Derefs to the `BaseProducer` for everything else.
pub struct PolledProducer<C: ProducerContext + 'static> {
    // Declared first, so dropped first: the wake-up is switched off and its queue handle
    // released while the client still exists, and only then are the sockets closed.
    wakeup: Wakeup,
    producer: BaseProducer<C>,
}

impl<C: ProducerContext + 'static> PolledProducer<C> {
    /// Creates the producer from `config` with `context`.
    pub fn create(config: &ClientConfig, context: C) -> KafkaResult<Self> {
        let producer = BaseProducer::from_config_and_context(config, context)?;
        let wakeup = Wakeup::attach(producer.client().native_ptr()).map_err(|e| {
            KafkaError::ClientCreation(format!("the producer's event wake-up: {e}"))
        })?;
        Ok(Self { wakeup, producer })
    }

    /// Serves every event waiting on the producer's queue (delivery reports, errors). If
    /// none was waiting, waits up to `wait` for one and serves what came. Returns once
    /// something was served or `wait` has passed, whichever is first.
    pub fn serve(&self, wait: Duration) {
        // Clear stale wake-ups before looking at the queue: an event that arrives after
        // this point either is seen by the drain below or, on an empty queue, writes a
        // new byte that ends the wait at once.
        self.wakeup.clear();
        if self.drain() || wait.is_zero() {
            return;
        }
        self.wakeup.wait(wait);
        self.drain();
    }

    /// Aborts the open transaction within `timeout`, serving the delivery reports of the
    /// records it throws away. librdkafka's `abort_transaction` waits until no record is
    /// outstanding, and with delivery reports on the event queue only the application
    /// serves them: called bare while a transaction's records were still queued, it
    /// waited out its whole timeout and failed ("the event queue must be polled"), and
    /// the caller had to rebuild its clients. So: purge what is still queued locally,
    /// serve reports until nothing is outstanding, then abort.
    pub fn abort_transaction(&self, timeout: Duration) -> KafkaResult<()> {
        let deadline = Instant::now() + timeout;
        self.producer.purge(PurgeConfig::default().queue());
        while self.producer.in_flight_count() > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            self.serve(left.min(Duration::from_millis(100)));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        self.producer
            .abort_transaction(left.max(Duration::from_millis(100)))
    }

    /// Serves the events on the queue until it is empty; whether there were any. Bounded,
    /// so that an op librdkafka would never hand out cannot hold the caller here: the
    /// wait then returns at once (the queue is not empty) and the caller's deadline
    /// decides.
    fn drain(&self) -> bool {
        let mut served = false;
        for _ in 0..DRAIN_BOUND {
            if self.wakeup.queued() == 0 {
                break;
            }
            // One event per call; its handler runs the context's callbacks.
            self.producer.poll(Duration::ZERO);
            served = true;
        }
        served
    }
}

impl<C: ProducerContext + 'static> Deref for PolledProducer<C> {
    type Target = BaseProducer<C>;

    fn deref(&self) -> &BaseProducer<C> {
        &self.producer
    }
}

impl<C: ProducerContext + 'static> std::fmt::Debug for PolledProducer<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolledProducer").finish_non_exhaustive()
    }
}

/// The producer's main event queue, with librdkafka writing a byte to `write` whenever
/// the queue turns non-empty.
struct Wakeup {
    queue: QueueHandle,
    read: UnixStream,
    _write: UnixStream,
}

/// A handle on a librdkafka queue (`rd_kafka_queue_t`).
struct QueueHandle(NonNull<rdsys::rd_kafka_queue_t>);

// SAFETY: librdkafka's queue handles may be used from any thread (every queue operation
// takes the queue's own lock); the handle is only read through librdkafka calls.
#[allow(unsafe_code)]
unsafe impl Send for QueueHandle {}
// SAFETY: as above; `queued` is the only call made through a shared reference.
#[allow(unsafe_code)]
unsafe impl Sync for QueueHandle {}

/// At most this many events are served per drain (one delivery report event carries
/// many records' reports).
const DRAIN_BOUND: usize = 100_000;

/// The byte librdkafka writes on a wake-up.
const WAKE: [u8; 1] = [1];

impl Wakeup {
    fn attach(client: *mut rdsys::rd_kafka_t) -> std::io::Result<Self> {
        let (read, write) = UnixStream::pair()?;
        // librdkafka requires a non-blocking descriptor (it must never block its threads).
        write.set_nonblocking(true)?;
        read.set_nonblocking(true)?;
        // SAFETY: `client` is a live client (the caller's producer, which outlives this
        // value: `PolledProducer` drops the wake-up first). The returned handle is owned
        // here and released in `Drop`.
        #[allow(unsafe_code)]
        let queue = unsafe { rdsys::rd_kafka_queue_get_main(client) };
        let queue = NonNull::new(queue)
            .map(QueueHandle)
            .ok_or_else(|| std::io::Error::other("the client has no main queue"))?;
        // SAFETY: the handle is live; librdkafka copies the payload; the descriptor stays
        // open until `Drop` has switched the wake-up off again.
        #[allow(unsafe_code)]
        unsafe {
            rdsys::rd_kafka_queue_io_event_enable(
                queue.0.as_ptr(),
                write.as_raw_fd(),
                WAKE.as_ptr().cast(),
                WAKE.len(),
            )
        };
        Ok(Self {
            queue,
            read,
            _write: write,
        })
    }

    /// How many events wait on the queue.
    fn queued(&self) -> usize {
        // SAFETY: the handle is live until `Drop`.
        #[allow(unsafe_code)]
        unsafe {
            rdsys::rd_kafka_queue_length(self.queue.0.as_ptr())
        }
    }

    /// Reads away the wake-ups written so far.
    fn clear(&self) {
        let mut buf = [0u8; 64];
        while let Ok(n) = (&self.read).read(&mut buf) {
            if n < buf.len() {
                break;
            }
        }
    }

    /// Blocks until a wake-up is written or `wait` has passed.
    fn wait(&self, wait: Duration) {
        let deadline = Instant::now() + wait;
        let mut buf = [0u8; 64];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.queued() > 0 {
                return;
            }
            // A read timeout needs a blocking descriptor; it goes back to non-blocking for
            // `clear`, on every path. Should a socket call fail, the wait ends early: the
            // caller's loop serves the queue and calls again.
            if self.read.set_read_timeout(Some(left)).is_err()
                || self.read.set_nonblocking(false).is_err()
            {
                let _ = self.read.set_nonblocking(true);
                return;
            }
            let read = (&self.read).read(&mut buf);
            let _ = self.read.set_nonblocking(true);
            match read {
                Ok(_) => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return, // timed out (WouldBlock / TimedOut)
            }
        }
    }
}

impl Drop for Wakeup {
    fn drop(&mut self) {
        // SAFETY: the handle is live. Switching the wake-up off takes the queue's lock,
        // which librdkafka holds while it writes a wake-up: after this call no thread
        // writes to the descriptor, which is closed when the streams drop after this.
        #[allow(unsafe_code)]
        unsafe {
            rdsys::rd_kafka_queue_io_event_enable(self.queue.0.as_ptr(), -1, std::ptr::null(), 0);
            rdsys::rd_kafka_queue_destroy(self.queue.0.as_ptr());
        }
    }
}
