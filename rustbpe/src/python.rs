//! PyO3 bindings: the `rustbpe.Tokenizer` class and `rustbpe.check_pattern` (API in
//! docs/INTERFACES.md).
//!
//! This layer validates every argument before consuming the iterator, turns each
//! [`BpeError`] into `ValueError`, and releases the GIL for the heavy parts. Ingestion is
//! pipelined: while rayon workers split and count batch k (GIL released), this thread holds
//! the GIL to pull batch k+1 from the Python iterator. Ctrl-C is noticed in both phases:
//! between batches while counting, and every 50 ms while merging (the merge loop runs in a
//! helper thread and stops at its next cancel check); the KeyboardInterrupt propagates.
//!
//! The class is `frozen`: the trained model sits behind a mutex as an `Arc<Bpe>` that calls
//! clone (encode, getters) or swap whole (training, unpickling). No call holds a PyO3 borrow
//! while Python code runs, so the training iterator, or another thread, may use the same
//! object meanwhile (it sees the previous model) instead of getting "Already borrowed".

use crate::model::{merges_for_vocab_size, Bpe};
use crate::split::{Splitter, GPT4_PATTERN};
use crate::{BpeError, ChunkCounts};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyIterator, PySlice, PyString, PyType};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Most worker threads accepted. Beyond this rayon's start-up and wake-ups dominate (1,024
/// threads cost ~3 s per call on a 2-core machine, 5,000 ~50 s): a typo, not a setting.
const MAX_THREADS: usize = 1024;

/// How often the calling thread takes the GIL back to run Python's signal handlers while
/// the merge loop runs: Ctrl-C is noticed within this (plus one merge).
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// Version tag of the pickled state `(tag, pattern, [(left, right), ...])`.
const STATE_VERSION: u32 = 1;

/// The pickled state: `(STATE_VERSION, pattern, merges as (left id, right id))`.
type State = (u32, String, Vec<(u32, u32)>);

fn value_error(e: BpeError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Characters of an argument's repr an error message shows.
const SHOWN_CHARS: usize = 60;

/// `repr (type)` of a bad argument, cut to [`SHOWN_CHARS`]. Only the repr of what is shown is
/// built: a text (`str`, `bytes`, `bytearray`) is cut before its repr, and anything else goes
/// through `reprlib`, which bounds containers. The whole repr of a 200 MB `bytes` document (an
/// iterator of file contents, or `encode(data)`) took 1 s and 1 GB of memory, ~5x the text,
/// only to be cut to 60 characters.
fn describe(obj: &Bound<'_, PyAny>) -> String {
    let type_name = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    let is_text = obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>();
    let repr = if is_text {
        // one element more than shown, so the cut still shows
        let end = isize::try_from(SHOWN_CHARS + 1).unwrap_or(isize::MAX);
        obj.get_item(PySlice::new(obj.py(), 0, end, 1))
            .and_then(|head| head.repr())
            .map(|r| r.to_string())
    } else {
        obj.py()
            .import("reprlib")
            .and_then(|m| m.call_method1("repr", (obj,)))
            .map(|r| r.to_string())
    };
    let repr: String = repr
        .unwrap_or_else(|_| "?".into())
        .chars()
        .take(SHOWN_CHARS)
        .collect();
    format!("{repr} ({type_name})")
}

/// An int argument (bool rejected: `True` is an int to Python but never meant as a size).
fn int_arg(obj: &Bound<'_, PyAny>, name: &str, accepted: &str) -> PyResult<i64> {
    let bad = || {
        PyValueError::new_err(format!(
            "{name}: got {}; accepted: {accepted}",
            describe(obj)
        ))
    };
    if obj.is_instance_of::<PyBool>() {
        return Err(bad());
    }
    obj.extract::<i64>().map_err(|_| bad())
}

/// The `threads` argument: None, or an int from 1 to MAX_THREADS.
fn threads_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<usize>> {
    let accepted =
        format!("an int from 1 to {MAX_THREADS}, or None (RAYON_NUM_THREADS, else all cores)");
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => {
            let v = int_arg(o, "threads", &accepted)?;
            match usize::try_from(v) {
                Ok(n) if (1..=MAX_THREADS).contains(&n) => Ok(Some(n)),
                _ => Err(PyValueError::new_err(format!(
                    "threads: got {v}; accepted: {accepted}"
                ))),
            }
        }
    }
}

/// The `pattern` argument: a str (without lone surrogates), None or absent = the GPT-4 pattern.
fn pattern_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<String> {
    match obj {
        Some(p) if !p.is_none() => Ok(p
            .cast::<PyString>()
            .map_err(|_| {
                PyValueError::new_err(format!(
                    "pattern: got {}; accepted: a regex str or None",
                    describe(p)
                ))
            })?
            .to_str()
            .map_err(|e| {
                PyValueError::new_err(format!(
                    "pattern: not encodable as UTF-8 ({e}); accepted: a regex str without \
                     lone surrogates"
                ))
            })?
            .to_owned()),
        _ => Ok(GPT4_PATTERN.to_owned()),
    }
}

/// Worker threads: `threads`, else RAYON_NUM_THREADS read at every call (0 or unset: all
/// cores). Checked before the iterator is read.
fn thread_pool(threads: Option<usize>) -> PyResult<Arc<rayon::ThreadPool>> {
    let threads = match (threads, std::env::var("RAYON_NUM_THREADS")) {
        (Some(n), _) => n,
        (None, Ok(v)) if !v.trim().is_empty() => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n <= MAX_THREADS)
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "RAYON_NUM_THREADS: got {v:?}; accepted: an int from 0 to {MAX_THREADS} (0 or \
                     unset = all cores)"
                ))
            })?,
        _ => 0,
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("rustbpe-{i}"))
        .build()
        .map(Arc::new)
        .map_err(|e| {
            PyValueError::new_err(format!("could not start {threads} worker threads: {e}"))
        })
}

/// Pulls batches of `buffer_size` str from `iter` and sends them to the counting thread.
/// Returns how many texts were read. Stops early (Ok) if the counter hung up on an error.
fn feed(
    py: Python<'_>,
    iter: &mut Bound<'_, PyIterator>,
    buffer_size: usize,
    tx: &SyncSender<Vec<String>>,
) -> PyResult<usize> {
    let mut n = 0usize;
    loop {
        let mut batch = Vec::with_capacity(buffer_size.min(1 << 16));
        let mut exhausted = false;
        while batch.len() < buffer_size {
            let Some(item) = iter.next() else {
                exhausted = true;
                break;
            };
            let item = item?; // the iterator's own exception propagates unchanged
            let text = item.cast::<PyString>().map_err(|_| {
                PyValueError::new_err(format!(
                    "iterator: item {n} is {}; accepted: an iterable of str",
                    describe(&item)
                ))
            })?;
            let text = text.to_str().map_err(|e| {
                PyValueError::new_err(format!(
                    "iterator: item {n} is not encodable as UTF-8 ({e}); accepted: str without \
                     lone surrogates"
                ))
            })?;
            batch.push(text.to_owned());
            n += 1;
        }
        if !batch.is_empty() && py.detach(|| tx.send(batch)).is_err() {
            break;
        }
        if exhausted {
            break;
        }
        // An iterator implemented in C (a list, a file) runs no bytecode, so Python would not
        // run its signal handlers on its own: Ctrl-C while counting is raised here.
        py.check_signals()?;
    }
    Ok(n)
}

/// Splits and counts everything `iter` yields, on `pool`, overlapped with reading.
fn count_iterator(
    py: Python<'_>,
    iter: &mut Bound<'_, PyIterator>,
    buffer_size: usize,
    splitter: &Arc<Splitter>,
    pool: &Arc<rayon::ThreadPool>,
) -> PyResult<(ChunkCounts, usize)> {
    // Rendezvous channel: at most two batches alive, the one being counted and the next
    // one, read meanwhile and handed over when the worker is free.
    let (tx, rx) = sync_channel::<Vec<String>>(0);
    let (splitter, pool) = (Arc::clone(splitter), Arc::clone(pool));
    let worker = std::thread::Builder::new()
        .name("rustbpe-count".into())
        .spawn(move || -> Result<ChunkCounts, BpeError> {
            let mut counts = ChunkCounts::new();
            for batch in rx {
                pool.install(|| counts.add_batch(&splitter, &batch))?;
            }
            Ok(counts)
        })
        .map_err(|e| PyValueError::new_err(format!("could not start the counting thread: {e}")))?;
    let fed = feed(py, iter, buffer_size, &tx);
    drop(tx); // ends the worker's loop
    let joined = py.detach(move || worker.join());
    let n = fed?;
    let counts = joined
        .map_err(|_| PyValueError::new_err("internal error: the counting thread panicked"))?
        .map_err(value_error)?;
    Ok((counts, n))
}

/// Trains on `pool` in a helper thread while this thread waits with the GIL released,
/// taking it back every [`SIGNAL_POLL`] to run Python's signal handlers (only the main thread
/// may, and rayon workers never hold the GIL). If a handler raises (KeyboardInterrupt on
/// Ctrl-C), the merge loop is told to stop, joined, and that exception is returned unchanged:
/// no partial model is kept.
fn train_interruptibly(
    py: Python<'_>,
    splitter: Arc<Splitter>,
    counts: ChunkCounts,
    vocab_size: i64,
    pool: &Arc<rayon::ThreadPool>,
) -> PyResult<Bpe> {
    let cancel = Arc::new(AtomicBool::new(false));
    let (tx, mut rx) = sync_channel(1);
    let worker = {
        let (cancel, pool) = (Arc::clone(&cancel), Arc::clone(pool));
        std::thread::Builder::new()
            .name("rustbpe-train".into())
            .spawn(move || {
                let trained =
                    pool.install(|| Bpe::train_cancellable(splitter, counts, vocab_size, &cancel));
                // Err only if the receiver is gone, i.e. nobody wants the result any more.
                let _ = tx.send(trained);
            })
            .map_err(|e| {
                PyValueError::new_err(format!("could not start the training thread: {e}"))
            })?
    };
    loop {
        // The receiver is not Sync, so it travels into the GIL-free closure and back.
        let (back, got) = py.detach(move || {
            let got = rx.recv_timeout(SIGNAL_POLL);
            (rx, got)
        });
        rx = back;
        match got {
            Ok(trained) => {
                // Already finished sending: the join returns at once.
                let _ = py.detach(move || worker.join());
                return trained.map_err(value_error);
            }
            Err(RecvTimeoutError::Timeout) => {
                if let Err(raised) = py.check_signals() {
                    cancel.store(true, Ordering::Relaxed);
                    // The loop checks the flag before every merge, so this is quick; a panic
                    // there changes nothing for the caller, who gets the interrupt.
                    let _ = py.detach(move || worker.join());
                    return Err(raised);
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                let _ = py.detach(move || worker.join());
                return Err(PyValueError::new_err(
                    "internal error: the training thread panicked",
                ));
            }
        }
    }
}

/// Byte-level BPE tokenizer trainer (GPT-4 style split, incremental merges).
#[pyclass(name = "Tokenizer", module = "rustbpe", frozen)]
struct PyTokenizer {
    /// The current model; replaced whole, never mutated in place (see the module docs).
    bpe: Mutex<Arc<Bpe>>,
}

impl PyTokenizer {
    /// The current model. The lock is held only to clone the Arc (never across Python code
    /// or heavy work); a poisoned lock still holds a whole model, so it is used as is.
    fn model(&self) -> Arc<Bpe> {
        Arc::clone(&self.bpe.lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn set_model(&self, bpe: Bpe) {
        *self.bpe.lock().unwrap_or_else(PoisonError::into_inner) = Arc::new(bpe);
    }
}

#[pymethods]
impl PyTokenizer {
    #[new]
    fn new() -> PyResult<Self> {
        let splitter = Splitter::new(GPT4_PATTERN).map_err(value_error)?;
        Ok(PyTokenizer {
            bpe: Mutex::new(Arc::new(Bpe::new(Arc::new(splitter)))),
        })
    }

    /// Train from an iterable of str (consumed in batches of `buffer_size`), replacing any
    /// previous training. `vocab_size` counts the 256 byte tokens; `pattern` defaults to the
    /// GPT-4 split pattern. `threads`: worker threads (None: RAYON_NUM_THREADS, 0 or unset =
    /// all cores).
    #[pyo3(
        signature = (iterator, vocab_size, buffer_size = None, pattern = None, threads = None),
        text_signature = "(self, iterator, vocab_size, buffer_size=8192, pattern=None, threads=None)"
    )]
    fn train_from_iterator(
        &self,
        py: Python<'_>,
        iterator: &Bound<'_, PyAny>,
        vocab_size: &Bound<'_, PyAny>,
        buffer_size: Option<&Bound<'_, PyAny>>,
        pattern: Option<&Bound<'_, PyAny>>,
        threads: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        // Validate everything before reading a single item.
        let accepted = format!(
            "an int from 256 (the 256 byte tokens, no merges) to {}",
            crate::model::MAX_VOCAB_SIZE
        );
        let vocab_size = int_arg(vocab_size, "vocab_size", &accepted)?;
        merges_for_vocab_size(vocab_size).map_err(value_error)?;
        let buffer_size = match buffer_size {
            None => 8192,
            Some(b) => {
                let accepted = "an int >= 1 (texts per batch)";
                let v = int_arg(b, "buffer_size", accepted)?;
                usize::try_from(v).ok().filter(|&v| v >= 1).ok_or_else(|| {
                    PyValueError::new_err(format!("buffer_size: got {v}; accepted: {accepted}"))
                })?
            }
        };
        let pattern = pattern_arg(pattern)?;
        let splitter = Arc::new(Splitter::new(&pattern).map_err(value_error)?);
        let pool = thread_pool(threads_arg(threads)?)?;
        // A str is iterable too, but as single characters: training "one text per char"
        // would run and silently learn nothing useful (or only UTF-8 byte pairs).
        if iterator.is_instance_of::<PyString>() || iterator.is_instance_of::<PyBytes>() {
            return Err(PyValueError::new_err(format!(
                "iterator: got {}; accepted: an iterable of str (wrap a single text in a list)",
                describe(iterator)
            )));
        }
        let mut iter = iterator.try_iter().map_err(|_| {
            PyValueError::new_err(format!(
                "iterator: got {}; accepted: an iterable of str",
                describe(iterator)
            ))
        })?;

        let verbose = std::env::var_os("RUSTBPE_VERBOSE").is_some_and(|v| v != "0");
        let t0 = Instant::now();
        let (counts, n_texts) = count_iterator(py, &mut iter, buffer_size, &splitter, &pool)?;
        let t1 = Instant::now();
        let (n_unique, n_bytes) = (counts.len(), counts.unique_bytes());
        if verbose {
            eprintln!(
                "rustbpe: counted {n_texts} texts in {:.2}s; merging up to vocab_size \
                 {vocab_size}",
                (t1 - t0).as_secs_f64()
            );
        }
        let bpe = train_interruptibly(py, splitter, counts, vocab_size, &pool)?;
        if verbose {
            eprintln!(
                "rustbpe: {n_texts} texts -> {} unique chunks ({} bytes) in {:.2}s on {} threads; \
                 {} merges in {:.2}s",
                n_unique,
                n_bytes,
                (t1 - t0).as_secs_f64(),
                pool.current_num_threads(),
                bpe.vocab_size() - 256,
                t1.elapsed().as_secs_f64()
            );
        }
        self.set_model(bpe);
        Ok(())
    }

    /// The split regex in use (the GPT-4 pattern until trained with another).
    fn get_pattern(&self) -> String {
        self.model().pattern().to_owned()
    }

    /// `[(token bytes, rank)]`: the 256 single bytes, then merges in rank order.
    fn get_mergeable_ranks<'py>(&self, py: Python<'py>) -> Vec<(Bound<'py, PyBytes>, u32)> {
        self.model()
            .mergeable_ranks()
            .into_iter()
            .map(|(bytes, rank)| (PyBytes::new(py, &bytes), rank))
            .collect()
    }

    /// Token ids of `text` (reference encoder; use tiktoken for speed).
    fn encode(&self, py: Python<'_>, text: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let text = text
            .cast::<PyString>()
            .map_err(|_| {
                PyValueError::new_err(format!("text: got {}; accepted: str", describe(text)))
            })?
            .to_str()
            .map_err(|e| {
                PyValueError::new_err(format!(
                    "text: not encodable as UTF-8 ({e}); accepted: str without lone surrogates"
                ))
            })?;
        let bpe = self.model();
        py.detach(|| bpe.encode(text)).map_err(value_error)
    }

    /// `[(left id, right id, new id)]` in merge order.
    fn get_merges(&self) -> Vec<(u32, u32, u32)> {
        self.model().merges()
    }

    /// Pickle state: `(version, pattern, [(left id, right id), ...])`. With `__setstate__`
    /// this makes the trainer picklable and copyable (multiprocessing, `copy.deepcopy`).
    fn __getstate__(&self) -> State {
        let bpe = self.model();
        (
            STATE_VERSION,
            bpe.pattern().to_owned(),
            bpe.merge_pairs().to_vec(),
        )
    }

    /// `(Tokenizer, (), state)`: pickling through `__setstate__` under every protocol (the
    /// default reduction refuses this extension type for protocols 0 and 1).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> (Bound<'py, PyType>, (), State) {
        (slf.get_type(), (), slf.get().__getstate__())
    }

    /// Restores `__getstate__`'s tuple. A pickle is data from outside, so the state is
    /// checked (shape, version, pattern, every merge's ids): ValueError, never a panic.
    fn __setstate__(&self, state: &Bound<'_, PyAny>) -> PyResult<()> {
        let bad = |why: &str| {
            PyValueError::new_err(format!(
                "state: {why}; accepted: the (version {STATE_VERSION}, pattern, merges) tuple \
                 of Tokenizer.__getstate__"
            ))
        };
        let (version, pattern, merges) = state
            .extract::<State>()
            .map_err(|_| bad(&format!("got {}", describe(state))))?;
        if version != STATE_VERSION {
            return Err(bad(&format!("version {version} is not supported")));
        }
        let bpe = Bpe::from_parts(&pattern, merges).map_err(value_error)?;
        self.set_model(bpe);
        Ok(())
    }
}

/// ValueError unless training accepts `pattern` as its split pattern: it compiles and can never
/// match the empty string. `train_from_iterator` checks the same before it reads any text; this
/// lets a caller that reads its text first (or opens its data) refuse the pattern before that.
#[pyfunction]
#[pyo3(signature = (pattern))]
fn check_pattern(pattern: &Bound<'_, PyAny>) -> PyResult<()> {
    Splitter::new(&pattern_arg(Some(pattern))?).map_err(value_error)?;
    Ok(())
}

#[pymodule]
fn rustbpe(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTokenizer>()?;
    m.add_function(wrap_pyfunction!(check_pattern, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
