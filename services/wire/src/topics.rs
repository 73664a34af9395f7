/// Names of Sortie's topics under a configurable prefix (`sortie.` by default).
///
/// Tests give every case its own prefix so cases run in parallel on one broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    prefix: String,
}

impl Default for Topics {
    fn default() -> Self {
        Self::new(Self::DEFAULT_PREFIX)
    }
}

impl Topics {
    pub const DEFAULT_PREFIX: &'static str = "sortie.";

    pub fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Commands from other services and the gateway, keyed by run id.
    pub fn commands(&self) -> String {
        format!("{}commands", self.prefix)
    }

    /// Executor results, keyed by operation id; compacted.
    pub fn step_results(&self) -> String {
        format!("{}step-results", self.prefix)
    }

    /// The reducer's changelog of run states, keyed by run id; compacted.
    pub fn run_state(&self) -> String {
        format!("{}run-state", self.prefix)
    }

    /// Ordered run history, keyed by run id.
    pub fn run_events(&self) -> String {
        format!("{}run-events", self.prefix)
    }

    /// Published graph definitions, keyed by `graph_id@version`; compacted.
    pub fn graphs(&self) -> String {
        format!("{}graphs", self.prefix)
    }

    /// Records that could not be decoded or applied, keyed by their original key.
    pub fn dead_letters(&self) -> String {
        format!("{}dead-letters", self.prefix)
    }

    /// What running steps have produced so far (an `llm` step's text), keyed by run id;
    /// outside every run's history, kept for a short retention.
    pub fn step_deltas(&self) -> String {
        format!("{}step-deltas", self.prefix)
    }

    /// Work for the executors of one queue, keyed by operation id.
    pub fn intents(&self, queue: &str) -> String {
        format!("{}intents.{queue}", self.prefix)
    }
}
