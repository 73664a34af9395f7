//! The state the blocking phases share: the options, the broker and registry, the codec,
//! and how the bench starts its services (reducers, executors) and encodes its commands.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sortie_kafka::KafkaConfig;
use sortie_wire::{Codec, Topics};
use tokio::runtime::Handle;

use crate::load::{self, Driver};
use crate::stack::{self, Service};
use crate::Options;

/// What the blocking phases share.
#[derive(Debug, Clone)]
pub(crate) struct Bench {
    pub options: Options,
    pub prefix: String,
    pub kafka: KafkaConfig,
    pub registry_url: String,
    pub codec: Arc<Codec>,
    pub runtime: Handle,
    /// Logs and caches of this run.
    pub dir: PathBuf,
    /// `--seal-keyring … --seal-key-store …` for the reducers and executors, with `seal`.
    pub seal_args: Vec<String>,
}

impl Bench {
    fn common_args(&self, prefix: &str) -> Vec<String> {
        let mut args = vec![
            "--bootstrap-servers".into(),
            self.kafka.bootstrap_servers.clone(),
            "--registry-url".into(),
            self.registry_url.clone(),
            "--prefix".into(),
            prefix.to_owned(),
        ];
        if let Some(path) = &self.options.kafka_properties {
            args.extend(["--kafka-properties".into(), path.display().to_string()]);
        }
        args
    }

    /// Drives one run of `graph_id` (`run_id`) through `services` and teaches `driver`
    /// its events' pattern, which the driver then times every run by.
    pub(crate) fn calibrate(
        &self,
        driver: &mut Driver,
        topics: &Topics,
        graph_id: &str,
        run_id: &str,
        services: &mut [&mut Service],
    ) -> anyhow::Result<load::Pattern> {
        let calibration = self.encode_commands(topics, graph_id, &[run_id.to_owned()])?;
        driver.calibrate(
            &calibration[0].0,
            &calibration[0].1,
            Duration::from_secs(180),
            services,
        )
    }

    /// Creates the bench topics and publishes the echo graphs (the load's, and the
    /// one-step graph of `light_one_step`); returns the topic names.
    pub(crate) fn prepare(&self) -> anyhow::Result<Topics> {
        let options = &self.options;
        let topics = Topics::new(self.prefix.clone());
        let queues = stack::queues(options.queues);
        let graph = stack::graph(stack::GRAPH, options.steps, &queues)?;
        let one_step = stack::graph(stack::ONE_STEP_GRAPH, 1, &queues)?;
        self.runtime.block_on(async {
            stack::apply_topology(
                &self.kafka,
                &self.prefix,
                options.partitions,
                options.intent_partitions,
                &queues,
            )
            .await?;
            stack::publish_graph(&self.kafka, &self.codec, &topics, &graph).await?;
            stack::publish_graph(&self.kafka, &self.codec, &topics, &one_step).await
        })?;
        Ok(topics)
    }

    /// A load driver over `topics`, reporting progress as the options say.
    pub(crate) fn driver(&self, topics: &Topics) -> anyhow::Result<Driver> {
        let mut driver = Driver::new(
            &self.kafka,
            topics,
            self.options.partitions,
            self.codec.clone(),
            self.runtime.clone(),
        )?;
        driver.progress = self.options.progress;
        Ok(driver)
    }

    /// A `sortie reducer` process (debug logs of the reducer: commits and restores).
    pub fn reducer(
        &self,
        dir: &Path,
        name: &str,
        prefix: &str,
        data: &Path,
    ) -> anyhow::Result<Service> {
        self.reducer_with(dir, name, prefix, data, "0", &[])
    }

    /// [`Bench::reducer`] with its own instance id (and so transactional ids: one of
    /// several reducers sharing the partitions) and more arguments for `sortie reducer`.
    pub fn reducer_with(
        &self,
        dir: &Path,
        name: &str,
        prefix: &str,
        data: &Path,
        instance: &str,
        extra: &[&str],
    ) -> anyhow::Result<Service> {
        let mut args = vec!["reducer".to_owned()];
        args.extend(extra.iter().map(|arg| (*arg).to_owned()));
        args.extend(self.common_args(prefix));
        args.extend(self.seal_args.iter().cloned());
        args.extend([
            "--data-dir".to_owned(),
            data.display().to_string(),
            "--instance-id".to_owned(),
            instance.to_owned(),
            "--commit-interval-ms".to_owned(),
            self.options.commit_interval.as_millis().to_string(),
            "--max-batch".to_owned(),
            self.options.max_batch.to_string(),
        ]);
        let service = Service::spawn(
            &self.options.exe,
            dir,
            name,
            &args,
            "warn,sortie_reducer=debug",
        )?;
        eprintln!(
            "sortie bench: {name} pid {} (log {})",
            service.pid(),
            service.log.display()
        );
        Ok(service)
    }

    /// A `sortie executor` process serving every bench queue.
    pub fn executor(
        &self,
        dir: &Path,
        name: &str,
        prefix: &str,
        index: usize,
    ) -> anyhow::Result<Service> {
        let mut args = vec!["executor".to_owned()];
        args.extend(self.common_args(prefix));
        args.extend(self.seal_args.iter().cloned());
        args.extend([
            "--queue".to_owned(),
            stack::queues(self.options.queues).join(","),
            "--executor-id".to_owned(),
            format!("bench-executor-{index}"),
            "--max-in-flight".to_owned(),
            self.options.executor_max_in_flight.to_string(),
        ]);
        // Info from the consumer threads: "Partitions assigned." is how the roll knows a
        // restarted executor is ready.
        Service::spawn(
            &self.options.exe,
            dir,
            name,
            &args,
            "warn,sortie_executor::runtime=info",
        )
    }

    pub(crate) fn encode_commands(
        &self,
        topics: &Topics,
        graph_id: &str,
        ids: &[String],
    ) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
        ids.iter()
            .map(|run_id| {
                let bytes = self.runtime.block_on(Driver::start_command(
                    &self.codec,
                    topics,
                    run_id,
                    graph_id,
                    self.options.payload_bytes,
                ))?;
                Ok((run_id.clone(), bytes))
            })
            .collect()
    }
}
