//! The trained tokenizer: split pattern + merges, with the views callers need
//! (mergeable ranks for tiktoken, the merge list) and a reference encoder.

use crate::count::ChunkCounts;
use crate::split::Splitter;
use crate::train::train_merges;
use crate::BpeError;
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// Largest accepted vocab size: token ids are u32.
pub const MAX_VOCAB_SIZE: u64 = u32::MAX as u64;

/// Checks a requested vocab size and returns the number of merges it asks for.
pub fn merges_for_vocab_size(vocab_size: i64) -> Result<usize, BpeError> {
    if !(256..=MAX_VOCAB_SIZE as i64).contains(&vocab_size) {
        return Err(BpeError::VocabSize(vocab_size.to_string()));
    }
    usize::try_from(vocab_size - 256).map_err(|_| BpeError::VocabSize(vocab_size.to_string()))
}

/// A byte-level BPE tokenizer: 256 byte tokens, then one token per merge (id 256 + rank).
pub struct Bpe {
    splitter: Arc<Splitter>,
    merges: Vec<(u32, u32)>,
    /// (left, right) -> merged id; the id doubles as the merge's rank.
    ranks: FxHashMap<(u32, u32), u32>,
}

impl Bpe {
    /// An untrained tokenizer (bytes only) with the given split pattern.
    pub fn new(splitter: Arc<Splitter>) -> Self {
        Bpe {
            splitter,
            merges: Vec::new(),
            ranks: FxHashMap::default(),
        }
    }

    /// Trains on counted chunks (on the current rayon pool). `vocab_size` includes the 256
    /// byte tokens; training stops early if the text runs out of pairs.
    pub fn train(
        splitter: Arc<Splitter>,
        counts: ChunkCounts,
        vocab_size: i64,
    ) -> Result<Self, BpeError> {
        let num_merges = merges_for_vocab_size(vocab_size)?;
        if counts.is_empty() {
            return Err(BpeError::NoChunks);
        }
        let merges = train_merges(counts, num_merges)?;
        Ok(Self::from_merges(splitter, merges))
    }

    /// Convenience for Rust callers and tests: count `texts` and train.
    pub fn train_from_texts<S: AsRef<str> + Sync>(
        texts: &[S],
        vocab_size: i64,
        pattern: &str,
    ) -> Result<Self, BpeError> {
        merges_for_vocab_size(vocab_size)?;
        let splitter = Arc::new(Splitter::new(pattern)?);
        let mut counts = ChunkCounts::new();
        counts.add_batch(&splitter, texts)?;
        Self::train(splitter, counts, vocab_size)
    }

    fn from_merges(splitter: Arc<Splitter>, merges: Vec<(u32, u32)>) -> Self {
        let ranks = merges
            .iter()
            .enumerate()
            .map(|(i, &pair)| (pair, 256 + i as u32))
            .collect();
        Bpe {
            splitter,
            merges,
            ranks,
        }
    }

    pub fn pattern(&self) -> &str {
        self.splitter.pattern()
    }

    pub fn vocab_size(&self) -> usize {
        256 + self.merges.len()
    }

    /// `(left id, right id, new id)` in merge order.
    pub fn merges(&self) -> Vec<(u32, u32, u32)> {
        self.merges
            .iter()
            .enumerate()
            .map(|(i, &(l, r))| (l, r, 256 + i as u32))
            .collect()
    }

    /// The bytes of every token, indexed by id.
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        let mut vocab: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for &(l, r) in &self.merges {
            let mut bytes = vocab[l as usize].clone();
            bytes.extend_from_slice(&vocab[r as usize]);
            vocab.push(bytes);
        }
        vocab
    }

    /// `(token bytes, rank)`: the 256 single bytes first, then merges in rank order.
    /// This is what tiktoken's `mergeable_ranks` wants.
    pub fn mergeable_ranks(&self) -> Vec<(Vec<u8>, u32)> {
        self.token_bytes().into_iter().zip(0u32..).collect()
    }

    /// Reference encoder: split with the pattern, then in each chunk apply the
    /// lowest-ranked merge present (all its non-overlapping occurrences, left to right)
    /// until none applies. Quadratic in the chunk length; tiktoken is the fast path.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, BpeError> {
        let mut out = Vec::with_capacity(text.len() / 3);
        self.splitter.for_each_chunk(text, |chunk| {
            let mut ids: Vec<u32> = chunk.bytes().map(u32::from).collect();
            while let Some((pair, new_id)) = ids
                .windows(2)
                .filter_map(|w| self.ranks.get(&(w[0], w[1])).map(|&id| ((w[0], w[1]), id)))
                .min_by_key(|&(_, id)| id)
            {
                ids = merge_all(&ids, pair, new_id);
            }
            out.extend_from_slice(&ids);
        })?;
        Ok(out)
    }
}

fn merge_all(ids: &[u32], pair: (u32, u32), new_id: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity(ids.len());
    let mut i = 0;
    while i < ids.len() {
        if i + 1 < ids.len() && (ids[i], ids[i + 1]) == pair {
            out.push(new_id);
            i += 2;
        } else {
            out.push(ids[i]);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::split::GPT4_PATTERN;

    #[test]
    fn vocab_size_bounds() {
        assert_eq!(merges_for_vocab_size(256), Ok(0));
        assert_eq!(merges_for_vocab_size(300), Ok(44));
        assert!(matches!(
            merges_for_vocab_size(255),
            Err(BpeError::VocabSize(_))
        ));
        assert!(matches!(
            merges_for_vocab_size(-1),
            Err(BpeError::VocabSize(_))
        ));
        assert!(matches!(
            merges_for_vocab_size(i64::MAX),
            Err(BpeError::VocabSize(_))
        ));
    }

    #[test]
    fn train_encode_round_trip() {
        let texts = [
            "the cat sat on the mat",
            "the hat; the bat!",
            "hello world 2024",
        ];
        let bpe = Bpe::train_from_texts(&texts, 256 + 20, GPT4_PATTERN).expect("train");
        assert_eq!(bpe.vocab_size(), 276);
        assert_eq!(bpe.merges()[0].2, 256);
        let vocab = bpe.token_bytes();
        for text in texts.iter().chain(&["unseen text: the end"]) {
            let ids = bpe.encode(text).expect("encode");
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&i| vocab[i as usize].clone())
                .collect();
            assert_eq!(bytes, text.as_bytes());
        }
        // "the" is frequent enough to be a single token after training.
        let the = bpe.encode(" the").expect("encode");
        assert_eq!(the.len(), 1);
        assert_eq!(vocab[the[0] as usize], b" the");
    }

    #[test]
    fn ranks_list_bytes_first() {
        let bpe = Bpe::train_from_texts(&["abab abab"], 258, GPT4_PATTERN).expect("train");
        let ranks = bpe.mergeable_ranks();
        assert_eq!(ranks.len(), 258);
        assert_eq!(ranks[97], (b"a".to_vec(), 97));
        assert_eq!(ranks[256], (b"ab".to_vec(), 256));
    }

    #[test]
    fn empty_input_and_bad_vocab_are_errors() {
        let empty: [&str; 2] = ["", ""];
        assert!(matches!(
            Bpe::train_from_texts(&empty, 300, GPT4_PATTERN),
            Err(BpeError::NoChunks)
        ));
        assert!(matches!(
            Bpe::train_from_texts(&["abc"], 10, GPT4_PATTERN),
            Err(BpeError::VocabSize(_))
        ));
        assert!(matches!(
            Bpe::train_from_texts(&["abc"], 300, "(("),
            Err(BpeError::Pattern { .. })
        ));
    }
}
