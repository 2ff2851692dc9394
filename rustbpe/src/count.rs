//! Counting unique regex chunks of the training text, in parallel, with bounded memory.
//!
//! Texts arrive in batches; each batch is split and counted by rayon workers into local maps
//! that borrow from the batch (no allocation per chunk), the local maps are reduced, and the
//! result is folded into one global table. Only that table outlives a batch, so memory grows
//! with the number of unique chunks, not with the amount of text.
//!
//! The global table is compact: every unique chunk's bytes live once in an append-only arena,
//! and the hash table stores only u32 indexes into it.

use crate::split::Splitter;
use crate::BpeError;
use hashbrown::HashTable;
use rayon::prelude::*;
use rustc_hash::{FxBuildHasher, FxHashMap};
use std::hash::BuildHasher;

/// Unique chunks with their occurrence counts.
#[derive(Default)]
pub struct ChunkCounts {
    table: HashTable<u32>,
    /// All unique chunks back to back; chunk `i` is `arena[ends[i - 1]..ends[i]]`.
    arena: Vec<u8>,
    ends: Vec<usize>,
    counts: Vec<u64>,
}

fn hash_bytes(bytes: &[u8]) -> u64 {
    FxBuildHasher.hash_one(bytes)
}

impl ChunkCounts {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of unique chunks seen so far.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// The bytes of unique chunk `i`.
    pub fn chunk(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.arena[start..self.ends[i]]
    }

    /// Total bytes held by unique chunks (the arena).
    pub fn unique_bytes(&self) -> usize {
        self.arena.len()
    }

    /// Iterates over `(chunk bytes, count)` in first-seen order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], u64)> + '_ {
        (0..self.len()).map(move |i| (self.chunk(i), self.counts[i]))
    }

    /// Adds `count` occurrences of `chunk`.
    pub fn add(&mut self, chunk: &[u8], count: u64) -> Result<(), BpeError> {
        let hash = hash_bytes(chunk);
        let (arena, ends) = (&self.arena, &self.ends);
        let key = |i: u32| -> &[u8] {
            let i = i as usize;
            let start = if i == 0 { 0 } else { ends[i - 1] };
            &arena[start..ends[i]]
        };
        if let Some(&i) = self.table.find(hash, |&i| key(i) == chunk) {
            self.counts[i as usize] += count;
            return Ok(());
        }
        let idx = u32::try_from(self.counts.len()).map_err(|_| {
            BpeError::Input("iterator: more than 2^32 unique chunks; train on less text".into())
        })?;
        self.table.insert_unique(hash, idx, |&i| hash_bytes(key(i)));
        self.arena.extend_from_slice(chunk);
        self.ends.push(self.arena.len());
        self.counts.push(count);
        Ok(())
    }

    /// Splits and counts one batch of texts on the current rayon pool.
    pub fn add_batch<S: AsRef<str> + Sync>(
        &mut self,
        splitter: &Splitter,
        texts: &[S],
    ) -> Result<(), BpeError> {
        if texts.is_empty() {
            return Ok(());
        }
        // A few pieces per thread so one long text does not leave the others idle.
        let pieces = rayon::current_num_threads() * 4;
        let per_piece = texts.len().div_ceil(pieces).max(1);
        let local = texts
            .par_chunks(per_piece)
            .map(|docs| count_docs(splitter, docs))
            .try_reduce(FxHashMap::default, |a, b| Ok(merge_maps(a, b)))?;
        for (chunk, count) in local {
            self.add(chunk.as_bytes(), count)?;
        }
        Ok(())
    }
}

fn count_docs<'t, S: AsRef<str>>(
    splitter: &Splitter,
    docs: &'t [S],
) -> Result<FxHashMap<&'t str, u64>, BpeError> {
    let mut map: FxHashMap<&'t str, u64> = FxHashMap::default();
    for doc in docs {
        splitter.for_each_chunk(doc.as_ref(), |c| *map.entry(c).or_insert(0) += 1)?;
    }
    Ok(map)
}

/// Folds the smaller map into the larger one.
fn merge_maps<'t>(
    a: FxHashMap<&'t str, u64>,
    b: FxHashMap<&'t str, u64>,
) -> FxHashMap<&'t str, u64> {
    let (mut big, small) = if a.len() >= b.len() { (a, b) } else { (b, a) };
    for (k, v) in small {
        *big.entry(k).or_insert(0) += v;
    }
    big
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::split::GPT4_PATTERN;

    #[test]
    fn counts_unique_chunks_across_batches() {
        let splitter = Splitter::new(GPT4_PATTERN).expect("compile");
        let mut counts = ChunkCounts::new();
        counts
            .add_batch(&splitter, &["hello world", "hello there"])
            .expect("batch 1");
        counts.add_batch(&splitter, &[" world"]).expect("batch 2");
        counts
            .add_batch::<&str>(&splitter, &[])
            .expect("empty batch");
        let mut got: Vec<(String, u64)> = counts
            .iter()
            .map(|(c, n)| (String::from_utf8_lossy(c).into_owned(), n))
            .collect();
        got.sort();
        let want = [("hello", 2), (" there", 1), (" world", 2)];
        let mut want: Vec<(String, u64)> = want.iter().map(|(s, n)| (s.to_string(), *n)).collect();
        want.sort();
        assert_eq!(got, want);
        assert_eq!(
            counts.unique_bytes(),
            "hello".len() + " there".len() + " world".len()
        );
    }

    #[test]
    fn many_unique_chunks_survive_rehashing() {
        let mut counts = ChunkCounts::new();
        for round in 0..3u64 {
            for i in 0..5000u32 {
                counts
                    .add(i.to_string().as_bytes(), round + 1)
                    .expect("add");
            }
        }
        assert_eq!(counts.len(), 5000);
        assert!(counts.iter().all(|(_, n)| n == 6));
        assert_eq!(counts.chunk(4999), b"4999");
    }
}
