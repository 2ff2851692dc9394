//! rustbpe: a byte-level BPE tokenizer trainer (GPT-4 style) for nanochat-spark.
//!
//! The crate owns training (regex pre-split, parallel chunk counting, incremental merge loop)
//! and a reference encoder. Fast encoding at run time is tiktoken's job: it is built from
//! [`Bpe::mergeable_ranks`]. Everything here is plain Rust; the PyO3 bindings live in
//! `python.rs` behind the `python` feature, so `cargo test` needs no Python interpreter.
//!
//! Modules:
//! - [`split`]: the split regex (GPT-4 pattern by default) with a hand-written fast path.
//! - [`count`]: counting unique regex chunks in parallel, memory bounded by the unique chunks.
//! - [`train`]: the incremental merge loop (priority heap + pair -> words index).
//! - [`model`]: the trained tokenizer: merges, mergeable ranks, encode.

pub mod count;
pub mod model;
pub mod split;
pub mod train;

#[cfg(feature = "python")]
mod python;

pub use count::ChunkCounts;
pub use model::Bpe;
pub use split::{Splitter, GPT4_PATTERN};

use std::fmt;

/// Every way user input can be rejected. The Python layer turns each into `ValueError`
/// with this `Display` text, so messages name the argument and what is accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BpeError {
    /// `vocab_size` below 256 (the byte alphabet) or above what u32 token ids can hold.
    VocabSize(String),
    /// The split pattern failed to compile.
    Pattern { pattern: String, reason: String },
    /// The pattern can match the empty string (its shortest match is zero characters).
    EmptyMatch { pattern: String },
    /// The pattern failed while matching (e.g. fancy-regex's backtrack limit).
    Matching { reason: String },
    /// Training input produced no regex chunks at all (every text was empty: text the
    /// pattern leaves unmatched is an [`BpeError::Input`] of its own).
    NoChunks,
    /// Anything else the caller passed that cannot be used (named in the message).
    Input(String),
    /// Training was stopped through its cancel flag (the Python layer raises the
    /// KeyboardInterrupt that set the flag, not this).
    Cancelled,
}

impl fmt::Display for BpeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BpeError::VocabSize(got) => write!(
                f,
                "vocab_size: got {got}; accepted: an int from 256 (the 256 byte tokens, no merges) \
                 to {}",
                model::MAX_VOCAB_SIZE
            ),
            BpeError::Pattern { pattern, reason } => write!(
                f,
                "pattern: invalid regex {pattern:?}: {reason}; accepted: a fancy-regex pattern \
                 (None = the GPT-4 split pattern)"
            ),
            BpeError::EmptyMatch { pattern } => write!(
                f,
                "pattern: {pattern:?} can match the empty string (an alternative like `x*`, `x?` or \
                 a bare look-around, taken wherever the others fail): tiktoken panics on an empty \
                 match at the start of a text and silently drops the character it skips \
                 elsewhere; accepted: a regex whose every match is at least one character (e.g. \
                 `x+`, not `x*`)"
            ),
            BpeError::Matching { reason } => write!(f, "pattern: matching failed: {reason}"),
            BpeError::NoChunks => write!(
                f,
                "iterator: the training text is empty (no regex chunks: every text is empty); \
                 accepted: an iterable of non-empty str"
            ),
            BpeError::Input(msg) => f.write_str(msg),
            BpeError::Cancelled => f.write_str("training was cancelled before it finished"),
        }
    }
}

impl std::error::Error for BpeError {}
