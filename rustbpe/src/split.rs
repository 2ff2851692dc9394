//! Pre-tokenization: splitting text into regex chunks before BPE.
//!
//! Any fancy-regex pattern works. The default GPT-4 pattern (with `\p{N}{1,2}`) is by far
//! the most used and fancy-regex runs it through its backtracking VM (possessive quantifiers
//! and a look-ahead), so for exactly that pattern a hand-written matcher is used instead.
//! It takes its character classes (`\p{L}`, `\p{N}`, `\s`, the case-folded contraction
//! letters) from regex-syntax, the same tables fancy-regex uses, and the unit tests check
//! that both paths produce identical chunks.

use crate::BpeError;
use fancy_regex::internal::{analyze, AnalyzeContext};
use fancy_regex::{Absent, Expr, Regex};
use regex_syntax::hir::{Class, HirKind};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// GPT-4's split pattern with numbers grouped by at most two digits (nanochat's choice).
pub const GPT4_PATTERN: &str = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";

/// A compiled split pattern. `Send + Sync`: shared by the counting threads.
pub struct Splitter {
    pattern: String,
    regex: Regex,
    fast: Option<Gpt4Matcher>,
}

impl Splitter {
    /// Compiles `pattern`; a bad regex is a [`BpeError::Pattern`], never a panic, and one
    /// that can match the empty string a [`BpeError::EmptyMatch`].
    pub fn new(pattern: &str) -> Result<Self, BpeError> {
        let bad = |e: fancy_regex::Error| BpeError::Pattern {
            pattern: pattern.to_string(),
            reason: e.to_string(),
        };
        let regex = Regex::new(pattern).map_err(bad)?;
        // Refused by its structure, not by trying texts: an empty alternative is taken only
        // where every other one fails, e.g. `\p{Co}*` after classes that leave out unassigned
        // code points, so the text that reaches it may be none a check (or the training text)
        // holds, and then a user's message panics tiktoken (or loses that character).
        let tree = Expr::parse_tree(pattern).map_err(bad)?;
        if analyze(&tree, AnalyzeContext::default())
            .map_err(bad)?
            .min_size
            == 0
        {
            return Err(BpeError::EmptyMatch {
                pattern: pattern.to_string(),
            });
        }
        if let Some(group) = missing_condition_group(&tree.expr, regex.captures_len()) {
            return Err(BpeError::Pattern {
                pattern: pattern.to_string(),
                reason: format!(
                    "the condition (?({group})...) tests capture group {group}, which the pattern \
                     does not have (fancy-regex compiles it, then panics while matching)"
                ),
            });
        }
        // `\K` drops what its match consumed before it from the reported match, so that text is
        // in no chunk: rustbpe refuses it only where the training text holds it, and tiktoken drops
        // it (`(?:\Ka)+` kept one "a" of "aa") or panics when nothing is left (`qz\K` on "qz").
        // The probes and the every-code-point check miss it whenever the text before `\K` is rare.
        if find_expr(&tree.expr, &|e| matches!(e, Expr::KeepOut).then_some(())).is_some() {
            return Err(BpeError::Pattern {
                pattern: pattern.to_string(),
                reason: "\\K (keep out) takes the text its match consumed before it out of the \
                         match: tiktoken drops that text, or panics when nothing is left (use a \
                         look-behind `(?<=...)` instead)"
                    .to_string(),
            });
        }
        let fast = if pattern == GPT4_PATTERN {
            Some(Gpt4Matcher::new()?)
        } else {
            None
        };
        Ok(Splitter {
            pattern: pattern.to_string(),
            regex,
            fast,
        })
    }

    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Calls `f` on every chunk of `text`, in order (never an empty one: [`Splitter::new`]
    /// refuses a pattern that could match the empty string). Text that no match covers is a
    /// [`BpeError::Input`]: tiktoken encodes only the matches, so a custom pattern that skips a
    /// character (e.g. `_`) silently dropped it from training and from every later encode.
    pub fn for_each_chunk<'t>(
        &self,
        text: &'t str,
        f: impl FnMut(&'t str),
    ) -> Result<(), BpeError> {
        match &self.fast {
            Some(m) => {
                m.for_each_chunk(text, f);
                Ok(())
            }
            None => self.for_each_chunk_regex(text, f),
        }
    }

    /// The generic path through fancy-regex (also the oracle for the fast path's tests). A panic
    /// inside fancy-regex (third-party code run on users' text and patterns; one is known, see
    /// [`missing_condition_group`]) is a [`BpeError::Matching`], not a dead counting thread or a
    /// PanicException out of `encode`.
    pub fn for_each_chunk_regex<'t>(
        &self,
        text: &'t str,
        f: impl FnMut(&'t str),
    ) -> Result<(), BpeError> {
        catch_unwind(AssertUnwindSafe(|| self.split_regex(text, f))).unwrap_or_else(|payload| {
            let why = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            Err(BpeError::Matching {
                reason: format!("fancy-regex panicked on {:?} ({why})", self.pattern),
            })
        })
    }

    fn split_regex<'t>(&self, text: &'t str, mut f: impl FnMut(&'t str)) -> Result<(), BpeError> {
        let mut covered = 0; // end of the text the matches so far cover
        for m in self.regex.find_iter(text) {
            let m = m.map_err(|e| BpeError::Matching {
                reason: e.to_string(),
            })?;
            if m.start() > covered {
                return Err(self.uncovered(&text[covered..m.start()]));
            }
            if !m.as_str().is_empty() {
                f(m.as_str());
            }
            covered = m.end();
        }
        if covered < text.len() {
            return Err(self.uncovered(&text[covered..]));
        }
        Ok(())
    }

    fn uncovered(&self, gap: &str) -> BpeError {
        let shown: String = gap.chars().take(40).collect();
        BpeError::Input(format!(
            "pattern: {:?} leaves {shown:?} of the text unmatched (tiktoken would drop it); \
             accepted: a regex whose matches cover every character, e.g. ending in |\\s+|.",
            self.pattern
        ))
    }
}

/// The group of the first `(?(N)...)` condition on a capture group the pattern does not have
/// (`groups` counts group 0): fancy-regex 0.20 compiles one and then indexes past its capture slots
/// while matching, a panic (tiktoken's fancy-regex too: `a(?(1))b|.` panicked it on "a").
fn missing_condition_group(expr: &Expr, groups: usize) -> Option<usize> {
    find_expr(expr, &|e| match e {
        Expr::BackrefExistsCondition { group, .. } => (*group >= groups).then_some(*group),
        _ => None,
    })
}

/// The first `Some` that `f` gives on `expr` or on a node below it (depth first, in pattern order).
fn find_expr<T>(expr: &Expr, f: &dyn Fn(&Expr) -> Option<T>) -> Option<T> {
    if let Some(found) = f(expr) {
        return Some(found);
    }
    // Spelled out, not Expr::children_iter: that panics (unimplemented!) on an unresolved AstNode.
    let children: Vec<&Expr> = match expr {
        Expr::Concat(v) | Expr::Alt(v) => v.iter().collect(),
        Expr::Group(e) => vec![e.as_ref()],
        Expr::LookAround(e, _) | Expr::AtomicGroup(e) => vec![e.as_ref()],
        Expr::Repeat { child, .. } => vec![child.as_ref()],
        Expr::DefineGroup { definitions } => vec![definitions.as_ref()],
        Expr::Conditional {
            condition,
            true_branch,
            false_branch,
        } => vec![
            condition.as_ref(),
            true_branch.as_ref(),
            false_branch.as_ref(),
        ],
        Expr::Absent(Absent::Repeater(e) | Absent::Stopper(e)) => vec![e.as_ref()],
        Expr::Absent(Absent::Expression { absent, exp }) => vec![absent.as_ref(), exp.as_ref()],
        _ => Vec::new(),
    };
    // The parser limits nesting, so this recursion is shallow.
    children.into_iter().find_map(|e| find_expr(e, f))
}

/// Character classes of the GPT-4 pattern. They are disjoint: `\p{L}`, `\p{N}` and `\s`
/// (Unicode White_Space) share no code point.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Cat {
    Letter,
    Number,
    Space,
    Other,
}

/// Hand-written matcher equivalent to [`GPT4_PATTERN`] under leftmost-first semantics.
struct Gpt4Matcher {
    ascii: [Cat; 128],
    /// Sorted, non-overlapping non-ASCII ranges of Letter/Number/Space; the rest is Other.
    ranges: Vec<(u32, u32, Cat)>,
    /// Case-insensitive sets for the contraction letters, e.g. `s` -> {S, s, U+017F}.
    fold: [Vec<char>; 8],
}

const FOLD_LETTERS: [char; 8] = ['s', 'd', 'm', 't', 'l', 'v', 'e', 'r'];

/// Code-point ranges of a Unicode class expression, from regex-syntax's tables.
fn class_ranges(expr: &str) -> Result<Vec<(char, char)>, BpeError> {
    let internal = |reason: String| BpeError::Pattern {
        pattern: expr.to_string(),
        reason,
    };
    let hir = regex_syntax::parse(expr).map_err(|e| internal(e.to_string()))?;
    match hir.kind() {
        HirKind::Class(Class::Unicode(cls)) => {
            Ok(cls.ranges().iter().map(|r| (r.start(), r.end())).collect())
        }
        HirKind::Literal(lit) => {
            let s = std::str::from_utf8(&lit.0).map_err(|e| internal(e.to_string()))?;
            Ok(s.chars().map(|c| (c, c)).collect())
        }
        other => Err(internal(format!("unexpected class shape {other:?}"))),
    }
}

impl Gpt4Matcher {
    fn new() -> Result<Self, BpeError> {
        let mut ranges = Vec::new();
        let mut ascii = [Cat::Other; 128];
        for (expr, cat) in [
            (r"\p{L}", Cat::Letter),
            (r"\p{N}", Cat::Number),
            (r"\s", Cat::Space),
        ] {
            for (lo, hi) in class_ranges(expr)? {
                for c in (lo as u32)..=(hi as u32).min(127) {
                    ascii[c as usize] = cat;
                }
                if hi as u32 >= 128 {
                    ranges.push(((lo as u32).max(128), hi as u32, cat));
                }
            }
        }
        ranges.sort_unstable_by_key(|&(lo, _, _)| lo);
        let mut fold: [Vec<char>; 8] = Default::default();
        for (set, letter) in fold.iter_mut().zip(FOLD_LETTERS) {
            for (lo, hi) in class_ranges(&format!("(?i:{letter})"))? {
                set.extend((lo as u32..=hi as u32).filter_map(char::from_u32));
            }
        }
        Ok(Gpt4Matcher {
            ascii,
            ranges,
            fold,
        })
    }

    #[inline]
    fn cat(&self, c: char) -> Cat {
        let u = c as u32;
        if u < 128 {
            return self.ascii[u as usize];
        }
        match self.ranges.binary_search_by(|&(lo, hi, _)| {
            if hi < u {
                std::cmp::Ordering::Less
            } else if lo > u {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        }) {
            Ok(i) => self.ranges[i].2,
            Err(_) => Cat::Other,
        }
    }

    fn is(&self, c: Option<char>, letter: usize) -> bool {
        c.is_some_and(|c| self.fold[letter].contains(&c))
    }

    /// End of the contraction starting after the apostrophe at `p` (`'s`, `'ll`, ...).
    fn contraction(&self, text: &str, p: usize) -> Option<usize> {
        let mut it = text[p..].chars();
        let c1 = it.next();
        if (0..4).any(|i| self.is(c1, i)) {
            return c1.map(|c| p + c.len_utf8());
        }
        let c2 = it.next();
        // ll, ve, re: indexes into FOLD_LETTERS
        for (a, b) in [(4, 4), (5, 6), (7, 6)] {
            if self.is(c1, a) && self.is(c2, b) {
                return Some(p + 2);
            }
        }
        None
    }

    /// End (byte offset) of the run of chars of category `cat` starting at `p`.
    fn run_end(&self, text: &str, p: usize, cat: Cat) -> usize {
        let bytes = text.as_bytes();
        let mut q = p;
        while q < bytes.len() {
            let b = bytes[q];
            if b < 128 {
                if self.ascii[b as usize] != cat {
                    break;
                }
                q += 1;
            } else {
                match text[q..].chars().next() {
                    Some(c) if self.cat(c) == cat => q += c.len_utf8(),
                    _ => break,
                }
            }
        }
        q
    }

    /// End of the match starting at `p` (always non-empty: every char is covered).
    fn match_at(&self, text: &str, p: usize) -> usize {
        let Some(c0) = text[p..].chars().next() else {
            return text.len();
        };
        let k0 = self.cat(c0);
        let p1 = p + c0.len_utf8();
        let c1 = text[p1..].chars().next();
        // 1: '(?i:[sdmt]|ll|ve|re)
        if c0 == '\'' {
            if let Some(e) = self.contraction(text, p1) {
                return e;
            }
        }
        // 2: [^\r\n\p{L}\p{N}]?+\p{L}+ (possessive: a taken prefix char is never given back,
        // and giving it back could not help since it is not a letter)
        if k0 == Cat::Letter {
            return self.run_end(text, p, Cat::Letter);
        }
        if k0 != Cat::Number
            && c0 != '\r'
            && c0 != '\n'
            && c1.map(|c| self.cat(c)) == Some(Cat::Letter)
        {
            return self.run_end(text, p1, Cat::Letter);
        }
        // 3: \p{N}{1,2}
        if k0 == Cat::Number {
            return match c1 {
                Some(c) if self.cat(c) == Cat::Number => p1 + c.len_utf8(),
                _ => p1,
            };
        }
        // 4: ` ?[^\s\p{L}\p{N}]++[\r\n]*`
        let q = if c0 == ' ' && c1.map(|c| self.cat(c)) == Some(Cat::Other) {
            p1
        } else {
            p
        };
        if q < text.len() && (q > p || k0 == Cat::Other) {
            let e = self.run_end(text, q, Cat::Other);
            let nl = text[e..]
                .bytes()
                .take_while(|&b| b == b'\r' || b == b'\n')
                .count();
            return e + nl;
        }
        // c0 is whitespace from here on.
        let end = self.run_end(text, p, Cat::Space);
        let run = &text[p..end];
        // 5: \s*[\r\n]: the longest prefix of the run ending in \r or \n
        if let Some(i) = run.rfind(['\r', '\n']) {
            return p + i + 1;
        }
        // 6: \s+(?!\S): the run to the end of text, or the run less its last char
        if end == text.len() {
            return end;
        }
        match run.char_indices().next_back() {
            Some((i, _)) if i > 0 => p + i,
            // 7: \s+ (a single whitespace char before a non-space)
            _ => end,
        }
    }

    fn for_each_chunk<'t>(&self, text: &'t str, mut f: impl FnMut(&'t str)) {
        let mut p = 0;
        while p < text.len() {
            let e = self.match_at(text, p);
            debug_assert!(e > p, "the GPT-4 matcher must always advance");
            f(&text[p..e]);
            p = e;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(s: &Splitter, text: &str, regex: bool) -> Vec<String> {
        let mut out = Vec::new();
        let push = |c: &str| out.push(c.to_string());
        if regex {
            s.for_each_chunk_regex(text, push).expect("regex split");
        } else {
            s.for_each_chunk(text, push).expect("split");
        }
        out
    }

    #[test]
    fn gpt4_examples() {
        let s = Splitter::new(GPT4_PATTERN).expect("compile");
        let got = chunks(&s, "Hello world! I'm 12345 \n\n  x's  'LL", false);
        let want = [
            "Hello", " world", "!", " I", "'m", " ", "12", "34", "5", " \n\n", " ", " x", "'s",
            " ", " '", "LL",
        ];
        assert_eq!(got, want);
    }

    /// Tiny deterministic generator so the test needs no extra crate.
    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn fast_path_matches_fancy_regex() {
        let s = Splitter::new(GPT4_PATTERN).expect("compile");
        assert!(s.fast.is_some());
        let alphabet: Vec<char> =
            "aZé中ßſK1٣½ \t\n\r\u{a0}\u{2028}\u{3000}'sSlLvVeErRtTdDmM.!-😀\u{301}\u{1c}\u{85}_"
                .chars()
                .collect();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20_000 {
            let len = (xorshift(&mut state) % 24) as usize;
            let text: String = (0..len)
                .map(|_| alphabet[(xorshift(&mut state) % alphabet.len() as u64) as usize])
                .collect();
            assert_eq!(
                chunks(&s, &text, false),
                chunks(&s, &text, true),
                "text {text:?}"
            );
        }
    }

    #[test]
    fn patterns_that_can_match_empty_are_refused() {
        // tiktoken panics on an empty match at the start of a text ("~" alone below) and drops
        // the character one skips elsewhere ("a~b" became "ab"): refused whatever the text.
        for pattern in [
            r"b|a*",
            r"a?",
            r"(?:)",
            r"\b",
            r"[^~]+|(?=~)|~",
            r"\p{L}+|\p{N}+|\s+|[\p{P}\p{S}\p{M}\p{Cc}\p{Cf}]+|\p{Co}*",
        ] {
            match Splitter::new(pattern) {
                Err(BpeError::EmptyMatch { pattern: p }) => assert_eq!(p, pattern),
                other => panic!(
                    "{pattern:?}: expected EmptyMatch, got {:?}",
                    other.map(|_| ())
                ),
            }
        }
        for pattern in [
            r"b|a+",
            r"\S+|\s+",
            r"(?=a)a|[^a]",
            r"x{1,3}|(?=y)y|.",
            GPT4_PATTERN,
        ] {
            let s = Splitter::new(pattern).expect(pattern);
            assert_eq!(chunks(&s, "baab", false).concat(), "baab");
        }
    }

    #[test]
    fn uncovered_text_is_an_error() {
        let s = Splitter::new(r"[^~]+").expect("compile");
        for text in ["a~b", "~ab", "ab~"] {
            match s.for_each_chunk(text, |_| {}) {
                Err(BpeError::Input(msg)) => assert!(msg.contains(r#""~""#), "{msg}"),
                other => panic!("expected an input error for {text:?}, got {other:?}"),
            }
        }
        assert!(s.for_each_chunk("abc", |_| {}).is_ok());
    }

    #[test]
    fn a_condition_on_a_missing_group_is_refused() {
        for (pattern, group) in [
            (r"a(?(1))b|.|\s", 1),
            (r"(a)(?(2)b|c)|.", 2),
            (r"(?:x|y(?>(?(3)y)))+|.", 3),
        ] {
            match Splitter::new(pattern) {
                Err(BpeError::Pattern { reason, .. }) => {
                    assert!(
                        reason.contains(&format!("capture group {group},")),
                        "{reason}"
                    )
                }
                other => panic!(
                    "{pattern:?}: expected a pattern error, got {:?}",
                    other.map(|_| ())
                ),
            }
        }
        let s = Splitter::new(r"(a)(?(1)b|c)|.|\s").expect("group 1 exists");
        assert_eq!(chunks(&s, "abac", false).concat(), "abac");
    }

    #[test]
    fn keep_out_is_refused() {
        // `qz\K` reports an empty match on "qz" (tiktoken panicked), `(?:\Ka)+` drops an "a".
        for pattern in [
            r"qz\K|\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+",
            r"(?:\Ka)+|.|\s",
            r"(?<=q\K)z|.|\s",
            r"\Ka|.|\s",
        ] {
            match Splitter::new(pattern) {
                Err(BpeError::Pattern { reason, .. }) => {
                    assert!(reason.contains(r"\K (keep out)"), "{reason}")
                }
                other => panic!(
                    "{pattern:?}: expected a pattern error, got {:?}",
                    other.map(|_| ())
                ),
            }
        }
        let s = Splitter::new(r"(?<=q)z|.|\s").expect("a look-behind is fine");
        assert_eq!(chunks(&s, "qz q", false).concat(), "qz q");
    }

    #[test]
    fn a_panic_inside_the_regex_path_is_a_matching_error() {
        let s = Splitter::new(r"\S+|\s+").expect("compile");
        match s.for_each_chunk_regex("ab cd", |c| assert_ne!(c, "cd", "stand-in panic")) {
            Err(BpeError::Matching { reason }) => assert!(reason.contains("panicked"), "{reason}"),
            other => panic!("expected a matching error, got {other:?}"),
        }
    }

    #[test]
    fn bad_pattern_is_an_error() {
        match Splitter::new("((") {
            Err(BpeError::Pattern { pattern, .. }) => assert_eq!(pattern, "(("),
            other => panic!("expected a pattern error, got {:?}", other.map(|_| ())),
        }
    }
}
