//! Seeded byte mutations of corpus entries, the kind a coverage-guided fuzzer starts
//! with: bit flips, byte changes, insertions and deletions, truncation, a splice with
//! another entry, and Avro length fields made huge. The same seed gives the same
//! mutations, so a failure replays.

/// SplitMix64: small, seedable, enough to draw mutations.
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

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// True `percent` times in a hundred.
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    /// One of `items` (not empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// One mutation of `seed`, drawn with `rng`; `other` is a second entry to splice with.
pub fn mutate(rng: &mut Rng, seed: &[u8], other: &[u8]) -> Vec<u8> {
    let mut bytes = seed.to_vec();
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        let len = bytes.len();
        match rng.below(8) {
            0 if len > 0 => {
                let at = rng.below(len);
                bytes[at] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let at = rng.below(len);
                bytes[at] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => {
                let at = rng.below(len + 1);
                let byte = INTERESTING[rng.below(INTERESTING.len())];
                bytes.insert(at, byte);
            }
            3 if len > 0 => {
                let at = rng.below(len);
                let n = 1 + rng.below((len - at).min(16));
                bytes.drain(at..at + n);
            }
            4 => bytes.truncate(rng.below(len + 1)),
            5 if !other.is_empty() => {
                let at = rng.below(len + 1);
                let from = rng.below(other.len());
                bytes.truncate(at);
                bytes.extend_from_slice(&other[from..]);
            }
            6 if len > 0 => {
                // An Avro long (zig-zag varint) claiming a huge length or count.
                let at = rng.below(len);
                let huge: &[u8] = match rng.below(3) {
                    0 => &[0xfe, 0xff, 0xff, 0xff, 0x0f],
                    1 => &[0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01],
                    _ => &[0x01],
                };
                bytes.splice(at..at, huge.iter().copied());
            }
            _ => {
                // Repeat a slice: deep nesting and long runs in text formats.
                if len > 0 {
                    let at = rng.below(len);
                    let n = 1 + rng.below((len - at).min(8));
                    let piece = bytes[at..at + n].to_vec();
                    for _ in 0..rng.below(64) {
                        bytes.splice(at..at, piece.iter().copied());
                    }
                }
            }
        }
    }
    bytes
}

const INTERESTING: &[u8] = &[
    0x00, 0x01, 0x7f, 0x80, 0xff, b'{', b'[', b'"', b'\\', b':', b'&', b'*', b'\n', 0xc3,
];
