//! The canonical partitioner. A run's records must land on the same partition whoever
//! produced them, so Sortie uses the Java client's default: `toPositive(murmur2(key)) % n`.
//! librdkafka's default (CRC32) would disagree with Java producers.

/// Kafka's murmur2 (seed `0x9747b28c`), bit for bit as `org.apache.kafka.common.utils.Utils.murmur2`.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;

    let length = data.len();
    let mut h: u32 = SEED ^ (length as u32);
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    // Java's switch falls through from 3 to 2 to 1; bytes are sign-extended there but
    // masked with 0xff, so plain u8 values give the same bits.
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if !rest.is_empty() {
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition of `key` among `partitions`, as the Java client's default partitioner
/// computes it for a keyed record: `(murmur2(key) & 0x7fffffff) % partitions`.
///
/// # Panics
/// When `partitions` is zero.
pub fn partition_for(key: &[u8], partitions: u32) -> i32 {
    assert!(partitions > 0, "a topic has at least one partition");
    let positive = (murmur2(key) & 0x7fff_ffff) as u32;
    (positive % partitions) as i32
}
