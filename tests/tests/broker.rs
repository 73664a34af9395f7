//! Proof, against the real broker, that Kafka gives what Sortie is built on: transactional
//! read-process-write with offsets committed in the transaction (and aborts that really
//! discard), log compaction down to the latest value per key, and a local broker that
//! restarts on its own data after a clean stop or a kill.

use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::{ClientConfig, ClientContext, Message, Offset, TopicPartitionList};
use sortie_devkit::local::{BrokerConfig, LocalBroker, Status};
use sortie_kafka::produce::PolledProducer;
use sortie_tests::{
    bootstrap, create_topic, key_value, produce, read_all, test_broker, unique_prefix, wait_for,
    wait_until, workspace_root, Isolation,
};

const BATCH: usize = 5;
const TXN_TIMEOUT: Duration = Duration::from_secs(10);

/// Counts delivery reports so a test can assert that every record of a transaction was
/// acknowledged before the commit.
#[derive(Debug, Default)]
struct Deliveries {
    ok: AtomicUsize,
    failed: Mutex<Vec<String>>,
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: Self::DeliveryOpaque) {
        match result {
            Ok(_) => {
                self.ok.fetch_add(1, Ordering::SeqCst);
            }
            Err((error, _)) => self
                .failed
                .lock()
                .expect("deliveries lock")
                .push(error.to_string()),
        }
    }
}

/// What the transactional loop consumed: (offset, key, value) of the input partition 0.
type Consumed = Vec<(i64, String, String)>;

fn poll_batch(consumer: &BaseConsumer, n: usize) -> Consumed {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut batch = Vec::new();
    while batch.len() < n {
        assert!(
            Instant::now() < deadline,
            "timed out consuming a batch of {n}"
        );
        if let Some(message) = consumer.poll(Duration::from_millis(200)) {
            let message = message.expect("consuming the input");
            let (key, value) = key_value(&message.detach());
            batch.push((message.offset(), key, value));
        }
    }
    batch
}

/// Sends the batch's outputs in the open transaction and waits until every one is
/// acknowledged (SPEC §13: an undelivered record at commit costs a 100 ms flush slice).
fn send_and_drain(producer: &BaseProducer<Deliveries>, output: &str, batch: &Consumed, tag: &str) {
    let before = producer.context().ok.load(Ordering::SeqCst);
    for (_, key, value) in batch {
        let payload = format!("{tag}:{value}");
        producer
            .send(BaseRecord::to(output).key(key).payload(&payload))
            .map_err(|(error, _)| error)
            .expect("queueing an output record");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while producer.in_flight_count() > 0 {
        assert!(Instant::now() < deadline, "timed out draining deliveries");
        producer.poll(Duration::from_millis(5));
    }
    let failed = producer.context().failed.lock().expect("deliveries lock");
    assert!(failed.is_empty(), "deliveries failed: {failed:?}");
    assert_eq!(
        producer.context().ok.load(Ordering::SeqCst) - before,
        batch.len()
    );
}

fn offsets_after(input: &str, batch: &Consumed) -> TopicPartitionList {
    let last = batch
        .iter()
        .map(|(offset, _, _)| *offset)
        .max()
        .expect("a batch");
    let mut offsets = TopicPartitionList::new();
    // Offsets sent are "last processed + 1".
    offsets
        .add_partition_offset(input, 0, Offset::Offset(last + 1))
        .expect("offsets");
    offsets
}

/// The read-process-write loop: one committed batch, then one aborted batch. Returns the
/// two batches it consumed.
fn run_transactions(
    bootstrap: &str,
    input: &str,
    output: &str,
    group: &str,
    txn_id: &str,
) -> (Consumed, Consumed) {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("auto.offset.reset", "earliest")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .create()
        .expect("consumer");
    consumer.subscribe(&[input]).expect("subscribe");
    let producer: BaseProducer<Deliveries> = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("transactional.id", txn_id)
        .set("partitioner", "murmur2_random")
        .set("transaction.timeout.ms", "10000")
        .set("linger.ms", "1")
        .create_with_context(Deliveries::default())
        .expect("transactional producer");
    producer
        .init_transactions(Duration::from_secs(30))
        .expect("init_transactions");

    let first = poll_batch(&consumer, BATCH);
    producer.begin_transaction().expect("begin 1");
    send_and_drain(&producer, output, &first, "committed");
    let group_metadata = consumer.group_metadata().expect("group metadata");
    producer
        .send_offsets_to_transaction(&offsets_after(input, &first), &group_metadata, TXN_TIMEOUT)
        .expect("send_offsets 1");
    let commit_started = Instant::now();
    producer.commit_transaction(TXN_TIMEOUT).expect("commit 1");
    eprintln!("commit_transaction took {:?}", commit_started.elapsed());

    let second = poll_batch(&consumer, BATCH);
    producer.begin_transaction().expect("begin 2");
    send_and_drain(&producer, output, &second, "aborted");
    let group_metadata = consumer.group_metadata().expect("group metadata");
    producer
        .send_offsets_to_transaction(&offsets_after(input, &second), &group_metadata, TXN_TIMEOUT)
        .expect("send_offsets 2");
    producer.abort_transaction(TXN_TIMEOUT).expect("abort 2");
    (first, second)
}

fn committed_offset(bootstrap: &str, group: &str, input: &str) -> Offset {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let mut partitions = TopicPartitionList::new();
    partitions.add_partition(input, 0);
    let committed = consumer
        .committed_offsets(partitions, Duration::from_secs(10))
        .expect("committed offsets");
    committed
        .find_partition(input, 0)
        .expect("the input partition")
        .offset()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_read_process_write_commits_and_aborts() {
    let bootstrap = bootstrap().await;
    let prefix = unique_prefix("txn");
    let input = format!("{prefix}in");
    let output = format!("{prefix}out");
    let group = format!("{prefix}group");
    let txn_id = format!("{prefix}txn");
    create_topic(&bootstrap, &input, 1, &[]).await;
    create_topic(&bootstrap, &output, 1, &[]).await;
    let inputs: Vec<(String, String)> = (0..2 * BATCH)
        .map(|i| (format!("run-{i}"), format!("input-{i}")))
        .collect();
    produce(&bootstrap, &input, &inputs).await;

    let (first, second) = {
        let (bootstrap, input, output, group) = (
            bootstrap.clone(),
            input.clone(),
            output.clone(),
            group.clone(),
        );
        tokio::task::spawn_blocking(move || {
            run_transactions(&bootstrap, &input, &output, &group, &txn_id)
        })
        .await
        .expect("the transactional loop panicked")
    };
    let expect = |batch: &Consumed, tag: &str| -> Vec<(String, String)> {
        batch
            .iter()
            .map(|(_, key, value)| (key.clone(), format!("{tag}:{value}")))
            .collect()
    };
    let committed = expect(&first, "committed");
    let aborted = expect(&second, "aborted");
    assert_eq!(
        first.iter().map(|c| c.0).collect::<Vec<_>>(),
        (0..BATCH as i64).collect::<Vec<_>>()
    );

    // A non-transactional record after the abort becomes visible to read_committed only
    // once the abort marker is written: then the aborted records were really skipped, not
    // merely hidden behind a still-open transaction.
    produce(&bootstrap, &output, &[("sentinel", "after-abort")]).await;
    let seen_committed = wait_for(
        "the sentinel under read_committed",
        Duration::from_secs(30),
        || {
            let (bootstrap, output) = (bootstrap.clone(), output.clone());
            async move {
                let records: Vec<_> = read_all(&bootstrap, &output, Isolation::ReadCommitted)
                    .await
                    .iter()
                    .map(key_value)
                    .collect();
                records
                    .iter()
                    .any(|(k, _)| k == "sentinel")
                    .then_some(records)
            }
        },
    )
    .await;
    let sentinel = ("sentinel".to_owned(), "after-abort".to_owned());
    let mut want = committed.clone();
    want.push(sentinel.clone());
    assert_eq!(
        seen_committed, want,
        "read_committed sees exactly the committed records"
    );

    let seen_uncommitted: Vec<_> = read_all(&bootstrap, &output, Isolation::ReadUncommitted)
        .await
        .iter()
        .map(key_value)
        .collect();
    let mut want = committed;
    want.extend(aborted);
    want.push(sentinel);
    assert_eq!(
        seen_uncommitted, want,
        "read_uncommitted also sees the aborted records"
    );

    let offset = tokio::task::spawn_blocking(move || committed_offset(&bootstrap, &group, &input))
        .await
        .expect("committed offset");
    assert_eq!(
        offset,
        Offset::Offset(BATCH as i64),
        "the group's offset is the committed batch's last + 1; the aborted one is discarded"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compaction_keeps_the_latest_value_per_key() {
    let bootstrap = bootstrap().await;
    let topic = format!("{}table", unique_prefix("compaction"));
    create_topic(
        &bootstrap,
        &topic,
        1,
        &[
            ("cleanup.policy", "compact"),
            ("segment.ms", "100"),
            ("min.cleanable.dirty.ratio", "0.01"),
            ("delete.retention.ms", "100"),
            ("min.compaction.lag.ms", "0"),
        ],
    )
    .await;
    let keys = 4;
    let rounds = 5;
    let records: Vec<(String, String)> = (0..rounds)
        .flat_map(|round| (0..keys).map(move |k| (format!("key-{k}"), format!("value-{round}"))))
        .collect();
    produce(&bootstrap, &topic, &records).await;
    let before = read_all(&bootstrap, &topic, Isolation::ReadUncommitted).await;
    assert_eq!(
        before.len(),
        keys * rounds,
        "all versions are there before compaction"
    );

    let latest: Vec<(String, String)> = (0..keys)
        .map(|k| (format!("key-{k}"), format!("value-{}", rounds - 1)))
        .collect();
    let filler = AtomicUsize::new(0);
    wait_until(
        "compaction down to one value per original key",
        Duration::from_secs(90),
        || {
            let (bootstrap, topic) = (bootstrap.clone(), topic.clone());
            let n = filler.fetch_add(1, Ordering::Relaxed);
            let latest = latest.clone();
            async move {
                // Segments roll only when a record arrives after segment.ms, and the cleaner
                // never touches the active segment: keep appending.
                produce(
                    &bootstrap,
                    &topic,
                    &[(format!("filler-{}", n % 3), format!("{n}"))],
                )
                .await;
                let originals: Vec<_> = read_all(&bootstrap, &topic, Isolation::ReadUncommitted)
                    .await
                    .iter()
                    .map(key_value)
                    .filter(|(k, _)| k.starts_with("key-"))
                    .collect();
                originals == latest
            }
        },
    )
    .await;
}

/// Stops a broker when the test ends, even by a panic, so no JVM outlives its temp dir.
#[derive(Debug)]
struct StopOnDrop(LocalBroker);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Err(error) = self.0.stop() {
            eprintln!("stopping the lifecycle broker: {error}");
        }
    }
}

/// `PolledProducer::serve` returns when a delivery report has come, not when its wait
/// runs out (rdkafka's `BaseProducer::poll` polls until its timeout, however early the
/// report): 40 rounds of one record, each waited for with a 20 s `serve`, must each end
/// well inside one such wait, and with the report. A lost wake-up (the event queue turned
/// non-empty while nobody looked, so no byte came) makes a round wait its whole 20 s.
/// Red-proofed: with `serve`'s wait replaced by `BaseProducer::poll(wait)` the first
/// round takes 20 s and the test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polled_producer_wakes_at_each_delivery_report() {
    let bootstrap = bootstrap().await;
    let topic = format!("{}wake", unique_prefix("wake"));
    create_topic(&bootstrap, &topic, 1, &[]).await;
    tokio::task::spawn_blocking(move || {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &bootstrap)
            .set("enable.idempotence", "true")
            .set("linger.ms", "0");
        let producer = PolledProducer::create(&config, Deliveries::default())
            .expect("creating the polled producer");
        let wait = Duration::from_secs(20);
        for round in 1..=40 {
            producer
                .send(BaseRecord::to(&topic).key("k").payload("v"))
                .map_err(|(error, _)| error)
                .expect("queueing a record");
            let started = Instant::now();
            while producer.context().ok.load(Ordering::SeqCst) < round {
                producer.serve(wait);
                let failed = producer.context().failed.lock().expect("deliveries lock");
                assert!(failed.is_empty(), "deliveries failed: {failed:?}");
                assert!(
                    started.elapsed() < wait / 2,
                    "round {round}: the report took {:?} to be served with a {wait:?} wait",
                    started.elapsed()
                );
            }
        }
    })
    .await
    .expect("the producer thread");
}

fn free_port_pair() -> (u16, u16) {
    let a = TcpListener::bind("127.0.0.1:0").expect("bind");
    let b = TcpListener::bind("127.0.0.1:0").expect("bind");
    (
        a.local_addr().expect("addr").port(),
        b.local_addr().expect("addr").port(),
    )
}

/// `stop()` then `ensure_running()` restarts on the same data (no reformat), and so does
/// `ensure_running()` after a SIGKILL left a stale pid file: what the crash tests rely on.
/// Uses its own broker (temp data dir, free ports) so the shared one stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_broker_restarts_on_its_own_data() {
    // Shares the test broker's jars (fetched under `<libs>.lock` by whoever comes first).
    let shared = test_broker();
    let data = tempfile::tempdir().expect("temp dir");
    let (port, controller_port) = free_port_pair();
    let mut config = BrokerConfig::new(
        data.path(),
        port,
        workspace_root().join("dev").join("kafka").join("pom.xml"),
    );
    config.controller_port = controller_port;
    config.libs_dir = Some(shared.libs_dir());
    let broker = LocalBroker::new(config);
    let _guard = StopOnDrop(broker.clone());

    let b = broker.clone();
    let outcome = tokio::task::spawn_blocking(move || -> sortie_devkit::local::Result<()> {
        let started = Instant::now();
        let first = b.ensure_running()?;
        eprintln!("cold start (format + start) took {:?}", started.elapsed());
        assert!(!first.reused);
        let started = Instant::now();
        let again = b.ensure_running()?;
        eprintln!("reuse took {:?}", started.elapsed());
        assert!(again.reused);
        assert_eq!(again.pid, first.pid);
        assert_eq!(b.status(), Status::Running { pid: first.pid });
        Ok(())
    })
    .await
    .expect("start");
    outcome.expect("first start");

    let bootstrap = broker.bootstrap();
    let topic = format!("{}durable", unique_prefix("lifecycle"));
    create_topic(&bootstrap, &topic, 1, &[]).await;
    produce(&bootstrap, &topic, &[("a", "1"), ("b", "2")]).await;
    let cluster_id =
        std::fs::read_to_string(data.path().join("logs/meta.properties")).expect("meta");

    let b = broker.clone();
    let restarted = tokio::task::spawn_blocking(move || -> sortie_devkit::local::Result<u32> {
        let pid = b.pid().expect("a pid");
        let started = Instant::now();
        assert_eq!(b.stop()?, Some(pid));
        eprintln!("stop took {:?}", started.elapsed());
        assert_eq!(b.status(), Status::Stopped);
        assert_eq!(b.stop()?, None, "stop is idempotent");
        let started = Instant::now();
        let running = b.ensure_running()?;
        eprintln!("warm restart took {:?}", started.elapsed());
        assert!(!running.reused);
        assert_ne!(running.pid, pid);
        Ok(running.pid)
    })
    .await
    .expect("restart")
    .expect("stop and restart");
    let read = |bootstrap: String, topic: String| async move {
        read_all(&bootstrap, &topic, Isolation::ReadUncommitted)
            .await
            .iter()
            .map(key_value)
            .collect::<Vec<_>>()
    };
    let want = vec![
        ("a".to_owned(), "1".to_owned()),
        ("b".to_owned(), "2".to_owned()),
    ];
    assert_eq!(
        read(bootstrap.clone(), topic.clone()).await,
        want,
        "data survives stop"
    );

    let b = broker.clone();
    tokio::task::spawn_blocking(move || -> sortie_devkit::local::Result<()> {
        assert_eq!(b.kill()?, Some(restarted));
        assert_eq!(b.status(), Status::Stopped);
        let started = Instant::now();
        let running = b.ensure_running()?;
        eprintln!("restart after SIGKILL took {:?}", started.elapsed());
        assert!(!running.reused, "a stale pid file means a restart");
        Ok(())
    })
    .await
    .expect("kill")
    .expect("kill and restart");
    assert_eq!(read(bootstrap, topic).await, want, "data survives SIGKILL");
    assert_eq!(
        std::fs::read_to_string(data.path().join("logs/meta.properties")).expect("meta"),
        cluster_id,
        "the storage was never reformatted"
    );
}
