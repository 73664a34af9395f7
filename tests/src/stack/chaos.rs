//! Seeded randomness and paced sending for the soak and rebalance tests.

#[allow(unused_imports)]
use super::*;

/// SplitMix64: small, seedable, good enough to draw a workload and a fault schedule.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// Uniform in `low..high` (milliseconds resolution).
    pub fn between(&mut self, low: Duration, high: Duration) -> Duration {
        let span = high.saturating_sub(low).as_millis() as u64;
        low + Duration::from_millis(self.below(span.max(1)))
    }
}

/// The seed in the environment variable `var`, else one from the clock. Tests print it
/// first so that `var=<seed>` replays the same workload and schedule.
pub fn seed_from_env(var: &str) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        })
}

/// A number from the environment variable `var`, else `default`.
pub fn env_number(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default)
}

impl Stack {
    /// Produces many commands at once (one producer, every delivery awaited), each keyed
    /// by its run id with the Java-compatible partitioner like [`Stack::send`].
    pub async fn send_many(&self, commands: &[w::RunCommand]) {
        let mut records = Vec::with_capacity(commands.len());
        for command in commands {
            let bytes = self
                .codec
                .encode(&self.topics.commands(), command)
                .await
                .expect("encode command");
            records.push((command.run_id.clone(), bytes));
        }
        crate::produce(&self.bootstrap, &self.topics.commands(), &records).await;
    }

    /// Produces `commands` one by one, evenly spread over `over` (one producer; every
    /// delivery awaited), so commands keep arriving while a test changes things around.
    pub async fn send_spread(&self, commands: &[w::RunCommand], over: Duration) {
        let gap = over / (commands.len().max(1) as u32);
        let groups: Vec<(Duration, &[w::RunCommand])> = commands
            .chunks(1)
            .enumerate()
            .map(|(i, one)| (gap * i as u32, one))
            .collect();
        self.send_timed(&groups).await;
    }

    /// Produces each group of commands at its offset from now (in order; a late group goes
    /// at once), with one producer, and awaits every delivery: bursts timed to land when
    /// a test changes something.
    pub async fn send_timed(&self, groups: &[(Duration, &[w::RunCommand])]) {
        let producer: FutureProducer = self.kafka.producer().create().expect("producer");
        let topic = self.topics.commands();
        let start = std::time::Instant::now();
        let mut deliveries = Vec::new();
        for (due, commands) in groups {
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                tokio::time::sleep(wait).await;
            }
            for command in *commands {
                let bytes = self
                    .codec
                    .encode(&topic, command)
                    .await
                    .expect("encode command");
                let record = FutureRecord::to(&topic)
                    .key(command.run_id.as_bytes())
                    .payload(&bytes);
                match producer.send_result(record) {
                    Ok(delivery) => deliveries.push(delivery),
                    Err((error, _)) => panic!("producing to {topic}: {error}"),
                }
            }
        }
        for delivery in deliveries {
            match delivery.await {
                Ok(Ok(_)) => {}
                Ok(Err((error, _))) => panic!("producing to {topic}: {error}"),
                Err(_) => panic!("producing to {topic}: the delivery was cancelled"),
            }
        }
    }

    /// Every `(queue, operation_id, attempt)` committed more than once on any intents
    /// topic, with how many times (read_committed). Empty: no executor can see an intent
    /// twice.
    pub async fn repeated_intents(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for queue in &self.queues {
            let mut seen: BTreeMap<(String, i32), usize> = BTreeMap::new();
            for intent in self.intents(queue).await {
                *seen
                    .entry((intent.operation_id, intent.attempt))
                    .or_default() += 1;
            }
            for ((op, attempt), n) in seen {
                if n > 1 {
                    problems.push(format!(
                        "intents.{queue}: {op} attempt {attempt} committed {n} times"
                    ));
                }
            }
        }
        problems
    }
}

impl Process {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it still runs (never blocks).
    pub fn is_running(&mut self) -> bool {
        self.try_exit().is_none()
    }
}

impl PrivateBroker {
    /// SIGKILL to the broker's JVM (its pid from `broker.pid` in the data dir, which
    /// `sortie_devkit::local` writes on start), no clean shutdown: what a machine crash
    /// looks like to the clients. Returns the pid it killed. The data stays;
    /// [`PrivateBroker::ensure_running`] restarts it on the same data (log recovery).
    pub async fn kill(&self) -> u32 {
        let broker = self.broker.clone();
        tokio::task::spawn_blocking(move || broker.kill())
            .await
            .expect("the kill task panicked")
            .unwrap_or_else(|e| panic!("killing the private broker: {e}"))
            .expect("the private broker was running")
    }
}
