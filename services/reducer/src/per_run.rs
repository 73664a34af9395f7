//! What the reducer remembers of a run between its inputs, beside the run's state: the
//! JSON of its steps as last written (`txn::Written`), the measures of its steps as last
//! folded (`engine::Measured`). Either can be lost at any moment without changing an
//! answer, so both are held the same crude, bounded way: at most `MAX_RUNS` runs and
//! `MAX_BYTES` of what they hold, and past either they start over rather than track
//! recency (as `Engine::hot` does).

use std::collections::HashMap;

use sortie_core::limits::MeasuredSteps;
use sortie_core::state::WrittenSteps;

/// What one run's entry holds, in bytes: what the bound counts.
pub(crate) trait Held: Default {
    fn bytes(&self) -> usize;
}

impl Held for WrittenSteps {
    fn bytes(&self) -> usize {
        WrittenSteps::bytes(self)
    }
}

impl Held for MeasuredSteps {
    fn bytes(&self) -> usize {
        MeasuredSteps::bytes(self)
    }
}

/// One `T` per run, at most `MAX_RUNS` runs and `MAX_BYTES` in all.
#[derive(Debug, Default)]
pub(crate) struct PerRun<T, const MAX_RUNS: usize, const MAX_BYTES: usize> {
    runs: HashMap<String, T>,
    bytes: usize,
}

impl<T: Held, const MAX_RUNS: usize, const MAX_BYTES: usize> PerRun<T, MAX_RUNS, MAX_BYTES> {
    /// `run_id`'s entry, taken out (empty if none is held).
    pub fn take(&mut self, run_id: &str) -> T {
        let held = self.runs.remove(run_id).unwrap_or_default();
        self.bytes -= held.bytes();
        held
    }

    /// Holds `run_id`'s entry for its next input; starts over first if it would not fit.
    pub fn keep(&mut self, run_id: &str, held: T) {
        if self.runs.len() >= MAX_RUNS || self.bytes + held.bytes() > MAX_BYTES {
            self.clear();
        }
        self.bytes += held.bytes();
        self.runs.insert(run_id.to_owned(), held);
    }

    pub fn clear(&mut self) {
        self.runs.clear();
        self.bytes = 0;
    }

    /// Runs held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.runs.len()
    }

    /// Bytes held, as the entries count them.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The sum of the entries' own counts, which [`PerRun::bytes`] must equal.
    #[cfg(test)]
    pub fn counted(&self) -> usize {
        self.runs.values().map(Held::bytes).sum()
    }
}
