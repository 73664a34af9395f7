//! Durations in graph files: `500ms`, `30s`, `5m`, `24h`, `7d`, or a number of milliseconds.

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

/// A duration in milliseconds, written as `30s`, `5m`, `24h`, `7d`, `500ms` or a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Millis(pub i64);

impl Millis {
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let split = text
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let number: i64 = number
            .parse()
            .map_err(|_| format!("{text:?} is not a duration like 30s, 5m, 24h or 7d"))?;
        let factor = match unit.trim() {
            "" | "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            other => return Err(format!("unknown duration unit {other:?} in {text:?}")),
        };
        number
            .checked_mul(factor)
            .map(Millis)
            .ok_or_else(|| format!("{text:?} is too long"))
    }
}

impl Serialize for Millis {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_i64(self.0)
    }
}

impl<'de> Deserialize<'de> for Millis {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(i64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Number(n) if n >= 0 => Ok(Millis(n)),
            Raw::Number(n) => Err(de::Error::custom(format!("negative duration {n}"))),
            Raw::Text(text) => Millis::parse(&text).map_err(de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(Millis::parse("500ms"), Ok(Millis(500)));
        assert_eq!(Millis::parse("30s"), Ok(Millis(30_000)));
        assert_eq!(Millis::parse("5m"), Ok(Millis(300_000)));
        assert_eq!(Millis::parse("24h"), Ok(Millis(86_400_000)));
        assert_eq!(Millis::parse("7d"), Ok(Millis(604_800_000)));
        assert_eq!(Millis::parse("250"), Ok(Millis(250)));
        assert!(Millis::parse("5 weeks").is_err());
        assert!(Millis::parse("soon").is_err());
    }
}
