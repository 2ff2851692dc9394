//! The incremental BPE merge loop.
//!
//! Each unique chunk becomes a "word": its token ids (bytes at first) plus how often the
//! chunk occurred. Pair counts are computed once, in parallel; afterwards every merge only
//! touches the words that contain the merged pair (found through a pair -> words index) and
//! adjusts the counts of the neighbouring pairs. There is never a full recount.
//!
//! Choosing the next merge (the tie-breaking rule, part of the output's definition):
//! the pair with the highest count, counted as adjacent occurrences weighted by chunk
//! frequency (so "aaa" holds ("a","a") twice); among equal counts the smallest pair, compared
//! as (left id, right id). This is what rustbpe 0.1.0 on PyPI does (checked on crafted
//! ties), so both produce identical merges on the same text and settings.
//!
//! The heap is lazy: a pair's count only ever goes down after its entry was pushed (merging
//! (a, b) into X only creates pairs that contain the new X), so a stored count is an upper
//! bound. A popped entry whose count is stale is pushed back with the current count; one
//! whose count is current is the true maximum, and the (count, reversed pair) order makes
//! the tie-break exact.

use crate::count::ChunkCounts;
use crate::BpeError;
use rayon::prelude::*;
use rustc_hash::FxHashMap;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, Ordering};

/// A pair of token ids packed as `left << 32 | right`: the u64 order is the pair order.
type PairKey = u64;

fn pack(left: u32, right: u32) -> PairKey {
    (u64::from(left) << 32) | u64::from(right)
}

fn unpack(key: PairKey) -> (u32, u32) {
    ((key >> 32) as u32, key as u32)
}

/// All words in one flat buffer; word `w` is `ids[start[w]..start[w] + len[w]]`.
/// Merging shrinks a word in place, so the buffer never reallocates.
struct Words {
    ids: Vec<u32>,
    start: Vec<usize>,
    len: Vec<u32>,
    weight: Vec<u64>,
}

impl Words {
    /// Chunks shorter than two bytes can never merge and are left out.
    fn from_counts(counts: &ChunkCounts) -> Result<Self, BpeError> {
        let mut words = Words {
            ids: Vec::with_capacity(counts.unique_bytes()),
            start: Vec::new(),
            len: Vec::new(),
            weight: Vec::new(),
        };
        for (chunk, n) in counts.iter().filter(|(c, _)| c.len() >= 2) {
            let len = u32::try_from(chunk.len())
                .map_err(|_| BpeError::Input("iterator: a chunk longer than 4 GiB".into()))?;
            words.start.push(words.ids.len());
            words.len.push(len);
            words.weight.push(n);
            words.ids.extend(chunk.iter().map(|&b| u32::from(b)));
        }
        if u32::try_from(words.len.len()).is_err() {
            return Err(BpeError::Input(
                "iterator: more than 2^32 unique chunks; train on less text".into(),
            ));
        }
        Ok(words)
    }

    fn word(&self, w: usize) -> &[u32] {
        &self.ids[self.start[w]..self.start[w] + self.len[w] as usize]
    }
}

/// Count of one pair and the words that may contain it (a superset: entries go stale when
/// a word loses the pair, and merging a stale word is a harmless no-op).
#[derive(Default)]
struct PairStat {
    count: u64,
    words: Vec<u32>,
}

type PairStats = FxHashMap<PairKey, PairStat>;

/// Pair counts and the pair -> words index, built in parallel over ranges of words.
fn initial_stats(words: &Words) -> PairStats {
    let n = words.len.len();
    let per_piece = n.div_ceil(rayon::current_num_threads() * 4).max(1);
    (0..n.div_ceil(per_piece))
        .into_par_iter()
        .map(|piece| {
            let mut stats = PairStats::default();
            for w in piece * per_piece..n.min((piece + 1) * per_piece) {
                for pair in words.word(w).windows(2) {
                    let stat = stats.entry(pack(pair[0], pair[1])).or_default();
                    stat.count += words.weight[w];
                    if stat.words.last() != Some(&(w as u32)) {
                        stat.words.push(w as u32);
                    }
                }
            }
            stats
        })
        .reduce(PairStats::default, |a, b| {
            let (mut big, small) = if a.len() >= b.len() { (a, b) } else { (b, a) };
            for (key, stat) in small {
                let into = big.entry(key).or_default();
                into.count += stat.count;
                into.words.extend(stat.words);
            }
            big
        })
}

/// Mutable training state shared by the per-word merge steps.
struct MergeState {
    stats: PairStats,
    /// Pairs first seen during the current merge (they all contain the new id).
    created: Vec<PairKey>,
}

impl MergeState {
    fn add(&mut self, key: PairKey, w: u32, weight: u64) {
        let created = &mut self.created;
        let stat = self.stats.entry(key).or_insert_with(|| {
            created.push(key);
            PairStat::default()
        });
        stat.count += weight;
        if stat.words.last() != Some(&w) {
            stat.words.push(w);
        }
    }

    fn sub(&mut self, key: PairKey, weight: u64) {
        // Zero counts stay until the heap pops them (or the end of the merge, for pairs
        // created in it): removing here could drop words of a pair that comes back.
        if let Some(stat) = self.stats.get_mut(&key) {
            debug_assert!(stat.count >= weight, "pair count underflow");
            stat.count = stat.count.saturating_sub(weight);
        }
    }

    /// Replaces every non-overlapping (a, b) in `ids`, left to right, by `new_id` and
    /// updates the counts of the neighbouring pairs. Returns the new length.
    fn merge_word(
        &mut self,
        ids: &mut [u32],
        w: u32,
        weight: u64,
        pair: (u32, u32),
        new_id: u32,
    ) -> usize {
        let (a, b) = pair;
        let merged = pack(a, b);
        let n = ids.len();
        let (mut read, mut write) = (0, 0);
        while read < n {
            if read + 1 < n && ids[read] == a && ids[read + 1] == b {
                if write > 0 {
                    let left = ids[write - 1];
                    if pack(left, a) != merged {
                        self.sub(pack(left, a), weight);
                    }
                    self.add(pack(left, new_id), w, weight);
                }
                if read + 2 < n {
                    let right = ids[read + 2];
                    if pack(b, right) != merged {
                        self.sub(pack(b, right), weight);
                    }
                    self.add(pack(new_id, right), w, weight);
                }
                ids[write] = new_id;
                read += 2;
            } else {
                ids[write] = ids[read];
                read += 1;
            }
            write += 1;
        }
        write
    }
}

/// Heap entry: the max-heap yields the highest count, then the smallest pair.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    count: u64,
    pair: Reverse<PairKey>,
}

/// Pops until an entry with a current count comes up; refreshes stale ones on the way.
fn pop_best(heap: &mut BinaryHeap<Candidate>, stats: &mut PairStats) -> Option<PairKey> {
    while let Some(top) = heap.pop() {
        let key = top.pair.0;
        let current = stats.get(&key).map_or(0, |s| s.count);
        debug_assert!(current <= top.count, "heap counts must be upper bounds");
        if current == 0 {
            stats.remove(&key);
        } else if current == top.count {
            return Some(key);
        } else {
            heap.push(Candidate {
                count: current,
                pair: top.pair,
            });
        }
    }
    None
}

/// Learns up to `num_merges` merges from the chunk counts (fewer if the text runs out of
/// pairs). Runs on the current rayon pool. Merge `i` creates token id `256 + i`.
pub fn train_merges(counts: ChunkCounts, num_merges: usize) -> Result<Vec<(u32, u32)>, BpeError> {
    train_merges_cancellable(counts, num_merges, &AtomicBool::new(false))
}

/// [`train_merges`] that gives up with [`BpeError::Cancelled`] soon after `cancel` is set
/// (checked before and after the initial pair count and before every merge). The Python
/// binding sets it from the calling thread on Ctrl-C: only that thread may run Python's
/// signal handlers, and it waits on this loop with the GIL released.
pub fn train_merges_cancellable(
    counts: ChunkCounts,
    num_merges: usize,
    cancel: &AtomicBool,
) -> Result<Vec<(u32, u32)>, BpeError> {
    // Relaxed is enough: the flag carries no data, and one merge later is still "soon".
    let cancelled = || cancel.load(Ordering::Relaxed);
    if cancelled() {
        return Err(BpeError::Cancelled);
    }
    let mut words = Words::from_counts(&counts)?;
    drop(counts); // the words hold everything training needs from here on
    let stats = initial_stats(&words);
    if cancelled() {
        return Err(BpeError::Cancelled);
    }
    let mut heap: BinaryHeap<Candidate> = stats
        .iter()
        .map(|(&key, s)| Candidate {
            count: s.count,
            pair: Reverse(key),
        })
        .collect();
    let mut state = MergeState {
        stats,
        created: Vec::new(),
    };
    let mut merges = Vec::new();
    while merges.len() < num_merges {
        // One relaxed load per merge: noise next to the merge itself.
        if cancelled() {
            return Err(BpeError::Cancelled);
        }
        let Some(best) = pop_best(&mut heap, &mut state.stats) else {
            break;
        };
        let new_id = u32::try_from(256 + merges.len())
            .map_err(|_| BpeError::VocabSize(format!("{}", 256 + num_merges)))?;
        let pair = unpack(best);
        merges.push(pair);
        let touched = state
            .stats
            .remove(&best)
            .map(|s| s.words)
            .unwrap_or_default();
        for w in touched {
            let wi = w as usize;
            let (start, len) = (words.start[wi], words.len[wi] as usize);
            let ids = &mut words.ids[start..start + len];
            let weight = words.weight[wi];
            words.len[wi] = state.merge_word(ids, w, weight, pair, new_id) as u32;
        }
        for key in std::mem::take(&mut state.created) {
            match state.stats.get(&key).map(|s| s.count) {
                Some(0) => {
                    state.stats.remove(&key);
                }
                Some(count) => heap.push(Candidate {
                    count,
                    pair: Reverse(key),
                }),
                None => {}
            }
        }
    }
    Ok(merges)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts_of(chunks: &[(&str, u64)]) -> ChunkCounts {
        let mut counts = ChunkCounts::new();
        for (c, n) in chunks {
            counts.add(c.as_bytes(), *n).expect("add");
        }
        counts
    }

    fn id(c: char) -> u32 {
        c as u32
    }

    #[test]
    fn overlapping_pairs_count_twice() {
        // ("z","z") occurs 2 x 2 = 4 times, ("b","c") 3 times.
        let merges = train_merges(counts_of(&[("zzz", 2), ("bc", 3)]), 1).expect("train");
        assert_eq!(merges, [(id('z'), id('z'))]);
    }

    #[test]
    fn ties_go_to_the_smallest_pair() {
        let merges = train_merges(counts_of(&[("zzzz", 1), ("bc", 3)]), 2).expect("train");
        assert_eq!(merges, [(id('b'), id('c')), (id('z'), id('z'))]);
        let merges = train_merges(counts_of(&[("ca", 1), ("ba", 1)]), 2).expect("train");
        assert_eq!(merges, [(id('b'), id('a')), (id('c'), id('a'))]);
    }

    #[test]
    fn stops_when_pairs_run_out() {
        let merges = train_merges(counts_of(&[("aaaa", 1)]), 10).expect("train");
        assert_eq!(merges, [(id('a'), id('a')), (256, 256)]);
        let merges = train_merges(counts_of(&[("x", 5)]), 10).expect("train");
        assert!(merges.is_empty());
    }

    #[test]
    fn a_set_cancel_flag_stops_training() {
        let cancel = AtomicBool::new(true);
        let got = train_merges_cancellable(counts_of(&[("abab", 2)]), 5, &cancel);
        assert_eq!(got, Err(BpeError::Cancelled));
        cancel.store(false, Ordering::Relaxed);
        let got = train_merges_cancellable(counts_of(&[("abab", 2)]), 1, &cancel);
        assert_eq!(got, Ok(vec![(id('a'), id('b'))]));
    }

    #[test]
    fn merge_word_keeps_counts_exact() {
        // "abab" with (a, b) -> X: pairs (b, a) and (a, b) vanish, (X, X) appears.
        let counts = counts_of(&[("abab", 2), ("ba", 1)]);
        let words = Words::from_counts(&counts).expect("words");
        let mut state = MergeState {
            stats: initial_stats(&words),
            created: Vec::new(),
        };
        let mut ids = words.word(0).to_vec();
        state.stats.remove(&pack(id('a'), id('b')));
        let len = state.merge_word(&mut ids, 0, 2, (id('a'), id('b')), 256);
        assert_eq!(&ids[..len], [256, 256]);
        let count = |l, r| state.stats.get(&pack(l, r)).map_or(0, |s| s.count);
        assert_eq!(count(id('b'), id('a')), 1); // only the "ba" word is left
        assert_eq!(count(256, 256), 2);
        assert_eq!(count(256, id('a')), 0);
    }
}
