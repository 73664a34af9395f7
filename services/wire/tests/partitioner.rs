//! The canonical partitioner must agree with the Java client byte for byte. The vectors in
//! `data/murmur2-vectors.tsv` were printed by `dev/kafka/Murmur2Vectors.java`, which calls
//! `org.apache.kafka.common.utils.Utils.murmur2` from kafka-clients itself.

use sortie_wire::{murmur2, partition_for};

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn matches_java_murmur2_and_default_partitioner() {
    let vectors = include_str!("data/murmur2-vectors.tsv");
    let mut checked = 0;
    for line in vectors.lines().skip(1) {
        let cols: Vec<&str> = line.split('\t').collect();
        let key = unhex(cols[0]);
        let expected: i32 = cols[1].parse().expect("murmur2 column");
        assert_eq!(murmur2(&key), expected, "murmur2 of {}", cols[0]);
        for (col, partitions) in [(2, 1), (3, 3), (4, 12), (5, 100)] {
            let expected: i32 = cols[col].parse().expect("partition column");
            assert_eq!(
                partition_for(&key, partitions),
                expected,
                "partition of {} among {partitions}",
                cols[0]
            );
        }
        checked += 1;
    }
    assert!(checked >= 50, "only {checked} vectors read");
}
