//! The trained tokenizer: split pattern + merges, with the views callers need
//! (mergeable ranks for tiktoken, the merge list) and a reference encoder.

use crate::count::ChunkCounts;
use crate::split::Splitter;
use crate::train::train_merges_cancellable;
use crate::BpeError;
use rustc_hash::{FxHashMap, FxHashSet};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Largest accepted vocab size: token ids are u32.
pub const MAX_VOCAB_SIZE: u64 = u32::MAX as u64;

/// Most bytes the tokens of a rebuilt model ([`Bpe::from_parts`]) may hold together. The merges
/// there are data from outside (a pickle), where 41 doubling merges ("a" + "a", then each new
/// token with itself) describe a 2^41-byte token that `mergeable_ranks` then tried to build: an
/// allocation failure, which aborts the whole Python process. Real vocabularies hold well under
/// a megabyte; training rejects chunks over 4 GiB, so this is the same order of limit.
pub const MAX_TOKEN_BYTES: u64 = 1 << 32;

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
        Self::train_cancellable(splitter, counts, vocab_size, &AtomicBool::new(false))
    }

    /// [`Bpe::train`] that returns [`BpeError::Cancelled`] soon after `cancel` is set
    /// (see [`crate::train::train_merges_cancellable`]); no partial model comes back.
    pub fn train_cancellable(
        splitter: Arc<Splitter>,
        counts: ChunkCounts,
        vocab_size: i64,
        cancel: &AtomicBool,
    ) -> Result<Self, BpeError> {
        let num_merges = merges_for_vocab_size(vocab_size)?;
        if counts.is_empty() {
            return Err(BpeError::NoChunks);
        }
        let merges = train_merges_cancellable(counts, num_merges, cancel)?;
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

    /// Rebuilds a tokenizer from its split pattern and merge list (e.g. when unpickling),
    /// checking that merge `i` joins tokens that exist before it (ids below `256 + i`), that
    /// no pair is merged twice and that the tokens hold at most [`MAX_TOKEN_BYTES`] together:
    /// a bad list is a [`BpeError::Input`], never a panic or an allocation abort.
    pub fn from_parts(pattern: &str, merges: Vec<(u32, u32)>) -> Result<Self, BpeError> {
        let n = i64::try_from(merges.len()).unwrap_or(i64::MAX);
        merges_for_vocab_size(n.saturating_add(256))?;
        let mut seen = FxHashSet::default();
        // Byte length of every token so far; the total stays <= MAX_TOKEN_BYTES, so no sum
        // below can overflow.
        let mut lens: Vec<u64> = vec![1; 256];
        let mut total: u64 = 256;
        for (i, &(left, right)) in merges.iter().enumerate() {
            let next_id = 256 + i as u64;
            if u64::from(left) >= next_id || u64::from(right) >= next_id {
                return Err(BpeError::Input(format!(
                    "merges: merge {i} is ({left}, {right}); accepted: token ids below {next_id} \
                     (the 256 bytes and the merges before it)"
                )));
            }
            if !seen.insert((left, right)) {
                return Err(BpeError::Input(format!(
                    "merges: merge {i} ({left}, {right}) repeats an earlier merge; accepted: \
                     each pair merged once"
                )));
            }
            let len = lens[left as usize] + lens[right as usize];
            total += len;
            if total > MAX_TOKEN_BYTES {
                return Err(BpeError::Input(format!(
                    "merges: merge {i} ({left}, {right}) makes a {len}-byte token and the tokens \
                     more than {MAX_TOKEN_BYTES} bytes together; accepted: the merges of a \
                     trained tokenizer (tokens of real text)"
                )));
            }
            lens.push(len);
        }
        let splitter = Arc::new(Splitter::new(pattern)?);
        Ok(Self::from_merges(splitter, merges))
    }

    /// `(left id, right id)` of every merge, in rank order (merge `i` makes id `256 + i`).
    pub fn merge_pairs(&self) -> &[(u32, u32)] {
        &self.merges
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
    /// until none applies. Gives tiktoken's ids (tiktoken is the fast path at run time).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, BpeError> {
        let mut out = Vec::with_capacity(text.len() / 3);
        self.splitter.for_each_chunk(text, |chunk| {
            if chunk.len() < LONG_CHUNK {
                self.merge_chunk_simple(chunk.as_bytes(), &mut out);
            } else {
                self.merge_chunk_heap(chunk.as_bytes(), &mut out);
            }
        })?;
        Ok(out)
    }

    fn rank(&self, left: u32, right: u32) -> Option<u32> {
        self.ranks.get(&(left, right)).copied()
    }

    /// One rescan of the chunk per merge applied: cheapest for the short chunks of real text,
    /// but O(length x merges applied), so a 400k-letter chunk took ~5 s (tiktoken ~0.1 s).
    fn merge_chunk_simple(&self, chunk: &[u8], out: &mut Vec<u32>) {
        let mut ids: Vec<u32> = chunk.iter().map(|&b| u32::from(b)).collect();
        while let Some((pair, new_id)) = ids
            .windows(2)
            .filter_map(|w| self.rank(w[0], w[1]).map(|id| ((w[0], w[1]), id)))
            .min_by_key(|&(_, id)| id)
        {
            ids = merge_all(&ids, pair, new_id);
        }
        out.extend_from_slice(&ids);
    }

    /// The same merges in O(n log n): the chunk as a linked list of tokens and a min-heap of
    /// (rank, position) for adjacent pairs. The lowest rank goes first and, among equal ranks,
    /// the leftmost, which is what `merge_chunk_simple` does: a merge only creates pairs that
    /// contain the new id, whose ranks are all higher, so ranks come off the heap in order.
    /// An entry is stale when its left token was merged away or changed, or its right
    /// neighbour changed: token ids only grow, so comparing both ids detects it exactly.
    fn merge_chunk_heap(&self, chunk: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        let n = chunk.len();
        let mut ids: Vec<u32> = chunk.iter().map(|&b| u32::from(b)).collect();
        let mut next: Vec<usize> = (1..=n).map(|i| if i < n { i } else { NONE }).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| i.wrapping_sub(1)).collect(); // 0 -> NONE
        let mut alive = vec![true; n];
        let mut heap = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, ids: &[u32], i: usize, j: usize| {
            if let Some(rank) = self.rank(ids[i], ids[j]) {
                heap.push(Reverse((rank, i, ids[i], ids[j])));
            }
        };
        for i in 1..n {
            push(&mut heap, &ids, i - 1, i);
        }
        while let Some(Reverse((rank, i, left, right))) = heap.pop() {
            let j = next[i];
            if !alive[i] || j == NONE || ids[i] != left || ids[j] != right {
                continue;
            }
            ids[i] = rank;
            alive[j] = false;
            next[i] = next[j];
            if next[j] != NONE {
                prev[next[j]] = i;
            }
            if prev[i] != NONE {
                push(&mut heap, &ids, prev[i], i);
            }
            if next[i] != NONE {
                push(&mut heap, &ids, i, next[i]);
            }
        }
        let mut i = if n > 0 { 0 } else { NONE };
        while i != NONE {
            out.push(ids[i]);
            i = next[i];
        }
    }
}

/// Chunks at least this long (bytes) are merged with the heap (see `merge_chunk_heap`).
const LONG_CHUNK: usize = 64;

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

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn heap_merge_equals_simple_merge() {
        // Small alphabets make long chains of merges, repeats and overlaps ("aaaa").
        let texts = [
            "abababa aaaaaaa abcabcabc bcbcb",
            "aaaaaaaaaaaaaaaa ab ba abab",
        ];
        let bpe = Bpe::train_from_texts(&texts, 256 + 40, r"\S+|\s+").expect("train");
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for round in 0..3000 {
            let len = 1 + (xorshift(&mut state) % 300) as usize;
            let alphabet: &[u8] = if round % 2 == 0 { b"ab" } else { b"abc " };
            let chunk: Vec<u8> = (0..len)
                .map(|_| alphabet[(xorshift(&mut state) % alphabet.len() as u64) as usize])
                .collect();
            let (mut simple, mut heap) = (Vec::new(), Vec::new());
            bpe.merge_chunk_simple(&chunk, &mut simple);
            bpe.merge_chunk_heap(&chunk, &mut heap);
            assert_eq!(simple, heap, "chunk {:?}", String::from_utf8_lossy(&chunk));
        }
        let (mut one, mut empty) = (Vec::new(), Vec::new());
        bpe.merge_chunk_heap(b"a", &mut one);
        bpe.merge_chunk_heap(b"", &mut empty);
        assert_eq!((one, empty), (vec![97], vec![]));
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
    fn from_parts_round_trips_and_rejects_bad_merges() {
        let bpe = Bpe::train_from_texts(&["abab abab cdcd"], 262, GPT4_PATTERN).expect("train");
        let again = Bpe::from_parts(bpe.pattern(), bpe.merge_pairs().to_vec()).expect("rebuild");
        assert_eq!(again.merges(), bpe.merges());
        assert_eq!(again.encode("abab cd").ok(), bpe.encode("abab cd").ok());
        for bad in [vec![(97, 256)], vec![(300, 97)], vec![(97, 98), (97, 98)]] {
            assert!(matches!(
                Bpe::from_parts(GPT4_PATTERN, bad),
                Err(BpeError::Input(_))
            ));
        }
        assert!(matches!(
            Bpe::from_parts("((", vec![]),
            Err(BpeError::Pattern { .. })
        ));
        // Merge 0 may use only the bytes; merge 1 may use id 256.
        assert!(Bpe::from_parts(GPT4_PATTERN, vec![(97, 98), (256, 256)]).is_ok());
    }

    #[test]
    fn from_parts_rejects_merges_that_describe_huge_tokens() {
        // Each merge doubles the last token: merge i makes a 2^(i+1)-byte token, so 41
        // merges ask for 2^41 bytes, which token_bytes() used to try (an allocation abort).
        let doubling = |n: u32| -> Vec<(u32, u32)> {
            std::iter::once((97, 97))
                .chain((0..n - 1).map(|i| (256 + i, 256 + i)))
                .collect()
        };
        match Bpe::from_parts(GPT4_PATTERN, doubling(41)) {
            Err(BpeError::Input(msg)) => {
                assert!(msg.contains("merges: merge 30 (285, 285)"), "{msg}")
            }
            other => panic!("expected an input error, got {:?}", other.map(|_| ())),
        }
        // 2 + 4 + ... + 2^20 bytes is fine, and every token is built.
        let bpe = Bpe::from_parts(GPT4_PATTERN, doubling(20)).expect("small enough");
        assert_eq!(bpe.token_bytes()[256 + 19].len(), 1 << 20);
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
