//! Where the view has read to: a [`Position`] in the run-events log (what a command's
//! answer carries and a read can wait for), and the view's [`Progress`] per partition.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// A place in the run-events log: the answer to a command carries the position of the
/// answering event, and a read can wait until the view has applied it. Written `p2:o1534`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position {
    pub partition: i32,
    pub offset: i64,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}:o{}", self.partition, self.offset)
    }
}

impl FromStr for Position {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{s:?} is not a position like p2:o1534");
        let (p, o) = s.trim().split_once(':').ok_or_else(bad)?;
        let partition = p.strip_prefix('p').and_then(|p| p.parse().ok());
        let offset = o.strip_prefix('o').and_then(|o| o.parse().ok());
        match (partition, offset) {
            (Some(partition), Some(offset)) if partition >= 0 && offset >= 0 => {
                Ok(Position { partition, offset })
            }
            _ => Err(bad()),
        }
    }
}

/// Positions, comma-separated (a client that wrote to several runs may wait for all).
pub fn parse_positions(s: &str) -> Result<Vec<Position>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(str::parse)
        .collect()
}

/// How far the view has read.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// Next offset to read per partition of run-events.
    pub events: BTreeMap<i32, i64>,
    /// Next offset to read per partition of run-state.
    pub states: BTreeMap<i32, i64>,
    /// Records applied since start (wakes streams and waiters).
    pub applied: u64,
    /// Caught up with the end of both topics as they were at start.
    pub ready: bool,
    /// The view stopped on a store failure: reads would be stale from now on.
    pub failed: bool,
}

impl Progress {
    pub fn reached(&self, position: &Position) -> bool {
        self.events
            .get(&position.partition)
            .is_some_and(|next| *next > position.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_read_back_what_they_print() {
        let p = Position {
            partition: 2,
            offset: 1534,
        };
        assert_eq!(p.to_string(), "p2:o1534");
        assert_eq!("p2:o1534".parse::<Position>(), Ok(p));
        assert!("2:1534".parse::<Position>().is_err());
        assert!("p-1:o3".parse::<Position>().is_err());
        assert_eq!(
            parse_positions("p0:o1,p2:o9").expect("two"),
            vec![
                Position {
                    partition: 0,
                    offset: 1
                },
                Position {
                    partition: 2,
                    offset: 9
                }
            ]
        );
        let progress = Progress {
            events: BTreeMap::from([(2, 1535)]),
            ..Progress::default()
        };
        assert!(progress.reached(&p));
        assert!(!progress.reached(&Position {
            partition: 2,
            offset: 1535
        }));
    }
}
